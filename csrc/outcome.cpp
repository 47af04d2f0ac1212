#include "outcome.h"

#include <stdexcept>

#include "errors.h"

namespace pipecore {

Outcome Outcome::of_status(int64_t status, std::string text) {
  Outcome out;
  out.kind = status == kMessageOk        ? kOk
             : status == kMessageAborted ? kPeer
             : status == kMessageReplan  ? kReplan
                                         : kComm;  // not pipecore's: the channel is out of step
  out.text = std::move(text);
  return out;
}

Outcome Outcome::of_current_exception() {
  Outcome out;
  try {
    throw;
  } catch (const PeerAbort& e) {
    out.kind = kPeer;
    out.text = e.what();
  } catch (const PeerReplan& e) {
    out.kind = kReplan;
    out.text = e.what();
  } catch (const CommError& e) {
    out.kind = kComm;
    out.text = e.what();
    out.cause = e.cause;
  } catch (...) {
    out.kind = kOrigin;
    out.origin = std::current_exception();
  }
  return out;
}

void Outcome::raise() const {
  switch (kind) {
    case kOrigin:
      std::rethrow_exception(origin);
    case kPeer:
      throw PeerAbort(text);
    case kReplan:
      throw PeerReplan(text);
    case kComm:
      throw CommError(text, cause);
    case kOk:
      break;
  }
  throw std::logic_error("pipecore: an ok outcome raised");
}

}  // namespace pipecore
