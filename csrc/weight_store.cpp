#include "weight_store.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace py = pybind11;

namespace pipecore {

namespace {

std::atomic<DeferredClosures*> g_sink{nullptr};
std::mutex g_append;  // CUDA graphs run nodes on one engine thread per device: appends may race

class PyClosure final : public DeferredClosure {
 public:
  explicit PyClosure(py::object fn) : fn_(std::move(fn)) {}
  ~PyClosure() override {
    py::gil_scoped_acquire gil;
    fn_ = py::object();
  }
  void run() override {
    py::gil_scoped_acquire gil;
    fn_();
  }

 private:
  py::object fn_;
};

void defer_weight_grad(py::object fn) {
  if (!PyCallable_Check(fn.ptr())) {
    throw py::type_error("pipecore.defer_weight_grad needs a callable (the weight-gradient work), got " +
                         std::string(py::str(py::type::handle_of(fn).attr("__name__"))));
  }
  DeferredClosures* sink = g_sink.load(std::memory_order_acquire);
  // only calls from inside a node of the running input half are deferred
  const auto node = sink != nullptr ? torch::autograd::get_current_node() : nullptr;
  if (sink == nullptr || !node) {
    fn();
    return;
  }
  std::lock_guard<std::mutex> lock(g_append);
  sink->fns.push_back(std::make_unique<PyClosure>(std::move(fn)));
  sink->nodes.push_back(node.get());
}

}  // namespace

bool DeferredClosures::deferred_by(const torch::autograd::Node* node) const {
  return std::find(nodes.begin(), nodes.end(), node) != nodes.end();
}

void DeferredClosures::run_all() {
  auto pending = std::move(fns);
  fns.clear();
  nodes.clear();
  for (auto& fn : pending) fn->run();
}

DeferralScope::DeferralScope(DeferredClosures& sink) : previous_(g_sink.exchange(&sink)) {}

DeferralScope::~DeferralScope() { g_sink.store(previous_); }

void bind_weight_store(py::module_& m) {
  m.def("defer_weight_grad", &defer_weight_grad, py::arg("fn"),
        "Inside an autograd Function's backward: run fn() (its weight-gradient work) at this microbatch's W "
        "when pipecore runs a split backward, or at once anywhere else.");
}

}  // namespace pipecore
