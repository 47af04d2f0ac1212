// The run: the program executed once, and when an action fails the abort protocol that releases every
// peer (the rest of the program without compute, its messages carrying the step's status) before the
// failure is rethrown as what it means for the caller.
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"
#include "message_status.h"
#include "outcome.h"
#include "send_tracker.h"

namespace pipecore {

void Slot::drop_compute() {
  out_edges.clear();
  loss_edge = torch::autograd::Edge();
  outputs.clear();
  weight = WeightWork();
  input_grads.clear();
  out_grads.clear();
}

void Executor::run(const ForwardFn& forward, const AbortFn& on_abort, const SpecFn* discover) {
  // A discovery run posts no receive ahead (prefetch_recvs): a receive's shapes are known only once
  // its sender's forward ran. On the device path its batches still go as one group each, at their
  // first action ([Note: NCCL pair order]), their receives' shapes learnt first; the host reads each
  // message (its trailer says whether the peer's step was aborted or its shapes changed) and waits
  // for it (host_reads).
  struct RunScope {
    RunContext& run;
    ~RunScope() { run = RunContext(); }  // however the run ends
  } scope{run_};
  run_.discover = discover;
  run_.may_wait = true;
  struct Profiled {  // the run's time, however it ends
    StepProfile& profile;
    ~Profiled() { profile.end(); }
  } profiled{profile_};
  begin_run(forward);
  const Outcome outcome = explained_by_step_status(execute_program());
  if (outcome.ok()) return end_step();
  tell_abort(outcome, on_abort);
  rethrow(outcome, release_peers(outcome));
}

void Executor::run_aborted(int64_t status) {
  reset();
  if (shaped_.travel) specs_.widen_to_capacities();
  const std::string comm_failure = finish_aborted(0, /*wait=*/true, status);
  if (!comm_failure.empty()) throw CommError(comm_failure);
}

void Executor::reset() {
  window_.reset(program_.recv_instrs.size());
  counts_ = Counts();
  if constexpr (kTesting) recv_posted_at_.assign(program_.recv_instrs.size(), -1);
  clear_slots();
  sends_->clear_failure();
  sends_->reset_peak();
  last_send_posted_ = -1;
  posted_through_ = 0;
  kept_.clear();
}

void Executor::begin_run(const ForwardFn& forward) {
  reset();
  if (shaped_.travel) specs_.widen_to_capacities();
  profile_.begin(profile_on_);
  comm_failure_.clear();
  freed_outputs_ = 0;
  begin_trace();
  forward_ = &forward;
  if (device_comm_) device_comm_->begin_step();
}

Outcome Executor::execute_program() {
  size_t i = 0;
  try {
    for (; i < program_.size(); ++i) {
      check_sends();
      if (!device_comm_) prefetch_recvs(i);  // the device path posts receives with their batch
      if (program_[i].op == kOverlapBegin) {
        i = exec_pair(i);  // on failure, i is the failed action's
      } else {
        exec_traced(i);
      }
    }
    drain_sends();
    if (device_comm_) await_step_status();
  } catch (...) {
    Outcome failed = Outcome::of_current_exception();
    failed.at = i;
    return failed;
  }
  return Outcome();
}

Outcome Executor::explained_by_step_status(Outcome outcome) {
  // The device path computes on what arrived before its status is known: on a peer's aborted or
  // "shapes changed" message (zeros of the old shapes) a stage or the loss may fail (this step's
  // targets against the old shapes). Then the status says what happened; this error is its echo.
  if (outcome.kind != Outcome::kOrigin || !device_comm_) return outcome;
  int64_t status = kMessageOk;
  try {
    if (!device_comm_->finish_step(timeout_, status) || status == kMessageOk) return outcome;
  } catch (...) {
    return outcome;  // the status cannot be read: this rank's error stands
  }
  Outcome explained = Outcome::of_status(status, step_status_text(who_, status) + " (here that made action " +
                                                     action_name(outcome.at) + " fail: " + error_text(outcome.origin) +
                                                     ")");
  explained.at = outcome.at;
  return explained;
}

void Executor::end_step() {
  clear_slots();  // the step is done: drop graphs, buffers, received tensors
  kept_.clear();
  send_scratch_ = at::Tensor();  // (grown device messages' parts: sends in flight keep theirs)
}

void Executor::tell_abort(const Outcome& outcome, const AbortFn& on_abort) {
  if (outcome.kind != Outcome::kOrigin || !on_abort) return;
  try {
    on_abort(error_text(outcome.origin), action_name(outcome.at));
  } catch (...) {
  }
}

std::string Executor::release_peers(const Outcome& outcome) {
  for (auto& s : slots_) s.drop_compute();  // graphs and activations are not needed any more
  // After a broken connection or a timeout, waiting again could take a timeout per receive: only the
  // sends are posted then. The failed action runs again aborted: it may have failed before posting.
  // On the device path nothing more goes: posting onto the wedged communicator could block this thread
  // in the group's end until c10d's watchdog ends the process; the caller aborts it (Comm.abandon_group).
  const bool wedged = outcome.kind == Outcome::kComm && device_comm_;
  const std::string comm_failure = finish_aborted(wedged ? program_.size() : outcome.at,
                                                  /*wait=*/outcome.kind != Outcome::kComm, outcome.status_for_peers());
  kept_.clear();
  return comm_failure;
}

void Executor::rethrow(const Outcome& outcome, const std::string& comm_failure) {
  if (outcome.kind == Outcome::kOrigin) {
    comm_failure_ = comm_failure;  // (last_comm_failure: this rank's own error stands)
  } else if (outcome.kind != Outcome::kComm && !comm_failure.empty()) {
    throw CommError(outcome.text + "; then: " + comm_failure);  // releasing the peers broke the group
  }
  outcome.raise();
}

std::string Executor::finish_aborted(size_t from, bool wait, int64_t status) {
  // The rest of the program without compute: receives posted and drained, sends carry `status`.
  std::string comm_failure;
  run_.may_wait = wait;
  for (size_t j = from; j < program_.size(); ++j) {
    try {
      exec(j, RunMode{/*aborted=*/true, run_.may_wait, status});  // (after learn_specs timed out, no action waits)
    } catch (const std::exception& e) {
      if (comm_failure.empty()) comm_failure = e.what();
    }
  }
  if (wait) {
    try {
      drain_sends();
    } catch (const std::exception& e) {
      if (comm_failure.empty()) comm_failure = e.what();
    }
  }
  clear_slots();
  recv_scratch_ = send_scratch_ = at::Tensor();  // in-flight sends keep theirs alive as long as needed
  return comm_failure;
}

std::string Executor::action_name(size_t index) const {
  return index < program_.size() ? program_.label(program_[index]) : std::string("end of step");
}

}  // namespace pipecore
