// How a run ended, and what a message status means for it: one table from a status (message_status.h)
// to a kind of failure, to the exception the caller gets. Every path that reads a status (a received
// message's trailer or header, the device path's step status) and the run's abort protocol ask it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "message_status.h"

namespace pipecore {

struct Outcome {
  enum Kind {
    kOk,
    kOrigin,  // this rank's own error (a stage's forward, out of memory): rethrown as it was
    kPeer,    // a peer's step failed (PeerAbort)
    kReplan,  // a first stage's batch changed shape: agree again, run again (PeerReplan)
    kComm,    // a wait timed out, a connection broke or a channel is out of step (CommError)
  } kind = kOk;
  std::exception_ptr origin;  // kOrigin
  std::string text;           // the others: what happened
  std::string cause;          // kComm: the backend's text (CommError::cause)
  size_t at = 0;              // the program index the run stopped at

  bool ok() const { return kind == kOk; }
  // What a message status says happened (kMessageOk: nothing), in `text`.
  static Outcome of_status(int64_t status, std::string text);
  // The current exception, as an outcome (PeerAbort, PeerReplan and CommError by their kind).
  static Outcome of_current_exception();
  // The status the aborted rest of the program carries to the peers: a replan travels on, any other
  // failure says "aborted".
  int64_t status_for_peers() const { return kind == kReplan ? kMessageReplan : kMessageAborted; }
  // Throws what it means: the origin itself, or PeerAbort, PeerReplan, CommError with `text`.
  [[noreturn]] void raise() const;
};

// Throws what a `status` other than ok says, in the text `text()` makes (asked only then: a message's
// status is read on the hot path).
template <typename TextFn>
void raise_if_failed(int64_t status, TextFn&& text) {
  if (status != kMessageOk) Outcome::of_status(status, text()).raise();
}

}  // namespace pipecore
