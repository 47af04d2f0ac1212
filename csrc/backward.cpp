#include "backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

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
// Only Python-defined nodes are asked their name (C++ nodes' names are demangled: slow).
bool is_reentrant_checkpoint(Node* n) {
  return std::strstr(typeid(*n).name(), "PyNode") != nullptr && n->name() == "CheckpointFunctionBackward";
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

  // The parameter accumulators under `n` (a node leading to parameters only).
  void params_under(Node* n, std::unordered_set<Node*>& seen, edge_list& out) const {
    std::vector<Node*> stack{n};
    while (!stack.empty()) {
      Node* cur = stack.back();
      stack.pop_back();
      if (!seen.insert(cur).second) continue;
      if (dynamic_cast<AccumulateGrad*>(cur) != nullptr) {
        out.emplace_back(c10::intrusive_ptr<Node>::reclaim_copy(cur), 0);
        continue;
      }
      for (const auto& e : cur->next_edges()) {
        if (e.is_valid() && reach_.at(e.function.get()).param) stack.push_back(e.function.get());
      }
    }
  }

  const std::vector<Node*>& order() const { return order_; }
  bool has_reentrant_checkpoint() const { return reentrant_checkpoint_; }

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
      reentrant_checkpoint_ |= is_reentrant_checkpoint(node);
      order_.push_back(node);
      stack.pop_back();
    }
  }

  const std::unordered_set<Node*>& inputs_;
  std::unordered_map<Node*, Reach> reach_;
  std::vector<Node*> order_;
  bool reentrant_checkpoint_ = false;
};

}  // namespace

std::vector<at::Tensor> backward_input(const edge_list& roots, const std::vector<at::Tensor>& grads,
                                       const std::vector<at::Tensor>& inputs, std::vector<WeightTask>& tasks) {
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

  // Split points: nodes on the way to the inputs with children that lead to parameters only.
  // I captures the gradient arriving at them; W re-runs them for the parameter branches alone.
  std::vector<WeightTask> planned;
  std::unordered_map<Node*, int> owners;  // parameter accumulator -> number of tasks reaching it
  bool shared = false;
  auto add_task = [&](WeightTask task, Node* start_for_params, bool whole_node) {
    std::unordered_set<Node*> seen;
    if (whole_node) {
      graph.params_under(start_for_params, seen, task.params);
    } else {
      for (const auto& e : start_for_params->next_edges()) {
        if (!e.is_valid()) continue;
        const Reach& r = graph.reach(e.function.get());
        if (!r.input && r.param) graph.params_under(e.function.get(), seen, task.params);
      }
    }
    for (const auto& p : task.params) shared |= (++owners[p.function.get()] > 1);
    planned.push_back(std::move(task));
  };
  edge_list captures;
  std::vector<Node*> capture_nodes;
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* n = roots[i].function.get();
    if (n == nullptr) continue;
    const Reach& r = graph.reach(n);
    if (!r.input && r.param) {  // a root leading to parameters only: W does all of it
      WeightTask t;
      t.roots.push_back(roots[i]);
      t.grads.push_back(grads[i]);
      add_task(std::move(t), n, /*whole_node=*/true);
    }
  }
  for (Node* n : graph.order()) {
    const Reach& r = graph.reach(n);
    if (!r.input || input_nodes.count(n)) continue;
    bool splits = false;
    for (const auto& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      const Reach& c = graph.reach(e.function.get());
      if (!c.input && c.param) splits = true;
    }
    if (!splits) continue;
    capture_nodes.push_back(n);
    for (uint32_t k = 0; k < n->num_inputs(); ++k) {
      captures.emplace_back(c10::intrusive_ptr<Node>::reclaim_copy(n), k);
    }
    WeightTask t;  // roots and grads filled after the I pass
    add_task(std::move(t), n, /*whole_node=*/false);
  }

  // a parameter under two split points, or a reentrant checkpoint: do it all now, exactly once
  if (shared || graph.has_reentrant_checkpoint()) {
    backward_full(roots, grads);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (input_edges[i].is_valid()) input_grads[i] = inputs[i].grad();
    }
    return input_grads;
  }

  edge_list outputs;
  std::vector<size_t> input_index;
  for (size_t i = 0; i < input_edges.size(); ++i) {
    if (input_edges[i].is_valid()) {
      outputs.push_back(input_edges[i]);
      input_index.push_back(i);
    }
  }
  size_t first_capture = outputs.size();
  outputs.insert(outputs.end(), captures.begin(), captures.end());
  if (!outputs.empty()) {
    auto result = Engine::get_default_engine().execute(roots, variable_list(grads.begin(), grads.end()),
                                                       /*keep_graph=*/true, /*create_graph=*/false,
                                                       /*accumulate_grad=*/false, outputs);
    for (size_t j = 0; j < input_index.size(); ++j) input_grads[input_index[j]] = result[j];
    // hand each split node's captured input gradients to its weight task
    size_t pos = first_capture;
    size_t task = planned.size() - capture_nodes.size();
    for (Node* n : capture_nodes) {
      WeightTask& t = planned[task++];
      for (uint32_t k = 0; k < n->num_inputs(); ++k, ++pos) {
        if (result[pos].defined()) {
          t.roots.emplace_back(c10::intrusive_ptr<Node>::reclaim_copy(n), k);
          t.grads.push_back(result[pos]);
        }
      }
    }
  }
  for (auto& t : planned) {
    if (!t.roots.empty() && !t.params.empty()) tasks.push_back(std::move(t));
  }
  return input_grads;
}

void backward_weight(std::vector<WeightTask>& tasks) {
  for (auto& t : tasks) {
    Engine::get_default_engine().execute(t.roots, variable_list(t.grads.begin(), t.grads.end()),
                                         /*keep_graph=*/true, /*create_graph=*/false,
                                         /*accumulate_grad=*/true, t.params);
  }
  tasks.clear();
}

}  // namespace pipecore
