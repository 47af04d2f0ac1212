#include "backward.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "node_info.h"

namespace pipecore {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Engine;
using torch::autograd::Node;
using torch::autograd::variable_list;

const char* reason_name(FallbackReason why) {
  switch (why) {
    case FallbackReason::kPythonFunction: return "python_function";
    case FallbackReason::kCustomNode: return "custom_node";
    case FallbackReason::kHooks: return "hooks";
    case FallbackReason::kSavedTensorHooks: return "saved_tensor_hooks";
    case FallbackReason::kCompiledGraph: return "compiled_graph";
    case FallbackReason::kReentrantCheckpoint: return "reentrant_checkpoint";
    case FallbackReason::kSharedParameter: return "shared_parameter";
  }
  return "unknown";
}

std::vector<at::Tensor> backward_full(const edge_list& roots, const std::vector<at::Tensor>& grads,
                                      const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> input_grads(inputs.size());
  if (roots.empty()) return input_grads;
  Engine::get_default_engine().execute(roots, variable_list(grads.begin(), grads.end()),
                                       /*keep_graph=*/false, /*create_graph=*/false,
                                       /*accumulate_grad=*/true, /*outputs=*/{});
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined() && inputs[k].requires_grad()) input_grads[k] = inputs[k].grad();
  }
  return input_grads;
}

namespace {

// A reentrant activation checkpoint (torch's, Megatron's and DeepSpeed's CheckpointFunction,
// TransformerEngine's _CheckpointFunction) runs a backward of its own that refuses an engine call
// that captures gradients (I) or names its outputs (W): such a graph gets a full backward.
bool is_reentrant_checkpoint(Node* python_node) {  // a PyNode
  static const std::string kSuffix = "CheckpointFunctionBackward";
  const std::string name = python_node->name();
  return name.size() >= kSuffix.size() && name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

// A node's hooks run every time it runs: a split node with hooks would run them at I and at W.
bool has_hooks(Node* n) {
  return !n->pre_hooks().empty() || !n->tensor_pre_hooks().empty() || !n->retains_grad_hooks().empty() ||
         !n->post_hooks().empty();
}

// Per node of the backward graph: does it lead to a stage input, to a parameter?
struct Reach {
  bool input = false;
  bool param = false;
};

class GraphInfo {
 public:
  GraphInfo(const edge_list& roots, const std::unordered_set<Node*>& input_nodes) : inputs_(input_nodes) {
    // iterative post-order DFS: a node's reach is known after all its children's
    std::vector<std::pair<Node*, size_t>> stack;
    for (const auto& e : roots) {
      if (e.is_valid()) visit(e.function.get(), stack);
    }
  }

  const Reach& reach(Node* n) const { return reach_.at(n); }
  bool contains(const Node* n) const { return reach_.count(const_cast<Node*>(n)) != 0; }

  // The parameter accumulators under `n` (a node leading to parameters only) into `params`, and the
  // other nodes on the way into `branch`.
  void params_under(Node* n, std::unordered_set<Node*>& seen, edge_list& params, std::vector<Node*>& branch) const {
    std::vector<Node*> stack{n};
    while (!stack.empty()) {
      Node* cur = stack.back();
      stack.pop_back();
      if (!seen.insert(cur).second) continue;
      if (dynamic_cast<AccumulateGrad*>(cur) != nullptr) {
        params.emplace_back(node_ptr(cur), 0);
        continue;
      }
      branch.push_back(cur);
      for (const auto& e : cur->next_edges()) {
        if (e.is_valid() && reach_.at(e.function.get()).param) stack.push_back(e.function.get());
      }
    }
  }

  const std::vector<Node*>& order() const { return order_; }
  Node* reentrant_checkpoint() const { return reentrant_checkpoint_; }
  Node* compiled_on_input_path() const { return compiled_on_input_path_; }

 private:
  void visit(Node* root, std::vector<std::pair<Node*, size_t>>& stack) {
    if (reach_.count(root)) return;
    reach_[root];
    stack.emplace_back(root, 0);
    while (!stack.empty()) {
      auto& [node, child] = stack.back();
      const auto& edges = node->next_edges();
      if (child < edges.size()) {
        const Edge& e = edges[child++];
        if (e.is_valid() && !reach_.count(e.function.get())) {
          reach_[e.function.get()];
          stack.emplace_back(e.function.get(), 0);
        }
        continue;
      }
      Reach r;
      if (inputs_.count(node)) {
        r.input = true;
      } else if (dynamic_cast<AccumulateGrad*>(node) != nullptr) {
        r.param = true;
      }
      for (const auto& e : edges) {
        if (!e.is_valid()) continue;
        const Reach& c = reach_[e.function.get()];
        r.input |= c.input;
        r.param |= c.param;
      }
      reach_[node] = r;
      if (is_python_node(node)) {
        if (reentrant_checkpoint_ == nullptr && is_reentrant_checkpoint(node)) reentrant_checkpoint_ = node;
        if (compiled_on_input_path_ == nullptr && r.input && is_compiled_graph(node)) compiled_on_input_path_ = node;
      }
      order_.push_back(node);
      stack.pop_back();
    }
  }

  const std::unordered_set<Node*>& inputs_;
  std::unordered_map<Node*, Reach> reach_;
  std::vector<Node*> order_;
  Node* reentrant_checkpoint_ = nullptr;
  Node* compiled_on_input_path_ = nullptr;
};

// The weight-gradient work below one split node (or below a root that leads to parameters only).
struct Branch {
  Node* split = nullptr;  // null: a root leading to parameters only (W runs all of it)
  edge_list roots;        // root branches: the root edges and their seeds
  std::vector<at::Tensor> grads;
  edge_list params;
  std::vector<Node*> nodes;  // nodes between the split node and the parameters
  bool at_input = false;     // computed at I (a fallback), and why:
  FallbackReason why = FallbackReason::kHooks;
  Node* culprit = nullptr;  // ... because of this node
  Node* shared = nullptr;   // ... or of this parameter's accumulator (kSharedParameter)
  bool deferred_split() const { return split != nullptr && !at_input; }
  void compute_at_input(FallbackReason reason, Node* node) {
    at_input = true;
    why = reason;
    culprit = node;
  }
};

// Decides whether `b` must be computed at I. `input_path`: I runs nodes (some root leads to an input).
void decide(Branch& b, bool input_path) {
  if (Node* n = b.split) {
    // Only torch's generated nodes compute just the outputs the engine asks for; a C++ or Python
    // autograd Function (or a wrapper such as CopySlices) may compute every gradient each time.
    if (is_python_node(n)) {
      return b.compute_at_input(is_compiled_graph(n) ? FallbackReason::kCompiledGraph : FallbackReason::kPythonFunction,
                                n);
    }
    if (!is_generated_node(n)) return b.compute_at_input(FallbackReason::kCustomNode, n);
    if (has_hooks(n)) return b.compute_at_input(FallbackReason::kHooks, n);
    if (has_saved_tensor_hooks(n)) return b.compute_at_input(FallbackReason::kSavedTensorHooks, n);
  }
  // a hooked saved tensor below would be unpacked at W after I unpacked others of its checkpoint
  // region: the region would be recomputed twice. Without an input path, I runs nothing.
  if (!input_path) return;
  for (Node* n : b.nodes) {
    if (has_saved_tensor_hooks(n)) return b.compute_at_input(FallbackReason::kSavedTensorHooks, n);
  }
}

// "parameter of shape [8, 8]" and its TensorImpl (Python's Tensor._cdata), for naming it there.
SplitFallback shared_parameter_fallback(Node* accumulator) {
  const auto& param = static_cast<AccumulateGrad*>(accumulator)->variable;
  std::ostringstream out;
  out << "parameter of shape " << param.sizes();
  return {out.str(), FallbackReason::kSharedParameter, reinterpret_cast<uintptr_t>(param.unsafeGetTensorImpl())};
}

// What the engine does for an AccumulateGrad node, minus the tensor hooks that already ran when
// its gradient was captured: node pre-hooks, accumulation (with post-accumulate hooks), post-hooks.
// On the current stream: the engine made it wait for the captured gradient's stream.
void accumulate_computed(const Edge& param, at::Tensor grad) {
  Node& fn = *param.function;
  at::AutoGradMode grad_mode(false);
  variable_list inputs{std::move(grad)};  // the only reference: AccumulateGrad may steal it
  for (const auto& hook : fn.pre_hooks()) inputs = (*hook)(inputs);
  if (fn.post_hooks().empty()) {
    fn(std::move(inputs));
    return;
  }
  variable_list outputs = fn(variable_list(inputs));
  for (const auto& hook : fn.post_hooks()) outputs = (*hook)(outputs, inputs);
}

// Union-find over branches: branches that reach a common parameter form one group.
class Groups {
 public:
  explicit Groups(size_t n) : parent_(n) { std::iota(parent_.begin(), parent_.end(), 0); }
  size_t find(size_t i) {
    while (parent_[i] != i) i = parent_[i] = parent_[parent_[i]];
    return i;
  }
  void unite(size_t a, size_t b) {
    a = find(a);
    b = find(b);
    if (a != b) parent_[b] = a;
  }

 private:
  std::vector<size_t> parent_;
};

}  // namespace

std::vector<at::Tensor> backward_input(const edge_list& roots, const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs, WeightWork& work,
                                       std::vector<SplitFallback>& fallbacks) {
  std::vector<at::Tensor> input_grads(inputs.size());
  if (roots.empty()) return input_grads;
  edge_list input_edges;
  std::unordered_set<Node*> input_nodes;
  for (const auto& t : inputs) {
    Edge e = t.defined() && t.requires_grad() ? torch::autograd::impl::gradient_edge(t) : Edge();
    input_edges.push_back(e);
    if (e.is_valid()) input_nodes.insert(e.function.get());
  }
  GraphInfo graph(roots, input_nodes);

  if (Node* n = graph.reentrant_checkpoint()) {  // all of it now, exactly once
    fallbacks.push_back({node_name(n), FallbackReason::kReentrantCheckpoint});
    return backward_full(roots, grads, inputs);
  }

  // Branches: roots leading to parameters only, then split points (nodes on the way to the inputs
  // with children that lead to parameters only).
  std::vector<Branch> branches;
  std::unordered_map<Node*, size_t> root_branch;
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* n = roots[i].function.get();
    if (n == nullptr) continue;
    const Reach& r = graph.reach(n);
    if (r.input || !r.param) continue;
    auto [it, added] = root_branch.try_emplace(n, branches.size());
    if (added) branches.emplace_back();
    branches[it->second].roots.push_back(roots[i]);
    branches[it->second].grads.push_back(grads[i]);
  }
  for (Node* n : graph.order()) {
    const Reach& r = graph.reach(n);
    if (!r.input || input_nodes.count(n)) continue;
    for (const auto& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      const Reach& c = graph.reach(e.function.get());
      if (!c.input && c.param) {
        branches.emplace_back().split = n;
        break;
      }
    }
  }
  Groups groups(branches.size());
  std::unordered_map<Node*, size_t> owner;          // parameter accumulator -> first branch reaching it
  std::vector<std::pair<size_t, Node*>> conflicts;  // (branch, a parameter it shares)
  for (size_t i = 0; i < branches.size(); ++i) {
    Branch& b = branches[i];
    std::unordered_set<Node*> seen;
    if (b.split == nullptr) {
      graph.params_under(b.roots.front().function.get(), seen, b.params, b.nodes);
    } else {
      for (const auto& e : b.split->next_edges()) {
        if (!e.is_valid()) continue;
        const Reach& c = graph.reach(e.function.get());
        if (!c.input && c.param) graph.params_under(e.function.get(), seen, b.params, b.nodes);
      }
    }
    for (const auto& p : b.params) {
      auto [it, added] = owner.try_emplace(p.function.get(), i);
      if (!added) {
        groups.unite(it->second, i);
        conflicts.emplace_back(i, p.function.get());
      }
    }
  }
  std::vector<Node*> shared(branches.size(), nullptr);  // per group root: its largest shared parameter
  auto numel = [](Node* acc) { return static_cast<AccumulateGrad*>(acc)->variable.numel(); };
  for (const auto& [i, param] : conflicts) {
    Node*& largest = shared[groups.find(i)];
    if (largest == nullptr || numel(param) > numel(largest)) largest = param;
  }
  bool input_path = false;
  for (const auto& e : roots) input_path |= e.is_valid() && graph.reach(e.function.get()).input;
  for (auto& b : branches) decide(b, input_path);

  // Two constraints, applied until both hold:
  // - A branch computed at I computes every contribution to its parameters there (the engine runs
  //   whatever leads to a requested gradient): branches sharing a parameter with it go along.
  // - Re-running a split node at W needs the graph kept at I, which a compiled graph refuses
  //   (donated buffers): if one runs at I, every split node's weight gradient is computed at I.
  bool keep_graph = false;
  for (bool changed = true; changed;) {
    changed = false;
    std::vector<char> group_at_input(branches.size(), 0);
    for (size_t i = 0; i < branches.size(); ++i) group_at_input[groups.find(i)] |= branches[i].at_input;
    for (size_t i = 0; i < branches.size(); ++i) {
      const size_t g = groups.find(i);
      if (!branches[i].at_input && group_at_input[g] && shared[g] != nullptr) {
        branches[i].compute_at_input(FallbackReason::kSharedParameter, nullptr);
        branches[i].shared = shared[g];
        changed = true;
      }
    }
    keep_graph = false;
    for (const auto& b : branches) keep_graph |= b.deferred_split();
    if (!keep_graph) break;
    Node* compiled = graph.compiled_on_input_path();
    for (const auto& b : branches) {
      if (compiled != nullptr || !b.at_input) continue;
      for (Node* n : b.nodes) {
        if (is_compiled_graph(n)) compiled = n;
      }
    }
    if (compiled != nullptr) {
      for (auto& b : branches) {
        if (b.deferred_split()) b.compute_at_input(FallbackReason::kCompiledGraph, compiled);
      }
      changed = true;
    }
  }

  // One engine call: the input gradients, the gradients arriving at deferred split nodes, and the
  // parameter gradients of branches computed now (accumulated below, as the engine would).
  edge_list outputs;
  std::vector<size_t> input_index;
  for (size_t i = 0; i < input_edges.size(); ++i) {
    if (input_edges[i].is_valid()) {
      outputs.push_back(input_edges[i]);
      input_index.push_back(i);
    }
  }
  const size_t first_capture = outputs.size();
  for (const auto& b : branches) {
    if (b.deferred_split()) {
      for (uint32_t k = 0; k < b.split->num_inputs(); ++k) outputs.emplace_back(node_ptr(b.split), k);
    }
  }
  const size_t first_computed = outputs.size();
  std::unordered_set<Node*> computed;  // each parameter once, however many branches reach it
  for (const auto& b : branches) {
    if (!b.at_input) continue;
    for (const auto& p : b.params) {
      if (computed.insert(p.function.get()).second) outputs.push_back(p);
    }
  }
  variable_list result;
  if (!outputs.empty()) {
    DeferralScope deferring(work.closures, [&graph](const Node* n) { return graph.contains(n); });
    result = Engine::get_default_engine().execute(roots, variable_list(grads.begin(), grads.end()), keep_graph,
                                                  /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
  }
  for (size_t j = 0; j < input_index.size(); ++j) input_grads[input_index[j]] = std::move(result[j]);
  for (size_t j = first_computed; j < outputs.size(); ++j) {
    if (result[j].defined()) accumulate_computed(outputs[j], std::move(result[j]));
  }

  // What W does: one engine call from the deferred split nodes (seeded with what I captured) and
  // the parameter-only roots, into their parameters.
  std::unordered_set<Node*> deferred_params;
  auto add_params = [&](const edge_list& params) {
    for (const auto& p : params) {
      if (deferred_params.insert(p.function.get()).second) work.params.push_back(p);
    }
  };
  std::set<SplitFallback> seen_fallbacks;
  size_t pos = first_capture;
  for (auto& b : branches) {
    if (b.deferred_split()) {
      for (uint32_t k = 0; k < b.split->num_inputs(); ++k, ++pos) {
        if (result[pos].defined()) {
          work.roots.emplace_back(node_ptr(b.split), k);
          work.grads.push_back(std::move(result[pos]));
        }
      }
      add_params(b.params);
    } else if (b.at_input) {
      // a Function that handed its weight-gradient work to defer_weight_grad did not fall back
      if (b.split != nullptr && work.closures.deferred_by(b.split)) continue;
      seen_fallbacks.insert(b.why == FallbackReason::kSharedParameter ? shared_parameter_fallback(b.shared)
                                                                        : SplitFallback{node_name(b.culprit), b.why});
    } else if (!b.params.empty()) {  // a root branch, all of it at W
      work.roots.insert(work.roots.end(), b.roots.begin(), b.roots.end());
      work.grads.insert(work.grads.end(), b.grads.begin(), b.grads.end());
      add_params(b.params);
    }
  }
  fallbacks.insert(fallbacks.end(), seen_fallbacks.begin(), seen_fallbacks.end());

  if (keep_graph) {
    // Nothing runs the graph below a deferred split node again: cut its edges towards the inputs
    // (W's engine call then reaches the parameter branches only, each once) and free the saved
    // tensors of every node that ran at I (the graph was kept for the split nodes alone).
    std::unordered_set<Node*> rerun;
    for (const auto& b : branches) {
      if (b.deferred_split()) rerun.insert(b.split);
    }
    for (Node* n : graph.order()) {
      if (graph.reach(n).input && !rerun.count(n)) n->release_variables();
    }
    for (const auto& b : branches) {
      if (!b.at_input) continue;
      for (Node* n : b.nodes) n->release_variables();
    }
    // last: a cut edge may hold the last reference to a node of `graph` (even to a split node
    // that no gradient reached, which W does not hold)
    std::vector<NodePtr> owned;
    for (Node* n : rerun) owned.push_back(node_ptr(n));
    for (const auto& n : owned) {
      for (auto& e : n->next_edges()) {
        if (e.is_valid() && graph.reach(e.function.get()).input) e = Edge();
      }
    }
  }
  return input_grads;
}

void backward_weight(WeightWork& work) {
  {
    // Closures first: then every accumulation into a parameter that also has an accumulator runs
    // through it, last, and its post hooks (data-parallel buckets, grad_reduce.h) see the final value.
    at::AutoGradMode grad_mode(false);  // closures are backward code: they build no graph
    work.closures.run_all();
  }
  if (!work.roots.empty()) {
    // Each node of the parameter branches runs once, in this call: the graph need not be kept.
    Engine::get_default_engine().execute(work.roots, variable_list(work.grads.begin(), work.grads.end()),
                                         /*keep_graph=*/false, /*create_graph=*/false,
                                         /*accumulate_grad=*/true, work.params);
  }
  work.roots.clear();
  work.grads.clear();
  work.params.clear();
}

}  // namespace pipecore
