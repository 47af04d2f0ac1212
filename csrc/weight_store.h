// Deferred weight-gradient closures: DualPipe's WeightGradStore as pipecore.defer_weight_grad.
//
// A fused autograd Function computes all its gradients in one backward call, so an I/W split
// cannot re-run it for the weight half. Instead its backward hands the weight-gradient work to
// pipecore.defer_weight_grad(fn): during a split backward's input half (I) the closure is kept
// and run at the microbatch's W; anywhere else (a full backward, plain single-process training)
// it runs at once, so the same Function works with and without pipecore.
#pragma once

#include <functional>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
}
namespace pybind11 {
class module_;
class object;
}

namespace pipecore {

class DeferredClosure {
 public:
  virtual ~DeferredClosure() = default;
  virtual void run() = 0;
};

struct DeferredClosures {
  std::vector<std::unique_ptr<DeferredClosure>> fns;
  std::vector<const torch::autograd::Node*> nodes;  // the backward node that deferred each closure
  bool empty() const { return fns.empty(); }
  bool deferred_by(const torch::autograd::Node* node) const;
  void run_all();  // in deferral order; empties the list (also when a closure throws)
};

// While alive, defer_weight_grad calls made from inside a backward node that `owns` (a node of
// this input half's graph) go to `sink`; calls from any other backward run at once. A rank runs
// one input half at a time.
class DeferralScope {
 public:
  DeferralScope(DeferredClosures& sink, std::function<bool(const torch::autograd::Node*)> owns);
  ~DeferralScope();
  DeferralScope(const DeferralScope&) = delete;
  DeferralScope& operator=(const DeferralScope&) = delete;
};

// A closure that calls the Python callable `fn` (with the GIL) when run.
std::unique_ptr<DeferredClosure> python_closure(const pybind11::object& fn);

// Adds defer_weight_grad to the extension module.
void bind_weight_store(pybind11::module_& m);

}  // namespace pipecore
