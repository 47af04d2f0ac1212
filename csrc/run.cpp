// The run: the program executed once, and when an action fails the abort protocol that releases every
// peer (the rest of the program without compute, its messages carrying the step's status) before the
// failure is rethrown as what it means for the caller.
#include "diagnostics.h"
#include "executor.h"
#include "outcome.h"

namespace pipecore {

namespace {
bool failed(const CommError& comm_failure) { return comm_failure.what()[0] != '\0'; }
// A failure while releasing the peers: a CommError as it is (its cause apart), any other as its text.
CommError as_comm_error(const std::exception& e) {
  if (const auto* comm = dynamic_cast<const CommError*>(&e)) return *comm;
  return CommError(error_text(e));
}
}  // namespace

void Slot::drop_compute() {
  out_edges.clear();
  loss_edge = torch::autograd::Edge();
  outputs.clear();
  weight = WeightWork();
  input_grads.clear();
  out_grads.clear();
}

void Executor::run(const ForwardFn& forward, const AbortFn& on_abort, const SpecFn* discover) {
  // A discovery run posts no receive ahead: a receive's shapes are known only once its sender's forward
  // ran. On the device path its batches still go as one group each, at their first action ([Note: NCCL
  // pair order]), their receives' shapes learnt first; the host reads each message (its trailer says
  // whether the peer's step was aborted or its shapes changed) and waits for it (device_path.cpp).
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
  Outcome outcome = execute_program();
  if (outcome.ok()) return end_step();
  const int64_t failed_ns = FlightRecord::now_ns();  // (explaining it may wait for the step's status)
  const std::string failed_action = action_name(outcome.at);
  outcome = path_->explained(std::move(outcome), failed_action);
  if (outcome.kind != Outcome::kOrigin) {  // (a peer's "aborted" message ended the wait: that wait failed)
    flight_.keep_last_wait(flight_.action_since_ns(), failed_ns);
  }
  flight_.set_phase(FlightRecord::kAbort);
  tell_abort(outcome, on_abort);
  rethrow(outcome, release_peers(outcome));
}

void Executor::run_aborted(int64_t status) {
  stepped_ = true;
  reset();
  flight_.begin_run();  // (a run of its own: the last run's failed wait and messages are past)
  if (path_->format().shaped) specs_.widen_to_capacities();
  const CommError comm_failure = finish_aborted(0, /*wait=*/true, status);
  if (failed(comm_failure)) throw comm_failure;
}

void Executor::reset() {
  path_->reset(program_.recv_instrs.size());
  clear_slots();
  kept_.clear();
}

void Executor::begin_run(const ForwardFn& forward) {
  stepped_ = true;
  reset();
  if (path_->format().shaped) specs_.widen_to_capacities();
  profile_.begin(profile_on_);
  flight_.set_phase(run_.discovering() ? FlightRecord::kDiscovery : FlightRecord::kRun);
  flight_.begin_run();
  comm_failure_ = {};
#ifdef PIPECORE_TESTING
  freed_outputs_ = 0;
#endif
  begin_trace();
  forward_ = &forward;
  path_->begin_step();
}

void Executor::clear_slots() {
  path_->let_go_all(slots_);
  for (auto& s : slots_) s = Slot();
}

Outcome Executor::execute_program() {
  size_t i = 0;
  try {
    for (; i < program_.size(); ++i) {
      flight_.begin_action(static_cast<int64_t>(i));
      path_->check_sends();
      path_->before(i);  // (the host path's receive window)
      if (program_[i].op == kOverlapBegin) {
        i = exec_pair(i);  // on failure, i is the failed action's
      } else {
        exec_traced(i);
      }
      flight_.end_action();
    }
  } catch (...) {
    Outcome failed = Outcome::of_current_exception();
    failed.at = i;
    return failed;
  }
  Outcome finished = path_->finish_step();
  if (!finished.ok()) finished.at = program_.size();
  return finished;
}

void Executor::end_step() {
  flight_.settle_messages();  // (every send completed and, on the device path, the step's status was read)
  clear_slots();  // the step is done: drop graphs, buffers, received tensors
  kept_.clear();
  path_->drop_scratch(/*receives_too=*/false);  // (grown device messages' parts: sends in flight keep theirs)
}

void Executor::tell_abort(const Outcome& outcome, const AbortFn& on_abort) {
  if (outcome.kind != Outcome::kOrigin || !on_abort) return;
  try {
    on_abort(error_text(outcome.origin), action_name(outcome.at));
  } catch (...) {
  }
}

CommError Executor::release_peers(const Outcome& outcome) {
  for (auto& s : slots_) s.drop_compute();  // graphs and activations are not needed any more
  // After a broken connection or a timeout, waiting again could take a timeout per receive: only the
  // sends are posted then. The failed action runs again aborted: it may have failed before posting.
  // Where the path may not post after it (the device path's wedged communicator), nothing more goes.
  CommError comm_failure = finish_aborted(path_->may_post_after(outcome) ? outcome.at : program_.size(),
                                         /*wait=*/outcome.kind != Outcome::kComm, outcome.status_for_peers());
  kept_.clear();
  return comm_failure;
}

void Executor::rethrow(const Outcome& outcome, const CommError& comm_failure) {
  if (outcome.kind == Outcome::kOrigin) {
    // (last_comm_failure: this rank's own error stands)
    comm_failure_.text = comm_failure.what();
    comm_failure_.cause = comm_failure.cause;
  } else if (outcome.kind != Outcome::kComm && failed(comm_failure)) {
    // releasing the peers broke the group: pipecore's sentences, the backend's text as the cause
    throw CommError(outcome.text + "; then: " + comm_failure.what(), comm_failure.cause);
  }
  outcome.raise();
}

CommError Executor::finish_aborted(size_t from, bool wait, int64_t status) {
  // The rest of the program without compute: receives posted and drained, sends carry `status`.
  CommError comm_failure("");
  run_.may_wait = wait;
  flight_.mark();  // (the aborted rest's first action starts now)
  bool may_post = true;
  for (size_t j = from; j < program_.size() && may_post; ++j) {
    flight_.begin_action(static_cast<int64_t>(j));
    try {
      exec(j, RunMode{/*aborted=*/true, run_.may_wait, status});  // (after learn_specs timed out, no action waits)
    } catch (const std::exception& e) {
      if (!failed(comm_failure)) comm_failure = as_comm_error(e);
      // a wait or a posting failed: the group is broken, and each later wait could take a timeout of its own
      // (a peer that is silent, not dead): the rest only posts, so the release takes one timeout at most; and
      // nothing more where posting onto the broken communicator could block (the device path's)
      const Outcome failure = Outcome::of_current_exception();
      if (failure.kind == Outcome::kComm) {
        run_.may_wait = false;
        may_post = path_->may_post_after(failure);
      }
    }
    flight_.end_action(/*kept=*/false);
  }
  if (run_.may_wait) {
    try {
      path_->drain_sends();
    } catch (const std::exception& e) {
      if (!failed(comm_failure)) comm_failure = as_comm_error(e);
    }
  }
  clear_slots();
  path_->drop_scratch(/*receives_too=*/true);  // in-flight sends keep theirs alive as long as needed
  return comm_failure;
}

std::string Executor::action_name(size_t index) const {
  return index < program_.size() ? program_.label(program_[index]) : std::string("end of step");
}

}  // namespace pipecore
