// The CPU model of the device path's calls (../device_ops.h), for tests on machines without a GPU: the
// same decisions (../device_comm.cpp) run on CPU tensors over gloo, and the model refuses what a GPU
// and NCCL would not do.
// - Streams: a ledger (stream_ledger.h) keeps the streams' order as vector clocks and refuses any use
//   or free of a message buffer they would not order (the stream contract, ../stream_contract.h). The
//   compute stream is the host itself: where it would wait on a marker of the communication stream,
//   the host waits for every group that stream waited for until then (a GPU's stream runs its work in
//   order: a batch's ready event follows every earlier batch with receives).
// - Devices and streams of a thread, as CUDA keeps them: a trailer or seed kernel launched while
//   another device than the modelled one is current is refused (a thread starts on device 0; rank r
//   models device r + 1), and the compute stream the path takes is the thread's current one (a second
//   one may be made current: make_model_stream_current), so a wait on the wrong compute stream shows
//   as a free the ledger refuses.
// - NCCL's communicators: nccl_model.h. An abort ends every operation of the communicator (its pairs'
//   too) launched and not completed, and nothing more can be posted on it. A communicator connects at
//   its first operation, holding the posting host until its peers come (nccl_connections.h), unless it
//   was connected ahead (`connect`; or, for those of all ranks, when the group was made with a device).
// - The stream current when a group is posted: its communicator's stream waits for it (c10d), so the
//   group launches once what the communication stream had waited for completed (nccl_model.h).
// - c10d's count of open NCCL groups, which is per thread: a group's end that fails (on a communicator
//   aborted inside it, which ncclCommAbort freed) leaves it raised, and an operation posted alone on that
//   thread afterwards would join a group that never ends: refused.
// - Copies to the host are made when the host waits for the marker after them, once the transfers
//   before them completed.
// - A receive dropped unread (an aborted step) is waited for when the next step begins (gloo writes
//   into its buffer until its Work completes); a receive never released is a violation.
// - A device-wide synchronisation (cudaDeviceSynchronize; cudaFree, which the caching allocator calls
//   when it is off, on an out-of-memory retry and in empty_cache): model_device_synchronize holds the
//   host until every stream of the device completed what it queued (every model of that device in the
//   process: a model left by an earlier Pipeline counts, as on a GPU), and reports the hang it would be
//   when that waits for a peer that waits for this host.
// Selected only by tests (Executor._emulate_device_comm, and _C.NcclModel: nccl_model_harness.cpp).
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "../comm.h"
#include "../deadline.h"
#include "../device_comm.h"
#include "../device_ops.h"
#include "../diagnostics.h"
#include "../errors.h"
#include "../message_status.h"
#include "nccl_connections.h"
#include "nccl_model.h"
#include "stream_ledger.h"

namespace pipecore {
namespace {

// A point on a lane: the ledger's clock, and on the communication stream the groups it waited for
// until then and the copies to the host queued on it since the last marker.
struct CpuMarker final : StreamMarker {
  std::shared_ptr<StreamMarker> clock;
  std::vector<c10::intrusive_ptr<c10d::Work>> groups;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (host, bytes)
};

// A thread's current device and compute stream (the ledger's lane), as CUDA keeps them per thread.
thread_local int current_device = 0;
thread_local int current_stream = 0;
thread_local int open_nccl_groups = 0;  // c10d's ncclActiveGroupCounter_ (thread_local there too)
thread_local int comm_stream_current = 0;  // the communication stream is current (on_comm_stream)
thread_local int refuse_post_in = -1;      // make_model_refuse_post's count of posts left before the refusal

// Makes `value` current in `slot` while the returned object lives.
std::shared_ptr<void> make_current(int& slot, int value) {
  auto before = std::make_shared<int>(slot);
  slot = value;
  return std::shared_ptr<void>(before.get(), [before, &slot](void*) { slot = *before; });
}

class CpuModelOps;

// The models alive in this process (model_device_synchronize).
std::mutex live_mu;
std::vector<CpuModelOps*> live_models;

class CpuModelOps final : public DeviceOps {
 public:
  // `timeout`: the executor's, which outlives this
  // `all_ranks_connected`: as a group made with a device id (its communicators of all ranks connect then)
  // `eager_bytes`: make_comm_stream's
  CpuModelOps(const std::chrono::milliseconds& timeout, int device_index, bool all_ranks_connected,
              int64_t eager_bytes)
      : timeout_(timeout), device_(device_index), all_ranks_connected_(all_ranks_connected), eager_bytes_(eager_bytes) {
    std::lock_guard<std::mutex> lock(live_mu);
    live_models.push_back(this);
  }
  ~CpuModelOps() override {
    std::lock_guard<std::mutex> lock(live_mu);
    live_models.erase(std::find(live_models.begin(), live_models.end(), this));
  }

  int device() const { return device_; }
  // Holds the host until every stream of the device completed what it queued (`why`: the call that
  // synchronises, for the report): the compute stream is the host; the communication stream's groups,
  // and those of each communicator's stream (its pairs' too).
  void synchronize(const std::string& why) {
    std::vector<c10::intrusive_ptr<c10d::Work>> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending = comm_waited();
      for (const auto& entry : streams_) {
        if (auto last = entry.second->last()) pending.push_back(std::move(last));
      }
    }
    const auto deadline = deadline_after(timeout_);
    for (const auto& work : pending) {
      const std::string stuck = wait_ended(*work, std::max(time_left(deadline), std::chrono::milliseconds(1)));
      if (!stuck.empty()) {
        throw CommError("pipecore (model of CUDA): " + why + " on device " + std::to_string(device_) +
                        " holds the host until every stream of the device completed its work, and " +
                        work_name(*work) + " did not complete within " + std::to_string(timeout_.count()) +
                        " ms (" + stuck + "): if its peer waits for what this host posts next, this would hang");
      }
    }
  }

  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  int make_device_current() override { return std::exchange(current_device, device_); }
  void restore_device(int before) override { current_device = before; }
  ComputeStream compute_stream() const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CPU), current_stream);
  }

  // -- streams: the ledger's order, and what the host waits for in place of a compute stream
  std::shared_ptr<StreamMarker> record(Lane lane, const ComputeStream& compute) override {
    auto marker = std::make_shared<CpuMarker>();
    marker->clock = ledger_->record(lane_of(lane, compute));
    if (lane == Lane::kComm) {
      std::lock_guard<std::mutex> lock(mu_);
      marker->groups = comm_waited();
      marker->copies.swap(copies_);
    }
    return marker;
  }
  void wait(Lane lane, const StreamMarker& marker, const ComputeStream& compute) override {
    const auto& cpu = static_cast<const CpuMarker&>(marker);
    if (lane == Lane::kOwner && !cpu.owner) {
      ledger_->note_violation("a wait on the posting stream of a marker that kept none (StreamMarker::owner)");
      throw std::logic_error("pipecore (model of CUDA): a wait on the posting stream of a marker without one");
    }
    ledger_->wait(lane == Lane::kOwner ? lane_of(Lane::kCompute, *cpu.owner) : lane_of(lane, compute), *cpu.clock);
    if (lane == Lane::kCompute) {
      std::string why;
      if (!arrived(cpu, timeout_, why)) throw CommError(why);  // the executor says which message
    } else if (lane == Lane::kOwner) {
      std::lock_guard<std::mutex> lock(mu_);  // (waited for when the next step begins)
      dropped_.insert(dropped_.end(), cpu.groups.begin(), cpu.groups.end());
    }
  }
  void allocated(const at::Tensor& t, const ComputeStream& compute) override {
    ledger_->allocated(t, lane_of(Lane::kCompute, compute));
  }
  void used(const at::Tensor& t, Lane lane, const ComputeStream& compute, bool writes, const CommTask& task) override {
    ledger_->used(t, lane_of(lane, compute), writes, message_name(task));
  }
  void freed(const at::Tensor& t, const CommTask& task) override {
    --unreleased_;
    ledger_->freed(t, message_name(task));
  }
  std::vector<std::string> violations() const override { return ledger_->violations(); }

  // -- the step status
  void begin_step(const ComputeStream& /*on*/) override {
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
        throw CommError(not_within("pipecore: messages of the previous (aborted) step did not arrive", timeout_,
                                   "a peer stopped sending"));
      }
    }
    status_ = kMessageOk;
  }
  void fold_trailer(const at::Tensor& trailer, const ComputeStream& /*on*/) override {
    check_device("the trailer-folding kernel");
    check_trailer(trailer);
    int64_t words[2];
    std::memcpy(words, trailer.const_data_ptr(), sizeof(words));
    fold(trailer_code(words[0], words[1]));
  }
  void write_trailer(at::Tensor& trailer, const ComputeStream& /*on*/) override {
    check_device("the trailer-writing kernel");
    check_trailer(trailer);
    const int64_t words[2] = {trailer_status(status_.load()), kTrailerMagic};
    std::memcpy(trailer.data_ptr(), words, sizeof(words));
  }
  void fill_seed(at::Tensor& seed, double value, const ComputeStream& /*on*/) override {
    check_device("the loss seed's kernel");
    seed.fill_(status_.load() == kMessageOk ? value : 0.0);
  }
  std::shared_ptr<StreamMarker> status_to_host(const ComputeStream& on) override { return record(Lane::kCompute, on); }
  int64_t status_on_host() override { return status_.load(); }

  // -- the communicator
  std::shared_ptr<void> on_comm_stream() override {  // (its device too, as CUDA's)
    auto device = make_current(current_device, device_);
    auto stream = make_current(comm_stream_current, 1);
    return std::shared_ptr<void>(stream.get(), [device, stream](void*) {});
  }
  void start_group(c10d::Backend&) override {
    group_.clear();
    ++open_nccl_groups;
  }
  void post(c10d::Backend& backend, CommTask& task) override {
    check_not_aborted(backend);
    if (refuse_post_in-- == 0) {  // (a test's: c10d refuses it before NCCL sees it, e.g. out of memory)
      throw std::runtime_error("pipecore (model of c10d): out of memory while posting " + message_name(task));
    }
    try {
      check_nccl_op(task);  // (inside the group: NCCL refuses it there, after what was added before)
    } catch (...) {
      group_failed_ = true;  // NCCL keeps the error for the group's end
      throw;
    }
    group_.push_back(&task);
  }
  c10::intrusive_ptr<c10d::Work> end_group(c10d::Backend& backend) override {
    std::vector<CommTask*> group;
    group.swap(group_);
    if (std::exchange(group_failed_, false)) {  // (ncclGroupEnd returns the group's error; c10d's count stays raised)
      throw std::runtime_error("pipecore (model of NCCL): ncclGroupEnd returns the error NCCL kept for an operation "
                               "of the group it refused, launching nothing, and c10d still counts the group open on "
                               "this thread");
    }
    if (!group.empty() && aborted_.count(&backend) != 0) {  // (ncclGroupEnd fails; c10d's count stays raised)
      throw std::runtime_error("pipecore (model of NCCL): ncclGroupEnd on a communicator that was aborted inside the "
                               "group (ncclCommAbort freed it): the group fails, and c10d still counts it open on "
                               "this thread");
    }
    --open_nccl_groups;
    return launch(backend, /*pair=*/-1, group, "the group");
  }
  c10::intrusive_ptr<c10d::Work> post_alone(c10d::Backend& backend, CommTask& task) override {
    check_not_aborted(backend);
    check_nccl_op(task);
    TORCH_CHECK(open_nccl_groups == 0, "pipecore (model of NCCL): ", message_name(task), " is posted alone while c10d "
                "counts ", open_nccl_groups, " NCCL group(s) open on this thread (an earlier group's end failed): it "
                "joins a group that never ends, and never launches (this would hang)");
    return launch(backend, task.peer, {&task}, "the follow-up");  // (on the stream of its pair's communicator)
  }
  // Ends every pending operation of `backend`'s communicators (its pairs' too); nothing more is posted on it.
  void abort(c10d::Backend& backend) override {
    aborted_.insert(&backend);
    for (auto& [key, stream] : streams_) {
      if (key.first == &backend) stream->abort(kAbortedText);
    }
  }
  void comm_waits(c10d::Work& group) override {
    std::lock_guard<std::mutex> lock(mu_);
    comm_groups_.emplace_back(c10::intrusive_ptr<c10d::Work>::reclaim_copy(&group));
  }
  void connect(c10d::Backend& backend, const std::vector<int>& peers, const ComputeStream& /*on*/) override {
    const char* what = "connection ahead of the first step";
    if (!all_ranks_connected_) connect_communicator(backend, -1, what, timeout_, /*ahead=*/true, connections_);
    connect_peers(backend, peers, what, timeout_, /*ahead=*/true, connections_);
  }
  void connect_pair(c10d::Backend& backend, int pair, const ComputeStream& /*on*/) override {
    connect_communicator(backend, pair, "connection ahead of the first step", timeout_, /*ahead=*/true, connections_);
  }
  ConnectionCounts connection_counts() const override { return connections_; }

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
  bool host_ready(const StreamMarker& marker) override {
    const auto& cpu = static_cast<const CpuMarker&>(marker);
    for (const auto& group : cpu.groups) {
      if (!group->isCompleted()) return false;  // (a group progresses by itself: nccl_model.h)
    }
    for (const auto& [host, bytes] : cpu.copies) host.copy_(bytes);
    return true;
  }

 private:
  // Queues `tasks` (copies: the executor keeps its own) on the stream of `backend`'s communicator of
  // all ranks (pair -1), or of its communicator of this rank and `pair`.
  c10::intrusive_ptr<c10d::Work> launch(c10d::Backend& backend, int pair, const std::vector<CommTask*>& tasks,
                                        const char* kind) {
    if (!tasks.empty()) {
      const std::string what = std::string(kind) + "'s " + message_name(*tasks[0]).substr(4);
      if (pair >= 0 || !all_ranks_connected_) connect_communicator(backend, pair, what, timeout_, false, connections_);
      std::vector<int> peers;
      for (const CommTask* task : tasks) peers.push_back(task->peer);
      if (pair < 0) connect_peers(backend, peers, what, timeout_, false, connections_);
    }
    for (CommTask* task : tasks) {
      if (!task->send) unreleased_ += static_cast<int64_t>(task->parts.size());
    }
    // c10d makes the communicator's stream wait for the stream current at posting: the communication
    // stream's, which waited for every receive group since the step began (comm_waits)
    std::vector<c10::intrusive_ptr<c10d::Work>> after;
    CommStream* stream = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);  // (a device-wide synchronisation reads streams_ from another thread)
      if (comm_stream_current) after = comm_waited();
      auto& made = streams_[{&backend, pair}];
      if (!made) made = make_comm_stream(eager_bytes_);
      stream = made.get();
    }
    return stream->queue(kind, tasks, std::move(after));
  }

  // The groups the communication stream waited for this step that are still held (mu_ held).
  std::vector<c10::intrusive_ptr<c10d::Work>> comm_waited() const {
    std::vector<c10::intrusive_ptr<c10d::Work>> live;
    for (const auto& group : comm_groups_) {
      if (auto held = group.lock()) live.push_back(std::move(held));
    }
    return live;
  }

  static constexpr const char* kAbortedText =
      "pipecore (model of NCCL): the communicator was aborted (ncclCommAbort ends every pending operation)";

  // The ledger's lane: the communication stream's, or the compute stream's (its id).
  static int lane_of(Lane lane, const ComputeStream& compute) {
    return lane == Lane::kComm ? static_cast<int>(Lane::kComm) : static_cast<int>(compute.id());
  }

  // As the CUDA kernels' `words` (cuda/status_kernels.cu) checks a trailer, on the host.
  static void check_trailer(const at::Tensor& trailer) {
    TORCH_CHECK(trailer.is_cpu() && trailer.is_contiguous() && trailer.nbytes() >= 16,
                "pipecore: a trailer is 16 contiguous host bytes");
  }

  // A kernel of ours launches on the current device (CUDA's <<<>>>), not on its tensors'.
  void check_device(const char* what) {
    if (current_device == device_) return;
    const std::string text = std::string(what) + " launched with device " + std::to_string(current_device) +
                             " current, for device " + std::to_string(device_) + "'s tensors (no device guard: a " +
                             "GPU runs it on the other device's stream, or faults)";
    ledger_->note_violation(text);
    throw std::logic_error("pipecore (model of CUDA): " + text);
  }

  void check_not_aborted(const c10d::Backend& backend) const {
    TORCH_CHECK(aborted_.count(&backend) == 0, kAbortedText, ": nothing more can be posted on it");
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
  const int device_;                                     // the device it models
  std::unordered_set<const c10d::Backend*> aborted_;    // communicators aborted (nothing more is posted)
  std::shared_ptr<StreamLedger> ledger_ = std::make_shared<StreamLedger>();
  std::atomic<int64_t> status_{kMessageOk};
  std::atomic<int64_t> unreleased_{0};  // receive buffers posted and not released yet
  std::vector<CommTask*> group_;        // the open group's operations (posted when it ends)
  bool group_failed_ = false;           // NCCL refused an operation of the open group
  const bool all_ranks_connected_;      // its groups' communicators of all ranks connected when they were made
  const int64_t eager_bytes_;           // sends of at most this many bytes complete before their receiver posts
  ConnectionCounts connections_;        // those this executor connected (DeviceOps::connection_counts)
  std::mutex mu_;
  // what the communication stream waited for this step: a group whose receives were let go of is
  // not waited for again (consumed: waited for; dropped: in dropped_), and its buffers go with it
  std::vector<c10::weak_intrusive_ptr<c10d::Work>> comm_groups_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;     // copies to the host since its last marker
  std::vector<c10::intrusive_ptr<c10d::Work>> dropped_;      // receives let go of unread: waited for at begin_step
  std::map<std::pair<const c10d::Backend*, int>, std::unique_ptr<CommStream>> streams_;  // per communicator
};

}  // namespace

std::unique_ptr<DeviceOps> make_cpu_model_ops(const std::chrono::milliseconds& timeout, int device_index,
                                              bool all_ranks_connected, int64_t eager_bytes) {
  return std::make_unique<CpuModelOps>(timeout, device_index, all_ranks_connected, eager_bytes);
}

void model_device_synchronize(const std::string& why, int device) {
  std::lock_guard<std::mutex> lock(live_mu);  // (a model goes with its executor, not inside a step)
  for (CpuModelOps* model : live_models) {
    if (model->device() == device) model->synchronize(why);
  }
}

void make_model_refuse_post(int index) { refuse_post_in = index; }

std::shared_ptr<void> make_model_stream_current(bool second) {
  return make_current(current_stream, second ? StreamLedger::kSideLane : 0);
}

}  // namespace pipecore
