// The model of NCCL's communicators (nccl_model.h).
#include "nccl_model.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "../comm.h"
#include "../deadline.h"
#include "nccl_group_work.h"
#include "nccl_notes.h"

namespace pipecore {

// As NCCL refuses a point-to-point operation on a dtype it lacks (ncclDataType_t, which c10d's
// ProcessGroupNCCL maps to: no int16, no complex, no uint16/32/64), or to a rank it does not have.
void check_nccl_op(const CommTask& task) {
  static const std::unordered_set<at::ScalarType> nccl = {
      at::kChar, at::kByte, at::kBool, at::kInt, at::kLong, at::kHalf, at::kFloat, at::kDouble, at::kBFloat16,
      at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  for (const auto& part : wire_parts(task)) {
    TORCH_CHECK(nccl.count(part.scalar_type()) != 0, "pipecore (model of NCCL): a ",
                task.send ? "send" : "receive", " of ", part.scalar_type(), ", which NCCL does not support");
  }
  const int ranks = task.channel ? task.channel->getSize() : task.group->getSize();
  TORCH_CHECK(task.peer >= 0 && task.peer < ranks, "pipecore (model of NCCL): a ", task.send ? "send to" : "receive from",
              " rank ", task.peer, ", which a communicator of ", ranks, " ranks does not have (NCCL: invalid argument)");
}

namespace {

using nccl_model::GroupWork;
using nccl_model::kWaitForever;
using nccl_model::PostedOp;

// A receive waiting for its sender's note.
struct PendingReceive {
  c10::intrusive_ptr<GroupWork> group;
  size_t slot = 0;  // its operation in the group
  std::shared_ptr<CommTask> op;
  c10::intrusive_ptr<c10d::Work> note_work;
  at::Tensor note;
};

// The receives from one peer on one communicator, in posting order (NCCL's pair order), each posted
// once its sender's note arrived and matched (gloo kills the process on a receive smaller than its
// send), while receives from other peers go on: a group's operations with each peer progress on their
// own, as NCCL's do. After a receive that did not match, every later one from that peer fails (on NCCL
// that pair would never move again).
class PairReceiver {
 public:
  PairReceiver() : thread_([this] { loop(); }) {}
  ~PairReceiver() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (current_) current_->abort();
    }
    added_.notify_all();
    thread_.join();
    for (auto& receive : queue_) receive.group->fill(receive.slot, {}, "pipecore (model of NCCL): the executor went first");
  }
  void add(PendingReceive receive) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(receive));
    }
    added_.notify_all();
  }

 private:
  void loop() {
    for (;;) {
      PendingReceive next;
      {
        std::unique_lock<std::mutex> lock(mu_);
        added_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        next = std::move(queue_.front());
        queue_.pop_front();
        current_ = next.note_work;
      }
      std::string why = failed_;
      try {
        if (why.empty() && next.group->aborted()) why = "aborted";
        // no timeout: its consumers' waits have theirs (a gloo wait that times out closes every pair)
        if (why.empty() && !next.note_work->wait(kWaitForever)) why = "aborted";
        if (why.empty()) {
          check_note(*next.op, next.note);
          post_parts(*next.op);
        }
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (failed_.empty() && !why.empty()) {
        failed_ = "pipecore (model of NCCL): an earlier receive from rank " + std::to_string(next.op->peer) +
                  " did not complete (" + why + ")";
      }
      next.group->fill(next.slot, why.empty() ? next.op->works : std::vector<c10::intrusive_ptr<c10d::Work>>{}, why);
      std::lock_guard<std::mutex> lock(mu_);
      current_.reset();
    }
  }

  std::mutex mu_;
  std::condition_variable added_;
  std::deque<PendingReceive> queue_;
  c10::intrusive_ptr<c10d::Work> current_;  // the note it waits for (aborted to stop it)
  std::string failed_;                      // why an earlier receive failed
  bool stop_ = false;
  std::thread thread_;
};

// Posts `op`: its note to its peer and the receive of the peer's; a send's parts at once, checked against
// the receiver's note once both completed (appended to `checks` and `plain`), a receive's parts once
// its sender's note matched (`receives`, for a PairReceiver).
void post_with_notes(const std::shared_ptr<CommTask>& op, std::vector<PostedOp>& checks, std::vector<PostedOp>& plain,
                     std::vector<PendingReceive>& receives, int64_t eager_bytes) {
  // NCCL's eager protocol: the data goes to the receiver's buffers and the send completes without it,
  // so the sender may reuse its buffer at once: the model sends a copy, and its receiver checks the notes
  const bool eager = op->send && message_bytes(op->parts) <= eager_bytes;
  if (eager) {
    for (auto& part : op->parts) part = part.clone();
  }
  std::vector<at::Tensor> mine{note_of(*op)};
  std::vector<at::Tensor> theirs{at::empty({kNoteWords}, at::kLong)};
  const int my_tag = op->send ? kSendNoteTag : kReceiveNoteTag;
  const int their_tag = op->send ? kReceiveNoteTag : kSendNoteTag;
  c10::intrusive_ptr<c10d::Work> note_work;
  auto exchange = [&](auto& on) {
    plain.push_back({{on.send(mine, op->peer, my_tag)}});
    note_work = on.recv(theirs, op->peer, their_tag);
  };
  if (op->channel) {
    exchange(*op->channel);
  } else {
    exchange(*op->group);
  }
  if (!op->send) {
    receives.push_back({nullptr, 0, op, note_work, theirs[0]});
    return;
  }
  post_parts(*op);
  if (eager) {
    plain.back().works.push_back(note_work);  // (held with the group, not waited for)
    plain.back().works.insert(plain.back().works.end(), op->works.begin(), op->works.end());
    plain.back().eager = true;
    return;
  }
  checks.push_back({{note_work}, [op, note = theirs[0]] { check_note(*op, note); }});
  plain.push_back({op->works});
}

// As NCCL refuses at a group's end (ncclInvalidUsage, "Trying to send to self without a matching recv"):
// a send to the rank itself whose receive is not in the same group, or a receive from itself without
// its send.
void check_sends_to_self(const char* kind, const std::vector<CommTask*>& tasks) {
  int sends = 0;
  int receives = 0;
  for (const CommTask* task : tasks) {
    if (task->peer == rank_of(*task)) ++(task->send ? sends : receives);
  }
  TORCH_CHECK(sends == receives, "pipecore (model of NCCL): ", kind, " holds ", sends, " send(s) to rank ",
              rank_of(*tasks.front()), " itself and ", receives, " receive(s) from it; NCCL refuses a send to self "
              "without its receive in the same group (invalid usage)");
}

// One communicator's stream: its groups launch one after another, each once the group before it
// completed, as NCCL's kernels do on the communicator's stream. A thread of its own posts them (the
// host never waits for a launch).
class GroupStream final : public CommStream {
 public:
  explicit GroupStream(int64_t eager_bytes) : eager_bytes_(eager_bytes), thread_([this] { loop(); }) {}
  ~GroupStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (running_) running_->abort();  // (a wait of gloo's ends only so)
    }
    queued_.notify_all();
    thread_.join();
    for (auto& queued : queue_) queued.group->launch({}, "pipecore (model of NCCL): the executor went first");
  }
  c10::intrusive_ptr<c10d::Work> queue(const char* kind, const std::vector<CommTask*>& tasks,
                                       std::vector<c10::intrusive_ptr<c10d::Work>> after) override {
    check_sends_to_self(kind, tasks);
    std::vector<std::shared_ptr<CommTask>> ops;
    std::ostringstream what;
    what << kind << ":";
    for (CommTask* task : tasks) {
      auto op = std::make_shared<CommTask>();  // (a copy of what the launch reads: the executor keeps its own)
      op->send = task->send;
      op->parts = task->parts;
      op->peer = task->peer;
      op->tag = task->tag;
      op->group = task->group;
      op->channel = task->channel;
      op->action = task->action;
      ops.push_back(std::move(op));
      what << (ops.size() > 1 ? ", a " : " a ") << describe(task->send, task->peer, part_bytes(*task), task->action);
    }
    auto group = c10::make_intrusive<GroupWork>(what.str());
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({group, std::move(ops), std::move(after)});
      last_ = c10::intrusive_ptr<c10d::Work>(group);  // (weakly: the executor's letting go frees its buffers)
    }
    queued_.notify_all();
    return group;
  }
  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = why;
      for (auto& group : unfinished_) group->abort_with(why);
    }
    queued_.notify_all();
  }
  c10::intrusive_ptr<c10d::Work> last() override {
    std::lock_guard<std::mutex> lock(mu_);
    return last_.lock();
  }

 private:
  void loop() {
    c10::intrusive_ptr<GroupWork> before;
    for (;;) {
      Queued next;
      std::string never;
      {
        std::unique_lock<std::mutex> lock(mu_);
        queued_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        next = std::move(queue_.front());
        queue_.pop_front();
        running_ = before;
        never = aborted_;
      }
      // What must complete before it launches: the group before it on this stream, then what the posting
      // stream had waited for (another communicator's groups). No deadline: its waiters' report a hang.
      std::vector<c10::intrusive_ptr<c10d::Work>> first;
      if (before) first.push_back(before);
      first.insert(first.end(), next.after.begin(), next.after.end());
      for (const auto& work : first) {
        if (!never.empty()) break;
        const bool queued_before = work == before;
        const auto* other = dynamic_cast<const GroupWork*>(work.get());
        const std::string waited = other ? other->what() : std::string("another communicator's work");
        if (!queued_before) {
          next.group->waiting_for("the stream current when it was posted had waited for " + waited +
                                  " first, which did not complete: c10d makes a communicator's stream wait for the "
                                  "stream current at posting, so on a GPU this would hang");
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          running_ = work;
        }
        try {
          work->wait(kWaitForever);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu_);
          never = !aborted_.empty() ? aborted_
                  : queued_before
                      ? "pipecore (model of NCCL): " + next.group->what() + " never launched: " + waited +
                            ", queued before it on its communicator, did not complete (" + e.what() +
                            "); groups on one communicator run one after another, so on a GPU this would hang"
                      : "pipecore (model of NCCL): " + next.group->what() + " never launched: the stream current "
                            "when it was posted had waited for " + waited + ", which did not complete (" + e.what() +
                            ")";
        }
      }
      // the sends' checks of their receivers' notes, then the receives, then the notes and sends (so a
      // group's error names its own operations first)
      std::vector<PostedOp> ops;
      std::vector<PostedOp> plain;
      std::vector<PendingReceive> receives;
      if (never.empty()) {
        try {
          for (auto& op : next.ops) post_with_notes(op, ops, plain, receives, eager_bytes_);
        } catch (const std::exception& e) {
          never = std::string("pipecore (model of NCCL): posting ") + next.group->what() + " failed: " + e.what();
        }
      }
      for (auto& receive : receives) {
        receive.group = next.group;
        receive.slot = ops.size();
        PostedOp slot;
        slot.pending = true;
        slot.note = receive.note_work;
        ops.push_back(std::move(slot));
      }
      ops.insert(ops.end(), plain.begin(), plain.end());
      {
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
        if (stop_) {
          next.group->launch({}, "pipecore (model of NCCL): the executor went first");
          return;
        }
        next.group->launch(std::move(ops), never);
        if (!aborted_.empty() && never.empty()) next.group->abort_with(aborted_);  // (aborted while posted)
        if (never.empty()) unfinished_.push_back(next.group);
        unfinished_.erase(std::remove_if(unfinished_.begin(), unfinished_.end(),
                                         [](const auto& group) { return group->isCompleted(); }),
                          unfinished_.end());
      }
      if (never.empty()) {
        for (auto& receive : receives) {
          auto& pair = pairs_[receive.op->peer];
          if (!pair) pair = std::make_unique<PairReceiver>();
          pair->add(std::move(receive));
        }
        // it progresses by itself, as on a GPU (isCompleted then needs no wait of the host's); the next
        // group launches after it anyway. Its waiters see how it ended.
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (stop_) return;
          running_ = next.group;
        }
        try {
          next.group->wait(kWaitForever);
        } catch (const std::exception&) {
        }
        std::lock_guard<std::mutex> lock(mu_);
        running_.reset();
      }
      before = std::move(next.group);
    }
  }

  std::map<int, std::unique_ptr<PairReceiver>> pairs_;  // by peer (the loop's; gone after it)
  std::mutex mu_;
  std::condition_variable queued_;
  struct Queued {
    c10::intrusive_ptr<GroupWork> group;
    std::vector<std::shared_ptr<CommTask>> ops;
    std::vector<c10::intrusive_ptr<c10d::Work>> after;  // what the posting stream had waited for
  };
  std::deque<Queued> queue_;
  const int64_t eager_bytes_;              // sends of at most this many bytes complete without their receiver
  c10::weak_intrusive_ptr<c10d::Work> last_{c10::intrusive_ptr<c10d::Work>()};  // the group queued last
  c10::intrusive_ptr<c10d::Work> running_;  // what the thread waits for (aborted to stop it)
  std::vector<c10::intrusive_ptr<GroupWork>> unfinished_;  // launched, not known to have completed
  std::string aborted_;                    // why the communicator was aborted
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::string message_name(const CommTask& task) {
  return "the " + describe(task.send, task.peer, {message_bytes(task.parts)}, task.action);
}

std::unique_ptr<CommStream> make_comm_stream(int64_t eager_bytes) { return std::make_unique<GroupStream>(eager_bytes); }

std::string work_name(const c10d::Work& work) {
  const auto* group = dynamic_cast<const GroupWork*>(&work);
  return group ? group->what() : std::string("another communicator's work");
}

std::string wait_ended(c10d::Work& work, std::chrono::milliseconds timeout) {
  try {
    work.wait(timeout);
    return {};
  } catch (const std::exception& e) {
    auto* group = dynamic_cast<GroupWork*>(&work);
    return group && group->ended() ? std::string() : std::string(e.what());
  }
}

}  // namespace pipecore
