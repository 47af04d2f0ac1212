// The shapes of messages: set by Python between steps, or learnt by a discovery run as it reaches each
// message (pipecore/runtime/discovery.py).
#include <c10/util/Exception.h>

#include <sstream>

#include "diagnostics.h"
#include "executor.h"

namespace pipecore {

namespace {
void check_slot(const SlotGrid& grid, int64_t stage, int64_t mb) {
  TORCH_CHECK(stage >= 0 && stage < grid.stages && mb >= 0 && mb < grid.microbatches, "pipecore: bad spec index");
}
}  // namespace

void Executor::set_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, std::vector<TensorSpec> send_f,
                         at::TensorOptions options) {
  set_input_specs(stage, mb, std::move(recv_f), options);
  set_output_specs(stage, mb, std::move(send_f), options);
}

void Executor::set_input_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, at::TensorOptions options) {
  check_slot(grid_, stage, mb);
  specs_.set_input(grid_.key(stage, mb), std::move(recv_f), options);
}

void Executor::set_output_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> send_f,
                                at::TensorOptions options) {
  check_slot(grid_, stage, mb);
  specs_.set_output(grid_.key(stage, mb), std::move(send_f), options);
}

bool Executor::learn_specs(const Instr& in, bool aborted) {
  const size_t key = grid_.key(in);
  const bool input = in.op == kRecvF;  // (else a SEND_F's: this stage's outputs)
  auto known = [&] { return input ? specs_.input_known(key) : specs_.output_known(key); };
  if (known()) return true;
  TORCH_CHECK(run_.discovering(), where(in), ": no shapes known for this message");
  int64_t answer;
  {
    SpentOn spent(profile_, Spent::kWait);  // for the peer's forward that makes them known
    const WaitingOn waiting(flight_, in.peer, in.mb,
                            input ? "shapes of the activations" : "shapes of its outputs");
    answer = (*run_.discover)(in.stage, in.mb, input ? kRecvF : kSendF, !aborted || run_.may_wait);
    if (answer == kSpecsTimedOut) {  // (thrown here: the flight record keeps the wait that failed)
      run_.may_wait = false;  // the rest of an aborted run does not wait a timeout per receive
      throw CommError(not_within(where(in) + ": the shapes of microbatch " + std::to_string(in.mb) +
                                     "'s activations did not arrive from rank " + std::to_string(in.peer),
                                 timeout_,
                                 "its forward of the first step with this batch shape did not finish: a first "
                                 "forward that compiles or loads for longer needs a larger timeout="));
    }
  }
  if (answer == kSpecsSet) {
    TORCH_CHECK(known(), where(in), ": the spec source answered without setting the shapes");
    return true;
  }
  specs_.mark_absent(key, input);  // no message travels for it, in this run or its aborted rest
  if (input && !aborted) {
    std::ostringstream os;
    os << where(in) << ": rank " << in.peer << "'s step failed before it produced the activations of microbatch "
       << in.mb;
    throw PeerAbort(os.str());
  }
  return false;
}

std::vector<TensorSpec> Executor::learn_send_specs(const Instr& in) {
  if (carries_activations(in.op) && !learn_specs(in, /*aborted=*/true)) return {};
  return specs_.of(in);
}

}  // namespace pipecore
