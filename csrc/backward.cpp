#include "backward.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <numeric>
#include <set>
#include <sstream>
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

void backward_full(const edge_list& roots, const std::vector<at::Tensor>& grads) {
  if (roots.empty()) return;
  Engine::get_default_engine().execute(roots, variable_list(grads.begin(), grads.end()),
                                       /*keep_graph=*/false, /*create_graph=*/false,
                                       /*accumulate_grad=*/true, /*outputs=*/{});
}

namespace {

// torch.utils.checkpoint(use_reentrant=True) runs a backward of its own that refuses an engine
// call that captures gradients (I) or names its outputs (W): such a graph gets a full backward.
bool is_reentrant_checkpoint(Node* n) {
  return is_python_node(n) && n->name() == "CheckpointFunctionBackward";
}

// Hooks run every time their node runs, and capturing a node's incoming gradient runs its tensor
// hooks too: a node with any hook must run exactly once.
bool has_hooks(Node* n) {
  return !n->pre_hooks().empty() || !n->tensor_pre_hooks().empty() || !n->retains_grad_hooks().empty() ||
         !n->post_hooks().empty();
}

// "parameter of shape [8, 8] #<TensorImpl address>": Python names it (Tensor._cdata is that address).
std::string parameter_description(Node* accumulator) {
  const auto& param = static_cast<AccumulateGrad*>(accumulator)->variable;
  std::ostringstream out;
  out << "parameter of shape " << param.sizes() << " #" << reinterpret_cast<uintptr_t>(param.unsafeGetTensorImpl());
  return out.str();
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
  std::vector<Node*> nodes;      // nodes between the split node and the parameters
  const char* why = nullptr;     // set: computed at I, why (SplitFallback::why)
  Node* culprit = nullptr;       // ... and because of which node
  Node* shared = nullptr;        // ... or of which parameter (accumulator), for "shared_parameter"
  bool deferred_split() const { return split != nullptr && why == nullptr; }
};

// Whether `b` must be computed at I, and why (`b.why`, `b.culprit`). `input_path`: I runs nodes
// (some root leads to an input).
void decide(Branch& b, bool input_path) {
  if (Node* n = b.split) {
    if (is_python_node(n)) {
      b.why = is_compiled_graph(n) ? "compiled_graph" : "python_function";
    } else if (has_hooks(n)) {
      b.why = "hooks";
    } else if (has_saved_tensor_hooks(n)) {
      b.why = "saved_tensor_hooks";
    }
    if (b.why != nullptr) {
      b.culprit = n;
      return;
    }
  }
  // a hooked saved tensor below would be unpacked at W after I unpacked others of its checkpoint
  // region: the region would be recomputed twice. Without an input path, I runs nothing.
  if (!input_path) return;
  for (Node* n : b.nodes) {
    if (has_saved_tensor_hooks(n)) {
      b.why = "saved_tensor_hooks";
      b.culprit = n;
      return;
    }
  }
}

// What the engine does for an AccumulateGrad node, minus the tensor hooks that already ran when
// its gradient was captured: node pre-hooks, accumulation (with post-accumulate hooks), post-hooks.
void accumulate_computed(const Edge& param, const at::Tensor& grad) {
  Node& fn = *param.function;
  at::AutoGradMode grad_mode(false);
  const auto stream = fn.stream();
  c10::OptionalStreamGuard stream_guard(stream.has_value() && stream->device_type() != c10::DeviceType::CPU
                                            ? stream
                                            : std::nullopt);
  variable_list inputs{grad};
  for (const auto& hook : fn.pre_hooks()) inputs = (*hook)(inputs);
  if (fn.post_hooks().empty()) {
    fn(std::move(inputs));
    return;
  }
  variable_list outputs = fn(variable_list(inputs));
  for (const auto& hook : fn.post_hooks()) outputs = (*hook)(outputs, inputs);
}

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

  // A graph that refuses a split: all of it now, exactly once.
  auto whole_backward_now = [&](SplitFallback why) {
    fallbacks.push_back(std::move(why));
    backward_full(roots, grads);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (input_edges[i].is_valid()) input_grads[i] = inputs[i].grad();
    }
    return input_grads;
  };
  if (Node* n = graph.reentrant_checkpoint()) return whole_backward_now({node_name(n), "reentrant_checkpoint"});

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
  std::vector<size_t> group(branches.size());  // branches sharing a parameter form one group
  std::iota(group.begin(), group.end(), 0);
  auto find = [&](size_t i) {
    while (group[i] != i) i = group[i] = group[group[i]];
    return i;
  };
  std::unordered_map<Node*, size_t> owner;  // parameter accumulator -> first branch reaching it
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
      if (added) continue;
      const size_t a = find(it->second), c = find(i);
      if (a != c) group[c] = a;
      conflicts.emplace_back(i, p.function.get());
    }
  }
  bool input_path = false;
  for (const auto& e : roots) input_path |= e.is_valid() && graph.reach(e.function.get()).input;
  for (auto& b : branches) decide(b, input_path);
  // A parameter under two branches: re-running one branch's split node at W would flow through the
  // other's path as well (the engine runs every node that leads to a requested parameter), so such
  // branches are computed at I, together; the stage's other branches still split.
  if (!conflicts.empty()) {
    std::vector<Node*> shared(branches.size(), nullptr);  // per group: its largest shared parameter
    auto numel = [](Node* acc) { return static_cast<AccumulateGrad*>(acc)->variable.numel(); };
    for (const auto& [i, param] : conflicts) {
      Node*& slot = shared[find(i)];
      if (slot == nullptr || numel(param) > numel(slot)) slot = param;
    }
    for (size_t i = 0; i < branches.size(); ++i) {
      Node* param = shared[find(i)];
      if (param != nullptr && branches[i].why == nullptr) {
        branches[i].why = "shared_parameter";
        branches[i].shared = param;
      }
    }
  }

  // Re-running a split node at W needs the graph kept at I. A compiled graph refuses that
  // (donated buffers): if one runs at I, every split node's weight gradient is computed at I.
  bool keep_graph = false;
  for (const auto& b : branches) keep_graph |= b.deferred_split();
  if (keep_graph) {
    Node* compiled = graph.compiled_on_input_path();
    for (const auto& b : branches) {
      if (compiled != nullptr || b.why == nullptr) continue;
      for (Node* n : b.nodes) {
        if (is_compiled_graph(n)) compiled = n;
      }
    }
    if (compiled != nullptr) {
      for (auto& b : branches) {
        if (b.deferred_split()) {
          b.why = "compiled_graph";
          b.culprit = compiled;
        }
      }
      keep_graph = false;
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
    if (b.why == nullptr) continue;
    for (const auto& p : b.params) {
      if (computed.insert(p.function.get()).second) outputs.push_back(p);
    }
  }
  variable_list result;
  if (!outputs.empty()) {
    DeferralScope deferring(work.closures);
    result = Engine::get_default_engine().execute(roots, variable_list(grads.begin(), grads.end()), keep_graph,
                                                  /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
  }
  for (size_t j = 0; j < input_index.size(); ++j) input_grads[input_index[j]] = result[j];

  std::set<SplitFallback> seen_fallbacks;
  size_t pos = first_capture;
  for (auto& b : branches) {
    if (b.deferred_split()) {
      WeightTask task;
      for (uint32_t k = 0; k < b.split->num_inputs(); ++k, ++pos) {
        if (result[pos].defined()) {
          task.roots.emplace_back(node_ptr(b.split), k);
          task.grads.push_back(result[pos]);
        }
      }
      task.params = std::move(b.params);
      if (!task.roots.empty() && !task.params.empty()) work.tasks.push_back(std::move(task));
    } else if (b.why != nullptr) {
      // a Function that handed its weight-gradient work to defer_weight_grad did not fall back
      const bool deferred = b.split != nullptr && work.closures.deferred_by(b.split);
      if (!deferred) {
        seen_fallbacks.insert({b.shared != nullptr ? parameter_description(b.shared) : node_name(b.culprit), b.why});
      }
    } else if (!b.params.empty()) {  // a root branch, all of it at W
      work.tasks.push_back(WeightTask{std::move(b.roots), std::move(b.grads), std::move(b.params)});
    }
  }
  for (size_t j = first_computed; j < outputs.size(); ++j) {
    if (result[j].defined()) accumulate_computed(outputs[j], result[j]);
  }
  fallbacks.insert(fallbacks.end(), seen_fallbacks.begin(), seen_fallbacks.end());
  return input_grads;
}

void backward_weight(WeightWork& work) {
  // Each branch's nodes run in this one call only: the graph need not be kept.
  for (auto& t : work.tasks) {
    Engine::get_default_engine().execute(t.roots, variable_list(t.grads.begin(), t.grads.end()),
                                         /*keep_graph=*/false, /*create_graph=*/false,
                                         /*accumulate_grad=*/true, t.params);
  }
  work.tasks.clear();
  at::AutoGradMode grad_mode(false);  // closures are backward code: they build no graph
  work.closures.run_all();
}

}  // namespace pipecore
