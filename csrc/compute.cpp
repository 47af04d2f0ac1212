// The compute actions: F (the stage's forward, through Python), B and I (backward through the autograd
// engine, I without weight gradients, backward.h), W (the weight gradients I left), and the stage events
// of stages that reduce their own gradients.
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include "executor.h"

namespace pipecore {

void Executor::do_forward(const Instr& in) {
  Slot& s = slot(in);
  if (s.recv_f.posted()) {
    const auto& specs = specs_.received(in);
    s.inputs = path_->take(s.recv_f, in, specs);
    for (size_t k = 0; k < specs.size(); ++k) {
      if (specs[k].requires_grad) s.inputs[k].requires_grad_(true);
    }
  }
  at::Tensor loss;
  double seed = 1.0;
  s.outputs.clear();
  {
    SpentOn spent(profile_, Spent::kForward);
    (*forward_)(in.stage, in.mb, s.inputs, s.outputs, loss, seed);
  }
  s.out_edges.clear();
  for (const auto& t : s.outputs) {
    if (t.defined() && t.requires_grad()) s.out_edges.push_back(torch::autograd::impl::gradient_edge(t));
  }
  if (next_local_[in.stage] >= 0) {
    // the next stage lives on this rank: its inputs are new leaves over these outputs
    Slot& dst = slot(next_local_[in.stage], in.mb);
    dst.inputs.clear();
    for (const auto& t : s.outputs) {
      at::Tensor leaf = t.detach();
      if (t.requires_grad()) leaf.requires_grad_(true);
      dst.inputs.push_back(leaf);
    }
    s.outputs.clear();
  }
  if (loss.defined()) {
    s.has_loss = true;
    if (loss.requires_grad()) {
      s.loss_edge = torch::autograd::impl::gradient_edge(loss);
      s.loss_seed = path_->seed_of(loss, seed);  // (the device path: zero unless the step's messages were ok)
    }
  }
}

void Executor::do_backward(const Instr& in, bool split) {
  Slot& s = slot(in);
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> grads;
  if (s.has_loss) {
    if (s.loss_edge.is_valid()) {
      roots.push_back(s.loss_edge);
      grads.push_back(s.loss_seed);
    }
  } else {
    if (s.recv_b.posted()) {
      s.out_grads = path_->take(s.recv_b, in, specs_.received(in));
    }
    TORCH_CHECK(s.out_grads.size() == s.out_edges.size(), where(in), ": received ", s.out_grads.size(),
                " output gradients for ", s.out_edges.size(), " outputs that need one");
    roots = s.out_edges;
    grads = s.out_grads;
  }
  const bool own_weight_grads = builds_weight(in.stage);
  SpentOn spent(profile_, Spent::kBackward);
  if (split && !evented(in.stage) && !own_weight_grads) {
    std::vector<SplitFallback> fallbacks;
    s.input_grads = backward_input(roots, grads, s.inputs, s.weight, fallbacks);
    for (auto& f : fallbacks) ++split_fallbacks_[in.stage][f];
  } else {
    s.input_grads = backward_full(roots, grads, s.inputs);
  }
  if (own_weight_grads) {  // as torch: the runner is made after the backward, run at W (B: now)
    s.weight.closures.fns.push_back(stages_.weight_builder(in.stage));
    s.weight.closures.nodes.push_back(nullptr);
    if (!split) backward_weight(s.weight);
  }
  s.out_edges.clear();
  s.out_grads.clear();
  s.loss_edge = torch::autograd::Edge();
  s.loss_seed.reset();
  if (prev_local_[in.stage] >= 0) {
    slot(prev_local_[in.stage], in.mb).out_grads = take_input_grads(s);
  }
}

void Executor::do_weight(const Instr& in) {
  SpentOn spent(profile_, Spent::kBackward);
  backward_weight(slot(in).weight);
}

std::vector<at::Tensor> Executor::take_input_grads(Slot& s) {
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < s.inputs.size(); ++k) {
    if (!s.inputs[k].requires_grad()) continue;
    at::Tensor g = k < s.input_grads.size() ? s.input_grads[k] : at::Tensor();
    grads.push_back(g.defined() ? g : at::zeros_like(s.inputs[k]));
  }
  s.input_grads.clear();
  s.inputs.clear();
  return grads;
}

void Executor::stage_event(int64_t event, int64_t stage) {
  if (stages_.event && evented(stage)) stages_.event(event, stage);
}

std::vector<at::Tensor> Executor::outgoing(const Instr& in) {
  Slot& s = slot(in);
  if (!carries_activations(in.op)) return take_input_grads(s);
  TORCH_CHECK(!s.outputs.empty(), where(in), ": nothing to send (forward produced no tensors)");
  // The slot lets go of the outputs: the message keeps the data alive until sent, the autograd graph
  // lives on through the stored gradient edges.
  std::vector<at::Tensor> tensors = std::move(s.outputs);
  s.outputs.clear();
  if (!free_outputs_) kept_.insert(kept_.end(), tensors.begin(), tensors.end());
#ifdef PIPECORE_TESTING
  freed_outputs_ += free_outputs_;
#endif
  return tensors;
}

}  // namespace pipecore
