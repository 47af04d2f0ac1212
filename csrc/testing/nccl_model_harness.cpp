// `_C.NcclModel` (test builds): the device path (../device_comm.cpp) over the CPU model of NCCL, driven
// one batch at a time from Python, so tests can post what the executor never would (a receive of
// another size than its send, a peer the communicator lacks, a release on another stream) and see what
// the model says where NCCL and CUDA would hang or corrupt memory.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../comm_task.h"
#include "../device_comm.h"
#include "../device_ops.h"
#include "../errors.h"

namespace pipecore {
namespace {

class NcclModel {
 public:
  // `connected`: the group's communicator and its point-to-point connections made here, as a Pipeline
  // makes them before its first step (every rank of the group constructs it at once), so that a rank's
  // first batch does not wait for its peer's
  // `eager_bytes`: make_cpu_model_ops's
  NcclModel(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s, int device_index, bool connected,
            int64_t eager_bytes)
      : group_(std::move(group)),
        timeout_(static_cast<int64_t>(timeout_s * 1000)),
        comm_(make_host_device_comm(timeout_, device_index, /*all_ranks_connected=*/false, eager_bytes)) {
    if (!connected) return;
    std::vector<int> peers;
    for (int r = 0; r < group_->getSize(); ++r) {
      if (r != group_->getRank()) peers.push_back(r);
    }
    comm_->connect(*group_->getBackend(c10::DeviceType::CPU), {}, group_->getRank(), peers, {});
  }

  // Posts one batch of (send, peer, tensor) operations, in that order, as the executor posts a run of
  // SEND/RECV actions (`alone`: one operation outside any group, as a follow-up goes): its index. An
  // operation's action is its position among every operation posted.
  // `refused`: the index of an operation c10d refuses to post (out of memory), or -1.
  int64_t post(const std::vector<std::tuple<bool, int64_t, at::Tensor>>& ops, bool alone, int refused) {
    Batch batch;
    for (const auto& [send, peer, tensor] : ops) {
      auto task = std::make_shared<CommTask>();
      task->send = send;
      task->peer = static_cast<int>(peer);
      task->parts = {tensor.reshape({-1}).view(at::kByte)};  // (as a message goes; its last 16 bytes read as a trailer)
      task->group = group_.get();
      task->action = actions_++;
      batch.tasks.push_back(std::move(task));
    }
    make_model_refuse_post(refused);
    try {
      batch.ready = comm_->post_batch(batch.tasks, comm_->compute_stream(), /*grouped=*/!alone);
    } catch (...) {
      make_model_refuse_post(-1);
      throw;
    }
    make_model_refuse_post(-1);
    batches_.push_back(std::move(batch));
    return static_cast<int64_t>(batches_.size()) - 1;
  }

  // The compute stream (a second one: `second_stream`) waits for the batch's receives (CommError if they
  // did not arrive): their tensors.
  std::vector<at::Tensor> consume(int64_t index, bool second_stream) {
    const auto stream = make_model_stream_current(second_stream);
    Batch& batch = batches_.at(index);
    const ComputeStream on = comm_->compute_stream();
    std::vector<at::Tensor> received;
    for (const auto& task : batch.tasks) {
      if (task->send) continue;
      comm_->consume(*task, *batch.ready, on);
      received.push_back(task->parts[0]);  // (bytes)
    }
    return received;
  }

  // Lets go of the batch's receives (`consumed`: consume ran) with the default compute stream current,
  // or a second one (`second_stream`: as under torch.cuda.stream(...)).
  void release(int64_t index, bool consumed, bool second_stream) {
    const auto stream = make_model_stream_current(second_stream);
    Batch& batch = batches_.at(index);
    const ComputeStream on = comm_->compute_stream();
    for (const auto& task : batch.tasks) {
      if (!task->send) comm_->release(*task, *batch.ready, consumed, on);
    }
  }

  // Waits on the host for the batch's group (all of its operations): CommError with the model's reason.
  void wait(int64_t index) {
    const auto& task = batches_.at(index).tasks.front();
    try {
      task->works.at(0)->wait(timeout_);
    } catch (const std::exception& e) {
      throw CommError(e.what());
    }
  }

  std::vector<std::string> violations() const { return comm_->contract_violations(); }

 private:
  struct Batch {
    std::vector<std::shared_ptr<CommTask>> tasks;
    std::shared_ptr<StreamMarker> ready;
  };
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;  // (before comm_, which reads it)
  std::unique_ptr<DeviceComm> comm_;
  std::vector<Batch> batches_;
  int64_t actions_ = 0;
};

}  // namespace

void bind_nccl_model(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<NcclModel>(m, "NcclModel",
                        "the device path over the CPU model of NCCL on `group` (gloo), one batch at a time (tests)")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, double, int, bool, int64_t>(), py::arg("group"),
           py::arg("timeout"), py::arg("device_index") = 0, py::arg("connected") = true, py::arg("eager_bytes") = 0)
      .def("post", &NcclModel::post, py::arg("ops"), py::arg("alone") = false, py::arg("refused") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("consume", &NcclModel::consume, py::arg("batch"), py::arg("second_stream") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("release", &NcclModel::release, py::arg("batch"), py::arg("consumed"), py::arg("second_stream") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("wait", &NcclModel::wait, py::arg("batch"), py::call_guard<py::gil_scoped_release>())
      .def("violations", &NcclModel::violations);
  m.def("_model_device_synchronize", &model_device_synchronize, py::arg("why"), py::arg("device"),
        py::call_guard<py::gil_scoped_release>(),
        "a device-wide synchronisation of a modelled device (cudaFree, empty_cache): the host held until every "
        "stream of every CPU model of it in this process completed its work; a CommError names what did not");
}

}  // namespace pipecore
