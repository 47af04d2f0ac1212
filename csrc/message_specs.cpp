#include "message_specs.h"

#include <algorithm>

namespace pipecore {

MessageSpecs::MessageSpecs(SlotGrid grid)
    : grid_(grid),
      recv_f_(grid.size()),
      recv_b_(grid.size()),
      send_f_(grid.size()),
      options_(grid.size()),
      input_known_(grid.size(), 0),
      output_known_(grid.size(), 0),
      crossed_in_(grid.stages),
      crossed_out_(grid.stages) {}

void MessageSpecs::set_input(size_t key, std::vector<TensorSpec> recv_f, at::TensorOptions options) {
  recv_f_[key] = std::move(recv_f);
  options_[key] = options;
  input_known_[key] = 1;
}

void MessageSpecs::set_output(size_t key, std::vector<TensorSpec> send_f, at::TensorOptions options) {
  recv_b_[key] = needing_grad(send_f);
  send_f_[key] = std::move(send_f);
  options_[key] = options;
  output_known_[key] = 1;
}

void MessageSpecs::forget() {
  for (auto* specs : {&recv_f_, &recv_b_, &send_f_}) {
    for (auto& v : *specs) v.clear();
  }
  std::fill(input_known_.begin(), input_known_.end(), 0);
  std::fill(output_known_.begin(), output_known_.end(), 0);
}

void MessageSpecs::mark_absent(size_t key, bool input) {
  if (input) {
    recv_f_[key].clear();
    input_known_[key] = 1;
  } else {
    recv_b_[key].clear();
    send_f_[key].clear();
    output_known_[key] = 1;
  }
}

std::vector<TensorSpec> MessageSpecs::of(const Instr& in) const {
  const size_t key = grid_.key(in);
  switch (in.op) {
    case kSendF:
      return send_f_[key];
    case kSendB:  // the gradients of the received tensors that need one
      return input_known_[key] ? needing_grad(recv_f_[key]) : std::vector<TensorSpec>();
    default:
      return received(in);
  }
}

const std::vector<TensorSpec>& MessageSpecs::received(const Instr& in) const {
  const size_t key = grid_.key(in);
  return carries_activations(in.op) ? recv_f_[key] : recv_b_[key];
}

}  // namespace pipecore
