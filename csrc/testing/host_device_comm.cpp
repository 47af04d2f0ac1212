// The CPU model of the device path's calls (../device_ops.h), for tests on machines without a GPU: the
// same decisions (../device_comm.cpp) run on CPU tensors over gloo, and the model refuses what a GPU
// and NCCL would not do.
// - Streams: a ledger (stream_ledger.h) keeps the two streams' order as vector clocks and refuses any
//   use or free of a message buffer they would not order (the stream contract, ../stream_contract.h).
//   The compute stream is the host itself: where it would wait on a marker of the communication
//   stream, the host waits for every group that stream waited for until then (a GPU's stream runs
//   its work in order: a batch's ready event follows every earlier batch with receives).
// - NCCL's groups: a group's operations are collected and posted together when it ends (a coalesced
//   group launches as one; an aborted one launches nothing), as bytes; a dtype NCCL lacks is refused
//   there. A communicator's groups launch one after another, each once the group before it completed
//   (a thread per communicator posts them), as NCCL's kernels run on the communicator's stream: a
//   cycle of groups across ranks leaves one never launched, and a wait for it says so ("this would
//   hang"), naming its operations and those of the group it waited behind. The group's Work is all of
//   its operations (a sender's buffers are held until its batch's receives completed too, as NCCL's
//   coalesced Work completes).
// - Copies to the host are made when the host waits for the marker after them, once the transfers
//   before them completed.
// - A receive dropped unread (an aborted step) is waited for when the next step begins (gloo writes
//   into its buffer until its Work completes); a receive never released is a violation.
// Selected only by tests (Executor._emulate_device_comm).
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include "../comm.h"
#include "../device_comm.h"
#include "../device_ops.h"
#include "../diagnostics.h"
#include "../errors.h"
#include "../message_status.h"
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

// A group's Work: every operation of it, once its communicator's stream launched it. Each gloo Work is
// waited for once (a second wait would wait for another message); later waiters wait for that first
// wait's outcome.
class GroupWork final : public c10d::Work {
 public:
  explicit GroupWork(std::string what) : what_(std::move(what)) {}

  // Its operations were posted (or `never`: it cannot launch, and why).
  void launch(std::vector<c10::intrusive_ptr<c10d::Work>> ops, const std::string& never = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_ = std::move(ops);
    state_.assign(ops_.size(), kIdle);
    errors_.assign(ops_.size(), nullptr);
    never_ = never;
    launched_ = true;
    changed_.notify_all();
  }
  const std::string& what() const { return what_; }
  // Ends a wait on its operations (gloo's abortWaitSend/abortWaitRecv): the model's teardown.
  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& op : ops_) op->abort();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = deadline_after(timeout.count() > 0 ? timeout : std::chrono::milliseconds::max());
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!changed_.wait_until(lock, deadline, [&] { return launched_; })) {
        throw std::runtime_error("pipecore (model of NCCL): " + what_ + " was never launched: a group queued "
                                 "before it on its communicator did not complete (on a GPU, groups on one "
                                 "stream run one after another: this would hang)");
      }
      if (!never_.empty()) throw std::runtime_error(never_);
    }
    for (size_t i = 0; i < ops_.size(); ++i) {
      std::unique_lock<std::mutex> lock(mu_);
      if (state_[i] == kIdle) {
        state_[i] = kWaiting;
        lock.unlock();
        std::exception_ptr error;
        try {
          if (!ops_[i]->wait(std::max(time_left(deadline), std::chrono::milliseconds(1)))) {
            throw std::runtime_error("the wait was aborted");
          }
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        state_[i] = error ? kFailed : kDone;
        errors_[i] = error;
        changed_.notify_all();
      } else if (state_[i] == kWaiting &&
                 !changed_.wait_until(lock, deadline, [&] { return state_[i] != kWaiting; })) {
        throw std::runtime_error("timed out");
      }
      if (state_[i] == kFailed) std::rethrow_exception(errors_[i]);
    }
    return true;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    return launched_ && never_.empty() && std::all_of(state_.begin(), state_.end(), [](int s) { return s == kDone; });
  }

  // the last strong reference went: the operations (and their buffers) go, whatever weak ones remain
  void release_resources() override { ops_.clear(); }

 private:
  enum { kIdle, kWaiting, kDone, kFailed };
  const std::string what_;  // its operations, named for errors
  bool launched_ = false;
  std::string never_;
  std::vector<c10::intrusive_ptr<c10d::Work>> ops_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<int> state_;
  std::vector<std::exception_ptr> errors_;
};

// One communicator's stream: its groups launch one after another, each once the group before it
// completed, as NCCL's kernels do on the communicator's stream. A thread of its own posts them (the
// host never waits for a launch).
class CommStream {
 public:
  explicit CommStream(const std::chrono::milliseconds& timeout) : timeout_(timeout), thread_([this] { loop(); }) {}
  ~CommStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (running_) running_->abort();  // (a wait of gloo's ends only so)
    }
    queued_.notify_all();
    thread_.join();
    for (auto& [group, ops] : queue_) group->launch({}, "pipecore (model of NCCL): the executor went first");
  }
  // Queues `group`, whose operations are `ops` (copies of the tasks: the executor keeps its own).
  void queue(c10::intrusive_ptr<GroupWork> group, std::vector<std::shared_ptr<CommTask>> ops) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(std::move(group), std::move(ops));
    }
    queued_.notify_all();
  }

 private:
  void loop() {
    c10::intrusive_ptr<GroupWork> before;
    for (;;) {
      std::pair<c10::intrusive_ptr<GroupWork>, std::vector<std::shared_ptr<CommTask>>> next;
      {
        std::unique_lock<std::mutex> lock(mu_);
        queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        next = std::move(queue_.front());
        queue_.pop_front();
        running_ = before;
      }
      std::string never;
      if (before) {
        try {
          before->wait(timeout_);
        } catch (const std::exception& e) {
          never = "pipecore (model of NCCL): " + next.first->what() + " never launched: " + before->what() +
                  ", queued before it on its communicator, did not complete (" + e.what() + ")";
        }
      }
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      if (never.empty()) {
        try {
          for (auto& op : next.second) {
            post_parts(*op);
            works.insert(works.end(), op->works.begin(), op->works.end());
          }
        } catch (const std::exception& e) {
          never = std::string("pipecore (model of NCCL): posting ") + next.first->what() + " failed: " + e.what();
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
        if (stop_) {
          next.first->launch({}, "pipecore (model of NCCL): the executor went first");
          return;
        }
      }
      next.first->launch(std::move(works), never);
      before = std::move(next.first);
    }
  }

  const std::chrono::milliseconds& timeout_;
  std::mutex mu_;
  std::condition_variable queued_;
  std::deque<std::pair<c10::intrusive_ptr<GroupWork>, std::vector<std::shared_ptr<CommTask>>>> queue_;
  c10::intrusive_ptr<GroupWork> running_;  // the group the thread waits for (aborted to stop it)
  bool stop_ = false;
  std::thread thread_;
};

// A point on a lane: the ledger's clock, and on the communication stream the groups it waited for
// until then and the copies to the host queued on it since the last marker.
struct CpuMarker final : StreamMarker {
  std::shared_ptr<StreamMarker> clock;
  std::vector<c10::intrusive_ptr<c10d::Work>> groups;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (host, bytes)
};

class CpuModelOps final : public DeviceOps {
 public:
  // `timeout`: the executor's, which outlives this
  explicit CpuModelOps(const std::chrono::milliseconds& timeout) : timeout_(timeout) {}

  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  // -- streams: the ledger's order, and what the host waits for in place of a compute stream
  std::shared_ptr<StreamMarker> record(Lane lane) override {
    auto marker = std::make_shared<CpuMarker>();
    marker->clock = ledger_->record(lane);
    if (lane == Lane::kComm) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& group : comm_groups_) {
        if (auto live = group.lock()) marker->groups.push_back(std::move(live));
      }
      marker->copies.swap(copies_);
    }
    return marker;
  }
  void wait(Lane lane, const StreamMarker& marker) override {
    const auto& cpu = static_cast<const CpuMarker&>(marker);
    ledger_->wait(lane, *cpu.clock);
    if (lane == Lane::kCompute) {
      std::string why;
      if (!arrived(cpu, timeout_, why)) throw CommError(why);  // the executor says which message
    } else if (lane == Lane::kOwner) {
      std::lock_guard<std::mutex> lock(mu_);  // (waited for when the next step begins)
      dropped_.insert(dropped_.end(), cpu.groups.begin(), cpu.groups.end());
    }
  }
  void keep_owner(StreamMarker&) override {}  // one compute stream
  void allocated(const at::Tensor& t, Lane lane) override { ledger_->allocated(t, lane); }
  void used(const at::Tensor& t, Lane lane, bool writes) override { ledger_->used(t, lane, writes); }
  void freed(const at::Tensor& t) override {
    --unreleased_;
    ledger_->freed(t);
  }
  std::vector<std::string> violations() const override { return ledger_->violations(); }

  // -- the step status
  void begin_step() override {
    // every receive of the previous step was let go of explicitly (rule 3 is kept only where it is)
    if (unreleased_ != 0) {
      ledger_->note_violation(std::to_string(unreleased_.load()) +
                              " receive buffers of the previous step were dropped without DeviceComm::release");
      unreleased_ = 0;
    }
    // an aborted step leaves receives it drained without consuming: they land before the next step
    std::vector<c10::intrusive_ptr<c10d::Work>> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped.swap(dropped_);
      comm_groups_.clear();  // each one consumed or dropped: waited for by now
    }
    const auto deadline = deadline_after(timeout_);
    for (auto& group : dropped) {
      try {
        group->wait(std::max(time_left(deadline), std::chrono::milliseconds(1)));
      } catch (const std::exception&) {
        std::ostringstream os;
        os << "pipecore: messages of the previous (aborted) step did not arrive within " << seconds(timeout_);
        throw CommError(os.str());
      }
    }
    status_ = kMessageOk;
  }
  void fold_trailer(const at::Tensor& trailer) override {
    const int64_t code = message_status({trailer});
    fold(code == kMessageUnknown ? kStatusNotOurs : code);
  }
  void write_trailer(at::Tensor& trailer) override {
    TORCH_CHECK(trailer.is_cpu() && trailer.is_contiguous() && trailer.nbytes() >= 16,
                "pipecore: a trailer is 16 contiguous host bytes");
    const int64_t code = status_.load();
    const int64_t words[2] = {code > kMessageReplan ? kMessageAborted : code, kTrailerMagic};
    std::memcpy(trailer.data_ptr(), words, sizeof(words));
  }
  void fill_seed(at::Tensor& seed, double value) override { seed.fill_(status_.load() == kMessageOk ? value : 0.0); }
  std::shared_ptr<StreamMarker> status_to_host() override { return record(Lane::kCompute); }
  int64_t status_on_host() override { return status_.load(); }

  // -- the communicator
  std::shared_ptr<void> on_comm_stream() override { return nullptr; }
  void start_group(c10d::Backend&) override { group_.clear(); }
  void post(c10d::Backend&, CommTask& task) override {
    check_nccl_dtypes(task);  // (inside the group: NCCL refuses it there, after what was added before)
    group_.push_back(&task);
  }
  c10::intrusive_ptr<c10d::Work> end_group(c10d::Backend& backend) override {
    std::vector<CommTask*> group;
    group.swap(group_);
    if (aborted_group_) {  // nothing of an aborted group is launched
      aborted_group_ = false;
      return {};
    }
    return launch(backend, /*pair=*/-1, group, "the group");
  }
  c10::intrusive_ptr<c10d::Work> post_alone(c10d::Backend& backend, CommTask& task) override {
    check_nccl_dtypes(task);
    return launch(backend, task.peer, {&task}, "the follow-up");  // (on the stream of its pair's communicator)
  }
  void abort(c10d::Backend&) override { aborted_group_ = true; }
  void comm_waits(c10d::Work& group) override {
    std::lock_guard<std::mutex> lock(mu_);
    comm_groups_.emplace_back(c10::intrusive_ptr<c10d::Work>::reclaim_copy(&group));
  }

  // -- the host
  at::Tensor to_host(const at::Tensor& bytes) override {
    at::Tensor host = at::empty_like(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    copies_.emplace_back(host, bytes);
    return host;
  }
  bool host_wait(const StreamMarker& marker, std::chrono::milliseconds timeout) override {
    std::string why;
    if (!arrived(static_cast<const CpuMarker&>(marker), timeout, why)) throw CommError(why);  // (the model knows why)
    return true;
  }

 private:
  // Queues `tasks` (copies: the executor keeps its own) on the stream of `backend`'s communicator of
  // all ranks (pair -1), or of its communicator of this rank and `pair`.
  c10::intrusive_ptr<c10d::Work> launch(c10d::Backend& backend, int pair, const std::vector<CommTask*>& tasks,
                                        const char* kind) {
    std::vector<std::shared_ptr<CommTask>> ops;
    std::ostringstream what;
    what << kind << ":";
    for (CommTask* task : tasks) {
      auto op = std::make_shared<CommTask>();
      op->send = task->send;
      op->parts = task->parts;
      op->peer = task->peer;
      op->tag = task->tag;
      op->group = task->group;
      op->channel = task->channel;
      ops.push_back(std::move(op));
      what << (ops.size() > 1 ? ", " : " ") << (task->send ? "a send to rank " : "a receive from rank ") << task->peer << " ("
           << message_bytes(task->parts) << " bytes" << (task->action >= 0 ? ", action " : "")
           << (task->action >= 0 ? std::to_string(task->action) : std::string()) << ")";
      if (!task->send) unreleased_ += static_cast<int64_t>(task->parts.size());
    }
    auto work = c10::make_intrusive<GroupWork>(what.str());
    auto& stream = streams_[{&backend, pair}];
    if (!stream) stream = std::make_unique<CommStream>(timeout_);
    stream->queue(work, std::move(ops));
    return work;
  }

  // Waits for the marker's groups (within `timeout`) and makes its copies; false (and why) if a group failed.
  static bool arrived(const CpuMarker& marker, std::chrono::milliseconds timeout, std::string& why) {
    const auto deadline = deadline_after(timeout);
    for (const auto& group : marker.groups) {
      try {
        group->wait(std::max(time_left(deadline), std::chrono::milliseconds(1)));
      } catch (const std::exception& e) {
        why = e.what();
        return false;
      }
    }
    for (const auto& [host, bytes] : marker.copies) host.copy_(bytes);
    return true;
  }

  void fold(int64_t code) {  // status = max(status, code); the two halves of a pair may fold at once
    int64_t seen = status_.load();
    while (code > seen && !status_.compare_exchange_weak(seen, code)) {
    }
  }

  const std::chrono::milliseconds& timeout_;
  std::shared_ptr<StreamLedger> ledger_ = std::make_shared<StreamLedger>();
  std::atomic<int64_t> status_{kMessageOk};
  std::atomic<int64_t> unreleased_{0};  // receive buffers posted and not released yet
  std::vector<CommTask*> group_;        // the open group's operations (posted when it ends)
  bool aborted_group_ = false;
  std::mutex mu_;
  // what the communication stream waited for this step: a group whose receives were let go of is
  // not waited for again (consumed: waited for; dropped: in dropped_), and its buffers go with it
  std::vector<c10::weak_intrusive_ptr<c10d::Work>> comm_groups_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;     // copies to the host since its last marker
  std::vector<c10::intrusive_ptr<c10d::Work>> dropped_;      // receives let go of unread: waited for at begin_step
  std::map<std::pair<const c10d::Backend*, int>, std::unique_ptr<CommStream>> streams_;  // per communicator
};

}  // namespace

std::unique_ptr<DeviceOps> make_cpu_model_ops(const std::chrono::milliseconds& timeout) {
  return std::make_unique<CpuModelOps>(timeout);
}

}  // namespace pipecore
