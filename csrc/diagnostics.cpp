#include "diagnostics.h"

#include <sstream>

#include "message_status.h"

namespace pipecore {

std::chrono::milliseconds timeout_of(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::string seconds(std::chrono::milliseconds timeout) {
  std::ostringstream os;
  os << timeout.count() / 1000.0 << " s";
  return os.str();
}

std::string out_of_step(const std::string& where, const char* what, int64_t mb, int64_t peer, const char* how) {
  std::ostringstream os;
  os << where << ": the " << what << " of microbatch " << mb << " from rank " << peer << " " << how
     << ": the messages between the two ranks " << kOutOfStepCause;
  return os.str();
}

std::string wait_failure(const std::string& where, const char* what, int64_t mb, int64_t peer,
                         std::chrono::milliseconds timeout, const char* why) {
  std::ostringstream os;
  os << where << ": waiting for " << what << " of microbatch " << mb << " from rank " << peer << " failed (timeout "
     << seconds(timeout) << "): " << why;
  return os.str();
}

std::string step_status_text(const std::string& who, int64_t status) {
  std::ostringstream os;
  os << "pipecore " << who << ": ";
  if (status == kMessageUnknown) {
    os << "a message received in this step does not end with pipecore's trailer: the messages between this rank "
          "and a peer "
       << kOutOfStepCause;
  } else if (status == kMessageReplan) {
    os << "messages of this step say a first stage's batch changed shape";
  } else {
    os << "messages of this step say a peer's step was aborted";
  }
  return os.str();
}

}  // namespace pipecore
