#include "weight_store.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <mutex>

namespace py = pybind11;

namespace pipecore {

namespace {

// The running input half's sink and its graph: set and cleared by DeferralScope on the executor
// thread, read by the engine's threads (CUDA nodes run on one engine thread per device).
struct Deferral {
  DeferredClosures* sink = nullptr;
  std::function<bool(const torch::autograd::Node*)> owns;
};
std::mutex g_mutex;
Deferral g_deferral;

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
  const auto node = torch::autograd::get_current_node();  // null outside a backward
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeferredClosures* sink = g_deferral.sink;
    if (sink != nullptr && node && g_deferral.owns(node.get())) {  // inside the running input half
      sink->fns.push_back(std::make_unique<PyClosure>(std::move(fn)));
      sink->nodes.push_back(node.get());
      return;
    }
  }
  fn();
}

}  // namespace

std::unique_ptr<DeferredClosure> python_closure(const py::object& fn) { return std::make_unique<PyClosure>(fn); }

bool DeferredClosures::deferred_by(const torch::autograd::Node* node) const {
  return std::find(nodes.begin(), nodes.end(), node) != nodes.end();
}

void DeferredClosures::run_all() {
  auto pending = std::move(fns);
  fns.clear();
  nodes.clear();
  for (auto& fn : pending) fn->run();
}

DeferralScope::DeferralScope(DeferredClosures& sink, std::function<bool(const torch::autograd::Node*)> owns) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_deferral = Deferral{&sink, std::move(owns)};
}

DeferralScope::~DeferralScope() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_deferral = Deferral{};
}

void bind_weight_store(py::module_& m) {
  m.def("defer_weight_grad", &defer_weight_grad, py::arg("fn"),
        "Inside an autograd Function's backward: run fn() (its weight-gradient work) at this microbatch's W "
        "when pipecore runs a split backward, or at once anywhere else.");
}

}  // namespace pipecore
