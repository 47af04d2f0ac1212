// Backward through the autograd engine: full (B), input-only (I) and weight-only (W).
//
// The I/W split never runs a user's code twice. I computes the stage's input gradients and, at
// each "split node" (a node on the way to the inputs with branches that lead to parameters only),
// either captures the gradient arriving there so that W runs the node again for its parameter
// branches only (torch's generated nodes without hooks: they compute just the outputs asked for),
// or, where that is not safe (a Python or C++ autograd Function, a node with hooks or with hooked
// saved tensors, a compiled graph), lets the node run once at I and accumulates the parameter
// gradients it produced right there. Functions can still hand their weight-gradient work to W with
// pipecore.defer_weight_grad (weight_store.h).
//
// After I, nothing needs the graph below a deferred split node: its edges towards the inputs are
// cut and the saved tensors of every node that ran at I are released, so between I and W a stage
// holds what W needs and no more, and W is one engine call over the deferred nodes' parameter
// branches (parameters shared between branches accumulate once there).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node must be complete for Edge

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "weight_store.h"

namespace pipecore {

// What a split backward's input half leaves for its weight half.
struct WeightWork {
  torch::autograd::edge_list roots;  // deferred split nodes (gradients captured at I), parameter-only roots
  std::vector<at::Tensor> grads;
  torch::autograd::edge_list params;  // the accumulators W fills
  DeferredClosures closures;          // pipecore.defer_weight_grad calls made during I
};

// Why weight-gradient work ran at I instead of W. The names are part of the Python surface
// (Pipeline.split_backward_fallbacks, pipecore/runtime/split_backward.py).
enum class FallbackReason {
  kPythonFunction,       // "python_function"
  kCustomNode,           // "custom_node": a C++ autograd Function or another non-generated node
  kHooks,                // "hooks"
  kSavedTensorHooks,     // "saved_tensor_hooks"
  kCompiledGraph,        // "compiled_graph"
  kReentrantCheckpoint,  // "reentrant_checkpoint": the stage's whole backward at I
  kSharedParameter,      // "shared_parameter": shares a parameter with a branch computed at I
};
const char* reason_name(FallbackReason why);

// One node (or parameter) whose weight gradient ran at I.
struct SplitFallback {
  std::string node;     // the autograd node's name ("LinearFuncBackward"), or "parameter of shape [..]"
  FallbackReason why;
  uintptr_t param = 0;  // kSharedParameter: the parameter's TensorImpl (Python's Tensor._cdata)
  auto key() const { return std::tie(node, why, param); }
  bool operator<(const SplitFallback& o) const { return key() < o.key(); }
};

// Full backward from `roots` seeded with `grads`: accumulates into every leaf's .grad (parameters
// and the stage's received inputs) and returns the gradients of `inputs` (undefined where an input
// needs none). Runs on the engine directly: the roots' tensors may be freed.
std::vector<at::Tensor> backward_full(const torch::autograd::edge_list& roots, const std::vector<at::Tensor>& grads,
                                      const std::vector<at::Tensor>& inputs);

// Input half of a split backward: returns the gradients of `inputs` (undefined where none flows)
// and fills `work` with what `backward_weight` does later. Where weight-gradient work had to run
// now, `fallbacks` says which node and why (once per node). A graph that refuses a split (a
// reentrant activation checkpoint) gets a full backward here, `work` left empty.
std::vector<at::Tensor> backward_input(const torch::autograd::edge_list& roots,
                                       const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work,
                                       std::vector<SplitFallback>& fallbacks);

// Weight half: runs the closures deferred during the matching backward_input, then computes and
// accumulates the parameter gradients it left out. Empties `work`.
void backward_weight(WeightWork& work);

}  // namespace pipecore
