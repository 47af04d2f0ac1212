// One dispatch of an action, for a normal run and an aborted one alike: an aborted run keeps only the
// communication (receives posted and drained, sends carrying the step's status), so every peer gets
// every message it waits for. Safe on an action that already posted its message: nothing goes twice.
#include <c10/util/Exception.h>

#include <optional>

#include "executor.h"
#include "grad_reduce.h"
#include "trace.h"

namespace pipecore {

void Executor::exec(size_t index, const RunMode& mode) {
  const Instr& in = program_[index];
  std::optional<ActionScope> scope;
  if (!mode.aborted) scope.emplace(program_.label(in));
  if (!mode.aborted && program_.last_backward_of[index] >= 0) {
    // A dw_builder's runner writes .grad outside the engine, after the hooks that send buckets: such a
    // stage's buckets all go at its REDUCE_GRAD.
    if (stages_.reducer && !builds_weight(in.stage)) stages_.reducer->arm(in.stage);
    stage_event(kLastBackwardEvent, in.stage);
  }
  switch (in.op) {
    case kF:
      if (!mode.aborted) return do_forward(in);
      return path_->drop(slot(in).recv_f, in, mode.wait);
    case kB:
    case kI:
      if (!mode.aborted) return do_backward(in, /*split=*/in.op == kI);
      return path_->drop(slot(in).recv_b, in, mode.wait);
    case kW:
      if (!mode.aborted) do_weight(in);
      return;
    case kRecvF:
    case kRecvB:
    case kSendF:
    case kSendB:
      return path_->post(index, mode);
    case kReduceGrad:
      if (mode.aborted) return;
      if (stages_.reducer) stages_.reducer->reduce_stage(in.stage);
      return stage_event(kReduceGrad, in.stage);
    case kUnshard:
    case kReshard:
      if (!mode.aborted) stage_event(in.op, in.stage);
      return;
    case kOverlapBegin:
    case kOverlapEnd:
      return;
    default:
      TORCH_CHECK(false, "pipecore: unknown opcode ", in.op);
  }
}

}  // namespace pipecore
