#include "diagnostics.h"

#include <sstream>

#include <c10/util/Exception.h>

#include "errors.h"
#include "message_status.h"

namespace pipecore {

std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return error_text(e);
  } catch (...) {
    return "unknown error";
  }
}

std::string error_text(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);  // (c10d's, NCCL's: not the C++ backtrace)
  std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : error.what();
  const size_t traceback = text.find("\n\nAt:\n");
  if (traceback != std::string::npos) text.resize(traceback);
  const auto* comm = dynamic_cast<const CommError*>(&error);
  if (comm != nullptr && !comm->cause.empty()) text += ": " + comm->cause;  // (a CommError that becomes a cause)
  return text;
}

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

std::string failed_waiting(const std::string& subject, std::chrono::milliseconds timeout, const char* why) {
  return subject + " failed (timeout " + seconds(timeout) + ")" + (why != nullptr ? std::string(": ") + why : "");
}

std::string wait_failure(const std::string& where, const char* what, int64_t mb, int64_t peer,
                         std::chrono::milliseconds timeout, const char* why) {
  std::ostringstream os;
  os << where << ": waiting for " << what << " of microbatch " << mb << " from rank " << peer;
  return failed_waiting(os.str(), timeout, why);
}

std::string not_within(const std::string& what, std::chrono::milliseconds timeout, const char* why) {
  return what + " within " + seconds(timeout) + " (" + why + ")";
}

std::string not_posted(const std::string& where, bool send, int64_t peer, std::chrono::milliseconds timeout) {
  return not_within(where + ": " + (send ? "a send to" : "a receive from") + " rank " + std::to_string(peer) +
                        " was not posted",
                    timeout, kPostingStuck);
}

namespace {
// What messages with a status of a peer's failure say (`sender`: whose step it was).
std::string says(int64_t status, const char* sender) {
  return status == kMessageReplan ? "say a first stage's batch changed shape"
                                  : std::string("say ") + sender + " step was aborted";
}
}  // namespace

std::string message_status_text(const std::string& where, const char* what, int64_t mb, int64_t peer, int64_t status,
                                const char* how) {
  if (!says_peer_failed(status)) return out_of_step(where, what, mb, peer, how);
  std::ostringstream os;
  os << where << ": the " << what << " of microbatch " << mb << " from rank " << peer << " " << says(status, "the sender's");
  return os.str();
}

std::string step_status_text(const std::string& who, int64_t status) {
  std::ostringstream os;
  os << "pipecore " << who << ": ";
  if (!says_peer_failed(status)) {
    os << "a message received in this step does not end with pipecore's trailer: the messages between this rank "
          "and a peer "
       << kOutOfStepCause;
  } else {
    os << "messages of this step " << says(status, "a peer's");
  }
  return os.str();
}

}  // namespace pipecore
