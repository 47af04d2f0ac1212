// Backward through the autograd engine: full (B), input-only (I) and weight-only (W).
//
// The I/W split never runs a user's code twice. I computes the stage's input gradients and, for
// each "split node" (a node on the way to the inputs with branches that lead to parameters only),
// either captures the gradient arriving at it so that W re-runs it for its parameter branches
// (built-in C++ nodes without hooks: they compute only the outputs asked for), or, where re-running
// is not safe (a Python autograd Function, a node with hooks or hooked saved tensors, a compiled
// graph), lets it run once at I and accumulates the parameter gradients it produced right there
// (holding them until W would cost a parameter-sized buffer per microbatch in flight). Functions
// can still defer their weight-gradient work to W with pipecore.defer_weight_grad (weight_store.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node must be complete for Edge

#include <cstdint>
#include <string>
#include <vector>

#include "weight_store.h"

namespace pipecore {

// An engine call W makes: the gradients captured at `roots` during I, run for `params` only.
struct WeightTask {
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> grads;
  torch::autograd::edge_list params;
};

// What a split backward's input half leaves for its weight half.
struct WeightWork {
  std::vector<WeightTask> tasks;  // split nodes re-run for their parameter branches
  DeferredClosures closures;      // pipecore.defer_weight_grad calls made during I
  bool empty() const { return tasks.empty() && closures.empty(); }
};

// Why weight-gradient work ran at I instead of W (one per node and microbatch).
struct SplitFallback {
  std::string node;  // the autograd node's name, e.g. "LinearFuncBackward"
  std::string why;   // "python_function", "hooks", "saved_tensor_hooks", "compiled_graph",
                     // "reentrant_checkpoint" or "shared_parameter"
  bool operator<(const SplitFallback& o) const { return node != o.node ? node < o.node : why < o.why; }
  bool operator==(const SplitFallback& o) const { return node == o.node && why == o.why; }
};

// Full backward from `roots` seeded with `grads`: accumulates into every leaf's .grad (parameters
// and the stage's received inputs). Runs on the engine directly: the roots' tensors may be freed.
void backward_full(const torch::autograd::edge_list& roots, const std::vector<at::Tensor>& grads);

// Input half of a split backward: returns the gradients of `inputs` (undefined where none flows)
// and fills `work` with what `backward_weight` does later. Where weight-gradient work had to run
// now, `fallbacks` says which node and why. A graph that refuses a split (a reentrant activation
// checkpoint, a parameter under two split points) gets a full backward here, `work` left empty.
std::vector<at::Tensor> backward_input(const torch::autograd::edge_list& roots,
                                       const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work,
                                       std::vector<SplitFallback>& fallbacks);

// Weight half: computes and accumulates the parameter gradients the matching backward_input left
// out and runs the closures deferred during it. Empties `work`.
void backward_weight(WeightWork& work);

}  // namespace pipecore
