// The errors the executor and its communication raise, by what the caller must do about them. Every
// file that throws or catches one includes this header alone (not the executor's).
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace pipecore {

// A peer's step failed: its messages say so. This rank ran its program to the end without compute.
struct PeerAbort : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A first stage's batch changed shape: this step was not run; agree on the new shapes, run again.
struct PeerReplan : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A wait timed out or a peer's connection broke: the group cannot be trusted any more. `cause`: the
// backend's own text (gloo's, NCCL's), which Python gets as the error's __cause__ (bindings.cpp), so that
// pipecore's sentence comes first and the backend's text once.
struct CommError : std::runtime_error {
  explicit CommError(const std::string& text, std::string cause = std::string())
      : std::runtime_error(text), cause(std::move(cause)) {}
  std::string cause;
};

}  // namespace pipecore
