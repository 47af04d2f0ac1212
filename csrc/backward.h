// Backward through the autograd engine: full (B), input-only (I) and weight-only (W).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node must be complete for Edge

#include <vector>

#include "executor.h"

namespace pipecore {

// Full backward from `roots` seeded with `grads`: accumulates into every leaf's .grad (parameters
// and the stage's received inputs). Runs on the engine directly: the roots' tensors may be freed.
void backward_full(const torch::autograd::edge_list& roots, const std::vector<at::Tensor>& grads);

// Input half of a split backward: returns the gradients of `inputs` (undefined where none flows)
// without computing weight gradients, and appends to `tasks` what `backward_weight` needs later.
// Falls back to a full backward (tasks left empty) when a parameter is reached through more than
// one weight-gradient node, where splitting could count a contribution twice.
std::vector<at::Tensor> backward_input(const torch::autograd::edge_list& roots,
                                       const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs,
                                       std::vector<WeightTask>& tasks);

// Weight half: accumulates the parameter gradients the matching backward_input left out.
void backward_weight(std::vector<WeightTask>& tasks);

}  // namespace pipecore
