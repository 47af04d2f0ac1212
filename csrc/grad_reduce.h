// Data-parallel gradient reduction of plain stages: buckets all-reduced over the data-parallel
// group while the step's other backwards still run (apex's and torch DDP's bucketed reducer, driven
// by the schedule's REDUCE_GRAD instead of by every backward).
//
// Each stage's parameters are split into buckets (Python decides: reverse registration order,
// one dtype and device per bucket, about 25 MB each). During a step:
//   - begin_step() sets the gradients `.grad` held before the step aside: the buckets carry this
//     step's contribution only, and restore() adds the old ones back (or, after a failure, puts
//     them back untouched).
//   - Before a stage's last backward (B or W) the executor arms the stage: from then on, each
//     AccumulateGrad of one of its parameters marks the parameter ready (a post hook on its
//     accumulator, as torch DDP's reducer does). A bucket whose parameters are all ready is copied
//     into its flat buffer and all-reduced asynchronously right away, inside the backward. A stage
//     with a dw_builder is never armed: its runner writes .grad after those hooks.
//   - At the stage's REDUCE_GRAD every bucket not sent yet goes (parameters that got no gradient in
//     the last backward, or none at all).
//   - finish() sends what a failed step never reached, waits for every bucket (with the timeout),
//     reads every bucket's flags in one copy to the host, and writes gradient * scale back. On CUDA
//     that copy (and NCCL's wait with a timeout) makes the host wait for the reductions, once per
//     step, at its end; the all-reduces themselves run on NCCL's stream after the gradients.
// Buckets go in one order on every replica: by index, a ready bucket waits for the ones before it.
// Each buffer ends with one flag per parameter ("had a gradient here") and one "this replica's
// step failed" flag, so that a failure anywhere reaches every replica with the data, and a
// parameter no replica used keeps no gradient, as in one process.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pipecore {

class GradReducer {
 public:
  GradReducer(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s);
  ~GradReducer();  // removes its hooks from the parameters' accumulators
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Appends a bucket (buckets go in the order they were added, on every replica alike): `params`
  // of local stage `stage`, all of `like`'s dtype and device. No params: a flags-only bucket (a rank
  // whose stages reduce their gradients otherwise still says whether its step failed).
  void add_bucket(int64_t stage, std::vector<at::Tensor> params, const at::Tensor& like);

  void begin_step();
  // The stage's last backward starts: accumulations of its parameters now mark them ready.
  void arm(int64_t stage);
  // REDUCE_GRAD: every bucket of the stage not sent yet goes now.
  void reduce_stage(int64_t stage);
  // Sends what was not sent (flagged as failed if `failed`), waits for every bucket. Returns true if
  // every replica's step succeeded; then (and only then, and unless `failed`) each parameter's
  // gradient becomes the reduced sum times `scale`. Throws CommError on a timeout or a broken group,
  // std::logic_error when a parameter's gradient changed after its bucket was sent. Once per step.
  bool finish(bool failed, double scale);
  // After finish: `keep` adds the gradients set aside by begin_step to this step's; otherwise they
  // are put back as they were (a failed step leaves .grad as it found it).
  void restore(bool keep);

  struct Event {
    int64_t stage;
    int64_t bucket;
    int64_t bytes;
    double start_us;  // sent
    double end_us;    // completed (seen by the backend's completion callback, or by the wait)
  };
  std::vector<Event> trace() const;
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets sent before their stage's REDUCE_GRAD in the last step (from the backward's hooks).
  int64_t early_buckets() const { return early_; }

 private:
  using Accumulator = std::decay_t<decltype(torch::autograd::impl::grad_accumulator(
      std::declval<const torch::autograd::Variable&>()))>;
  struct Bucket {
    int64_t stage;
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;
    int64_t payload = 0;  // elements before the flags
    at::Tensor flat;      // payload, one flag per parameter, the failure flag
    std::vector<uint8_t> ready;
    size_t num_ready = 0;
    bool forced = false;  // REDUCE_GRAD or finish: goes without waiting for its parameters
    bool sent = false;
    bool early = false;
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<std::pair<const c10::TensorImpl*, uint32_t>> sent_grads;  // identity and version
    double start_us = 0, end_us = 0;
    std::shared_ptr<double> done_us;  // written by the completion callback
  };
  friend struct ReadyHook;
  void on_accumulated(size_t bucket, size_t index);
  void send_in_order();  // sends every bucket from next_ on that may go; mu_ held
  void send(Bucket& b, bool failed);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t timeout_ms_;
  mutable std::mutex mu_;
  std::vector<Bucket> buckets_;
  std::vector<uint8_t> armed_;  // per local stage
  size_t next_ = 0;             // buckets before it were sent
  bool failing_ = false;        // finish(failed=true): what is sent now carries the failure flag
  bool finished_ = true;
  bool succeeded_ = true;
  int64_t early_ = 0;
  std::string late_;  // a parameter accumulated again after its bucket was sent
  std::string post_failure_;  // why the group refused a bucket's all-reduce (finish raises it; none goes after)
  std::vector<Accumulator> accumulators_;
  std::vector<std::pair<size_t, uintptr_t>> hooks_;  // (accumulator, hook key)
  std::vector<at::Tensor> all_params_;
  std::vector<at::Tensor> set_aside_;  // .grad before the step, per all_params_
};

}  // namespace pipecore
