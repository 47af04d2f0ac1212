// Facts about autograd nodes that the split backward needs: what kind of node it is, and what
// only Python can tell (saved-tensor hooks, compiled graphs, Python Functions' names).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <typeinfo>

namespace pipecore {

// An owning pointer to `node` of the kind edges hold (shared_ptr or intrusive_ptr by torch version).
using NodePtr = decltype(torch::autograd::Edge::function);
template <typename N>  // a template so that only the branch of this torch version is compiled
NodePtr node_ptr(N* node) {
  if constexpr (std::is_same_v<NodePtr, c10::intrusive_ptr<N>>) {
    return c10::intrusive_ptr<N>::reclaim_copy(node);
  } else {
    return node->shared_from_this();
  }
}

// A node of a Python autograd Function (custom Functions, checkpoints, compiled graphs). Asked of
// the type's name, not dynamic_cast, to keep Python's headers out of the callers.
inline bool is_python_node(const torch::autograd::Node* node) {
  return std::strstr(typeid(*node).name(), "PyNode") != nullptr;
}

// One of torch's generated backward nodes (AddmmBackward0, ...): computes exactly the outputs the
// engine asks for, so it can be asked for the input gradient at I and the weight gradient at W.
inline bool is_generated_node(const torch::autograd::Node* node) {
  return std::strstr(typeid(*node).name(), "N5torch8autograd9generated") != nullptr;
}

// Does any tensor `node` saved for its backward carry saved-tensor hooks (non-reentrant activation
// checkpointing, offloading, user hooks)? Unpacking such a tensor runs the hook (a checkpoint
// recomputes its region), so the node must not be run a second time. Takes the GIL when the node
// type saves tensors at all; types that save none are answered from a cache.
bool has_saved_tensor_hooks(torch::autograd::Node* node);

// Is `node` the backward of a torch.compile graph (AOTAutograd)? Such a backward runs once and
// refuses a retained graph when it donates buffers. Takes the GIL for Python nodes.
bool is_compiled_graph(torch::autograd::Node* node);

// The node's name ("AddmmBackward0", a Python Function's "LinearFuncBackward"), cached per C++ type.
std::string node_name(torch::autograd::Node* node);

}  // namespace pipecore
