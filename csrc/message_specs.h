// What each (stage, microbatch)'s messages carry: the shapes of the activations it receives and sends
// (those of the gradients follow from them: tensor_spec.h, needing_grad), whether they are known yet (a
// discovery run learns them, pipecore/runtime/discovery.py), and, with shaped messages, each boundary's
// capacity (capacities.cpp).
#pragma once

#include <ATen/core/TensorBody.h>

#include <cstdint>
#include <vector>

#include "program.h"
#include "tensor_spec.h"

namespace pipecore {

class MessageSpecs {
 public:
  explicit MessageSpecs(SlotGrid grid);

  // What `key`'s stage receives from the previous stage (activations) and sends to the next one.
  void set_input(size_t key, std::vector<TensorSpec> recv_f, at::TensorOptions options);
  void set_output(size_t key, std::vector<TensorSpec> send_f, at::TensorOptions options);
  // Every message's shapes unknown, to be learnt by a discovery run.
  void forget();
  // No message travels for `key`'s activations received (`input`) or sent, in this run or its aborted rest:
  // its sender's step failed before its forward produced them.
  void mark_absent(size_t key, bool input);
  bool input_known(size_t key) const { return input_known_[key] != 0; }
  bool output_known(size_t key) const { return output_known_[key] != 0; }
  // The message action `in` (a SEND or RECV, or F, B, I for what they consume) sends or receives; with
  // shaped messages, a capacity. A SEND_B whose activations never came sends nothing.
  std::vector<TensorSpec> of(const Instr& in) const;
  // The same, without a copy, for a RECV_F/F or RECV_B/B/I.
  const std::vector<TensorSpec>& received(const Instr& in) const;
  const at::TensorOptions& options(const Instr& in) const { return options_[grid_.key(in)]; }
  size_t key(const Instr& in) const { return grid_.key(in); }

  // Shaped messages (capacities.cpp). At a run's start every boundary's receives take, per tensor, the
  // most elements that its microbatches were set or that crossed it in an earlier run (both sides of a
  // boundary see the same messages, so both widen alike).
  void widen_to_capacities();
  // What crossed stage `stage`'s boundary from the previous stage (in) or to the next one (out).
  void crossed_in(int64_t stage, std::vector<TensorSpec> message);
  void crossed_out(int64_t stage, std::vector<TensorSpec> message);

 private:
  SlotGrid grid_;
  std::vector<std::vector<TensorSpec>> recv_f_, recv_b_, send_f_;  // [key]
  std::vector<at::TensorOptions> options_;                          // [key]
  std::vector<uint8_t> input_known_;   // [key]: recv_f set
  std::vector<uint8_t> output_known_;  // [key]: send_f and recv_b set
  // [stage]: per tensor, the most elements that crossed its boundary from the previous stage (in) or to the
  // next one (out), in any run so far (empty: none yet)
  std::vector<std::vector<TensorSpec>> crossed_in_, crossed_out_;
};

}  // namespace pipecore
