#include "grad_reduce.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "diagnostics.h"
#include "errors.h"

namespace pipecore {

namespace {
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `flags` on the host once the current stream reached them: on a device, copied to pinned memory and
// its event polled (a synchronising copy would make the host wait for the whole device, unbounded);
// undefined if that did not happen within `timeout`.
at::Tensor flags_on_host(const at::Tensor& flags, std::chrono::milliseconds timeout) {
  if (flags.is_cpu()) return flags.contiguous();
  at::Tensor host = at::empty(flags.sizes(), flags.options().device(at::kCPU).pinned_memory(true));
  host.copy_(flags, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl guard(flags.device().type());
  c10::Event copied(flags.device().type());
  copied.record(guard.getStream(flags.device()));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(10);
  while (!copied.query()) {
    if (std::chrono::steady_clock::now() > deadline) return {};
    std::this_thread::sleep_for(pause);
    pause = std::min(2 * pause, std::chrono::microseconds(500));
  }
  return host;
}
}  // namespace

// Runs after a parameter's AccumulateGrad (its .grad holds what this backward added).
struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(GradReducer* reducer, size_t bucket, size_t index) : reducer_(reducer), bucket_(bucket), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    reducer_->on_accumulated(bucket_, index_);
    return outputs;
  }

 private:
  GradReducer* reducer_;
  size_t bucket_;
  size_t index_;
};

GradReducer::GradReducer(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeout_s)
    : group_(std::move(group)), timeout_ms_(timeout_of(timeout_s).count()) {}

GradReducer::~GradReducer() {
  for (const auto& [acc, key] : hooks_) accumulators_[acc]->del_post_hook(key);
}

void GradReducer::add_bucket(int64_t stage, std::vector<at::Tensor> params, const at::Tensor& like) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(finished_, "pipecore: buckets are added between steps");
  Bucket b;
  b.stage = stage;
  for (const auto& p : params) {
    TORCH_CHECK(p.requires_grad() && p.is_leaf(), "pipecore: a reduced parameter must be a leaf that requires grad");
    TORCH_CHECK(p.scalar_type() == like.scalar_type() && p.device() == like.device(),
                "pipecore: a bucket holds one dtype on one device");
    b.offsets.push_back(b.payload);
    b.payload += p.numel();
  }
  const size_t index = buckets_.size();
  for (size_t k = 0; k < params.size(); ++k) {
    // The accumulator is kept alive here: torch makes a new one (without the hook) for every graph
    // once nothing holds it.
    accumulators_.push_back(torch::autograd::impl::grad_accumulator(params[k]));
    TORCH_CHECK(accumulators_.back(), "pipecore: parameter without a gradient accumulator");
    hooks_.emplace_back(accumulators_.size() - 1,
                        accumulators_.back()->add_post_hook(std::make_unique<ReadyHook>(this, index, k)));
    all_params_.push_back(params[k]);
  }
  b.flat = at::zeros({b.payload + static_cast<int64_t>(params.size()) + 1}, like.options());
  b.params = std::move(params);
  b.ready.assign(b.params.size(), 0);
  if (stage >= static_cast<int64_t>(armed_.size())) armed_.resize(stage + 1, 0);
  buckets_.push_back(std::move(b));
  set_aside_.resize(all_params_.size());
}

void GradReducer::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buckets_) {
    std::fill(b.ready.begin(), b.ready.end(), 0);
    b.num_ready = 0;
    b.forced = b.sent = b.early = false;
    b.work.reset();
    b.sent_grads.clear();
    b.start_us = b.end_us = 0;
    b.done_us.reset();
  }
  std::fill(armed_.begin(), armed_.end(), 0);
  next_ = 0;
  failing_ = false;
  finished_ = false;
  succeeded_ = true;
  early_ = 0;
  late_.clear();
  post_failure_.clear();
  for (size_t k = 0; k < all_params_.size(); ++k) {
    set_aside_[k] = std::exchange(all_params_[k].mutable_grad(), at::Tensor());
  }
}

void GradReducer::arm(int64_t stage) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stage >= 0 && stage < static_cast<int64_t>(armed_.size())) armed_[stage] = 1;
}

void GradReducer::on_accumulated(size_t bucket, size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[bucket];
  if (finished_ || !armed_[b.stage]) return;  // an earlier microbatch, or a backward outside a step
  if (b.sent) {
    if (late_.empty()) {
      std::ostringstream os;
      os << "a gradient of stage " << b.stage << "'s parameter of shape " << b.params[index].sizes()
         << " was accumulated twice in its last backward, after its bucket was sent (a backward inside the "
            "backward, e.g. torch.utils.checkpoint(..., use_reentrant=True): use use_reentrant=False)";
      late_ = os.str();
    }
    return;
  }
  if (!b.ready[index]) {
    b.ready[index] = 1;
    if (++b.num_ready == b.params.size()) send_in_order();
  }
}

void GradReducer::reduce_stage(int64_t stage) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buckets_) {
    if (b.stage == stage) b.forced = true;
  }
  send_in_order();
}

void GradReducer::send_in_order() {
  while (next_ < buckets_.size()) {
    Bucket& b = buckets_[next_];
    if (!b.forced && !failing_ && b.num_ready < b.params.size()) return;
    b.early = !b.forced && !failing_;
    send(b, failing_);
    ++next_;
  }
}

void GradReducer::send(Bucket& b, bool failed) {
  // after a bucket the group refused, none goes: a later one would pair with the peers' refused one
  if (!post_failure_.empty()) return;
  at::NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(b.params.size());
  at::Tensor flags = b.flat.narrow(0, b.payload, n + 1);
  flags.zero_();
  if (failed) {
    flags.narrow(0, n, 1).fill_(1);  // the payload does not matter: nobody uses it
  } else {
    for (int64_t k = 0; k < n; ++k) {
      const at::Tensor& grad = b.params[k].grad();
      at::Tensor slot = b.flat.narrow(0, b.offsets[k], b.params[k].numel()).view(b.params[k].sizes());
      if (grad.defined()) {
        slot.copy_(grad);
        flags.narrow(0, k, 1).fill_(1);
        b.sent_grads.emplace_back(grad.unsafeGetTensorImpl(), grad._version());
      } else {
        slot.zero_();
        b.sent_grads.emplace_back(nullptr, 0);
      }
    }
  }
  std::vector<at::Tensor> tensors{b.flat};
  const double start_us = now_us();
  try {
    b.work = group_->allreduce(tensors);
  } catch (const std::exception& e) {  // (the group refused it: an aborted NCCL communicator): finish says it
    post_failure_ = error_text(e);
    return;
  }
  b.start_us = start_us;
  if (b.early) ++early_;
  // The completion time, for traces: gloo completes the Work's future when the all-reduce is done
  // (NCCL's when it is enqueued: there finish() takes the time after its wait instead).
  if (!b.flat.is_cuda()) {
    try {
      auto done = std::make_shared<double>(0.0);
      b.work->getFuture()->addCallback([done](c10::ivalue::Future&) { *done = now_us(); });
      b.done_us = done;
    } catch (const std::exception&) {  // not every backend's Work has a future
    }
  }
}

bool GradReducer::finish(bool failed, double scale) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return succeeded_;
  finished_ = true;
  failing_ = failed;
  for (auto& b : buckets_) b.forced = true;
  send_in_order();
  std::string broken = post_failure_;
  for (auto& b : buckets_) {
    try {
      if (b.work) b.work->wait(std::chrono::milliseconds(timeout_ms_));
    } catch (const std::exception& e) {
      if (broken.empty()) broken = error_text(e);
    }
    b.end_us = b.done_us && *b.done_us > 0 ? *b.done_us : now_us();
  }
  if (!broken.empty()) {
    succeeded_ = false;
    throw CommError(failed_waiting("rank " + std::to_string(group_->getRank()) + " of the data-parallel group: "
                                   "reducing the gradients",
                                   std::chrono::milliseconds(timeout_ms_)),
                    broken);
  }
  at::NoGradGuard no_grad;
  // every bucket's flags in one copy to the host (on CUDA the host waits for the reductions here,
  // once, at the end of the step)
  std::vector<at::Tensor> parts;
  for (const auto& b : buckets_) parts.push_back(b.flat.narrow(0, b.payload, b.params.size() + 1).to(at::kFloat));
  const at::Tensor all_flags = flags_on_host(at::cat(parts), std::chrono::milliseconds(timeout_ms_));
  if (!all_flags.defined()) {
    succeeded_ = false;
    throw CommError(not_within("rank " + std::to_string(group_->getRank()) + " of the data-parallel group: the "
                               "reduced gradients did not arrive",
                               std::chrono::milliseconds(timeout_ms_), "a replica stopped, or the device is stuck"));
  }
  std::vector<const float*> flags;  // per bucket: one flag per parameter, then the failure flag
  const float* next_flags = all_flags.data_ptr<float>();
  for (const auto& b : buckets_) {
    flags.push_back(next_flags);
    next_flags += b.params.size() + 1;
    if (flags.back()[b.params.size()] != 0) succeeded_ = false;
  }
  if (failed || !succeeded_) return succeeded_ = false;
  for (const auto& b : buckets_) {  // nothing may have changed a gradient since it was copied
    for (size_t k = 0; k < b.sent_grads.size() && late_.empty(); ++k) {
      const at::Tensor& grad = b.params[k].grad();
      if (b.sent_grads[k].first != (grad.defined() ? grad.unsafeGetTensorImpl() : nullptr) ||
          (grad.defined() && b.sent_grads[k].second != grad._version())) {
        std::ostringstream os;
        os << "stage " << b.stage << "'s parameter of shape " << b.params[k].sizes()
           << " got more gradient after its bucket was sent (by code that writes .grad during the backward)";
        late_ = os.str();
      }
    }
  }
  if (!late_.empty()) {
    succeeded_ = false;
    throw std::logic_error(late_);
  }
  for (size_t j = 0; j < buckets_.size(); ++j) {
    const Bucket& b = buckets_[j];
    for (size_t k = 0; k < b.params.size(); ++k) {
      if (flags[j][k] == 0) continue;  // no replica has a gradient
      at::Tensor param = b.params[k];
      at::Tensor sum = b.flat.narrow(0, b.offsets[k], param.numel()).view(param.sizes());
      at::Tensor& grad = param.mutable_grad();
      if (grad.defined()) {
        grad.copy_(sum);
        if (scale != 1.0) grad.mul_(scale);
      } else {
        grad = sum.mul(scale);  // a new tensor: the bucket is reused next step
      }
    }
  }
  return true;
}

void GradReducer::restore(bool keep) {
  std::lock_guard<std::mutex> lock(mu_);
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < all_params_.size(); ++k) {
    at::Tensor before = std::move(set_aside_[k]);
    set_aside_[k] = at::Tensor();
    at::Tensor& grad = all_params_[k].mutable_grad();
    if (!keep || !grad.defined()) {
      grad = std::move(before);
    } else if (before.defined()) {
      grad = before.add_(grad);  // into the tensor .grad held, as torch's accumulation does
    }
  }
}

std::vector<GradReducer::Event> GradReducer::trace() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Event> out;
  for (size_t j = 0; j < buckets_.size(); ++j) {
    const Bucket& b = buckets_[j];
    if (b.start_us > 0) {
      out.push_back({b.stage, static_cast<int64_t>(j), static_cast<int64_t>(b.flat.nbytes()), b.start_us,
                     b.end_us});
    }
  }
  return out;
}

}  // namespace pipecore
