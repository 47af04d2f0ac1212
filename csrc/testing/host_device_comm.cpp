// The device path's protocol run by the host on CPU tensors (see device_comm.h), so that machines
// without a GPU test the executor's side of it: batches posted at their first action, no receive
// window and no send budget, statuses folded into a step status when a message is consumed, sent
// trailers carrying that status on, loss seeds gated by it, compute running on aborted messages,
// and the status read once at the end of the step; shaped messages' headers read by the host. What
// CUDA does with a communication stream, events and one-thread kernels, this does on the host: it
// waits for a receive's parts when an action consumes them (where the compute stream would wait on
// the receive's event), and a batch's operations are posted one by one (gloo has no coalescing; it
// needs none, since it does not serialise a group's operations). Receives an aborted step drained
// without consuming are waited for when the next step begins (gloo writes into a receive's buffer
// until its Work completes); an executor destroyed before that drops them, as the host path drops
// receives posted ahead.
// The streams are a ledger (stream_ledger.h): the same contract code as CUDA's (../stream_contract.h)
// runs on it, and it refuses any use or free that a GPU's streams would not order.
// Selected only by tests (Executor._emulate_device_comm).
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "../diagnostics.h"
#include "../comm.h"
#include "../device_comm.h"
#include "../errors.h"
#include "../message_status.h"
#include "../stream_contract.h"
#include "stream_ledger.h"

namespace pipecore {
namespace {

// As NCCL (ncclDataType_t, which c10d's ProcessGroupNCCL maps to) refuses a point-to-point
// operation on any other dtype: no int16, no complex, no uint16/32/64.
void check_nccl_dtypes(const CommTask& task) {
  static const std::unordered_set<at::ScalarType> nccl = {
      at::kChar, at::kByte, at::kBool, at::kInt, at::kLong, at::kHalf, at::kFloat, at::kDouble, at::kBFloat16,
      at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  for (const auto& part : wire_parts(task)) {
    TORCH_CHECK(nccl.count(part.scalar_type()) != 0, "pipecore (model of NCCL): a ",
                task.send ? "send" : "receive", " of ", part.scalar_type(), ", which NCCL does not support");
  }
}

class HostDeviceComm final : public DeviceComm {
 public:
  // `timeout`: the executor's, which outlives this
  explicit HostDeviceComm(const std::chrono::milliseconds& timeout) : timeout_(timeout) {}

  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  void begin_step() override {
    // every receive of the previous step was let go of explicitly (rule 3 is kept only where it is)
    if (unreleased_ != 0) {
      ledger_->note_violation(std::to_string(unreleased_.load()) +
                            " receives of the previous step were dropped without DeviceComm::release");
      unreleased_ = 0;
    }
    // an aborted step leaves receives it drained without consuming: they land before the next step
    if (!drain(timeout_)) {
      std::ostringstream os;
      os << "pipecore: messages of the previous (aborted) step did not arrive within " << seconds(timeout_);
      throw CommError(os.str());
    }
    status_ = kMessageOk;
  }

  std::shared_ptr<StreamMarker> post_batch(c10d::Backend& /*backend*/,
                                           const std::vector<std::shared_ptr<CommTask>>& tasks) override {
    before_batch(*ledger_, tasks);
    for (const auto& task : tasks) check_nccl_dtypes(*task);  // refused before any of the batch is posted
    for (const auto& task : tasks) {
      post_parts(*task);
      if (!task->send) {
        std::lock_guard<std::mutex> lock(mu_);
        receives_.insert(receives_.end(), task->works.begin(), task->works.end());
      }
    }
    for (const auto& task : tasks) {
      if (!task->send && task->header_bytes > 0) header_to_host(*ledger_, *task);
    }
    std::shared_ptr<StreamMarker> ready = after_batch(*ledger_, tasks);
    for (const auto& task : tasks) {
      if (!task->send) ++unreleased_;
      task->mark_posted(nullptr);
    }
    return ready;
  }

  void consume(CommTask& task, const StreamMarker& ready) override {
    before_read(*ledger_, task, ready);
    wait_for(task, timeout_);
    if (task.header_bytes > 0) return;  // a shaped message: its status was read on the host
    const int64_t code = message_status(task.parts);
    fold(code == kMessageUnknown ? kStatusNotOurs : code);
  }

  void release(CommTask& task, const StreamMarker& ready, bool consumed) override {
    --unreleased_;
    on_release(*ledger_, task, ready, consumed);
  }

  at::Tensor read_header(CommTask& task, std::chrono::milliseconds timeout) override {
    // where CUDA waits for the header's copy to the host, which follows the transfer; kept, as CUDA's
    // copy is, for a second reading (a failure after the first: the aborted rest drains the message),
    // since a gloo Work completes one wait only and finish_step forgets which were waited for
    if (!task.header_host.defined()) {
      wait_for(task, timeout);
      task.header_host = task.parts[0].narrow(0, 0, task.header_bytes).clone();
    }
    return task.header_host;
  }

  void waited_on_host(const CommTask& task) override {
    std::lock_guard<std::mutex> lock(mu_);  // not to be waited for again (first_wait)
    for (const auto& work : task.works) {
      if (work) waited_.insert(work.get());
    }
  }

  void write_trailer(at::Tensor& trailer) override {
    TORCH_CHECK(trailer.is_cpu() && trailer.is_contiguous() && trailer.nbytes() >= 16,
                "pipecore: a trailer is 16 contiguous host bytes");
    const int64_t code = status_.load();
    const int64_t words[2] = {code > kMessageReplan ? kMessageAborted : code, kTrailerMagic};
    std::memcpy(trailer.data_ptr(), words, sizeof(words));
  }

  void fill_seed(at::Tensor& seed, double value) override { seed.fill_(status_.load() == kMessageOk ? value : 0.0); }

  bool finish_step(std::chrono::milliseconds, int64_t& status) override {
    // every message consumed so far was waited for and folded: the status is final. Their Works (and
    // buffers) go now, as on the device; a receive drained without consumption, after an abort, stays
    // for the next begin_step to wait for.
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<c10::intrusive_ptr<c10d::Work>> pending;
      for (auto& work : receives_) {
        if (waited_.count(work.get()) == 0) pending.push_back(std::move(work));
      }
      receives_.swap(pending);
      waited_.clear();  // only Works of receives_ are in it, and those left were not waited for
    }
    const int64_t code = status_.load();
    status = code == kStatusNotOurs ? kMessageUnknown : code;
    return true;
  }

  std::vector<std::string> contract_violations() const override { return ledger_->violations(); }

 private:
  // Waits for `task`'s parts (each Work once); CommError if one failed or took longer than `timeout`.
  void wait_for(CommTask& task, std::chrono::milliseconds timeout) {
    for (const auto& work : task.works) {
      if (!work || !first_wait(*work)) continue;
      bool done = false;
      std::string why = "timed out";
      try {
        done = work->wait(timeout);
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (!done) throw CommError(why);  // the executor says which message
    }
  }

  // Waits for this step's receives, consumed or not, within `timeout`: gloo writes into a receive's
  // buffer until its Work completes. False if one failed or took longer.
  bool drain(std::chrono::milliseconds timeout) {
    std::vector<c10::intrusive_ptr<c10d::Work>> receives;
    {
      std::lock_guard<std::mutex> lock(mu_);
      receives.swap(receives_);
    }
    // the Works stay alive until the set is cleared: no address in it is reused meanwhile
    const auto deadline = deadline_after(timeout);
    bool ok = true;
    for (auto& work : receives) {
      if (!first_wait(*work)) continue;
      const auto left = time_left(deadline);
      try {
        ok = ok && left.count() > 0 && work->wait(left);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    waited_.clear();
    return ok;
  }
  // gloo's Work completes one wait: a second one waits for another message
  bool first_wait(const c10d::Work& work) {
    std::lock_guard<std::mutex> lock(mu_);
    return waited_.insert(&work).second;
  }

  void fold(int64_t code) {  // status = max(status, code); the two halves of a pair may fold at once
    int64_t seen = status_.load();
    while (code > seen && !status_.compare_exchange_weak(seen, code)) {
    }
  }

  const std::chrono::milliseconds& timeout_;
  std::shared_ptr<StreamLedger> ledger_ = std::make_shared<StreamLedger>();
  std::atomic<int64_t> status_{kMessageOk};
  std::atomic<int64_t> unreleased_{0};  // receives posted and not released yet
  std::mutex mu_;
  std::vector<c10::intrusive_ptr<c10d::Work>> receives_;  // this step's, until it ends
  std::unordered_set<const c10d::Work*> waited_;          // those of receives_ waited for once
};

}  // namespace

std::unique_ptr<DeviceComm> make_host_device_comm(const std::chrono::milliseconds& timeout) {
  return std::make_unique<HostDeviceComm>(timeout);
}

}  // namespace pipecore
