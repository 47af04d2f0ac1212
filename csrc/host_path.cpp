// The host path (gloo; message_path.h): receives posted up to a window ahead (recv_window.h), sends held to
// a budget of bytes in flight per peer and posted from the comm worker (comm_worker.h) or, small ones
// before a wait, this thread; messages to lower ranks on the reverse channel; the host waits for each
// message it reads; a grown shaped message follows on a tag of its own (comm.h).
#include <c10/util/Exception.h>

#include "comm_task.h"
#include "comm_worker.h"
#include "diagnostics.h"
#include "message_path.h"
#include "message_status.h"
#include "send_tracker.h"

namespace pipecore {
namespace {

class HostPath final : public MessagePath {
 public:
  HostPath(PathContext context, MessageFormat format, PathSettings settings)
      : MessagePath(context, std::move(format), std::move(settings)) {
    format_.exact = false;
    apply_settings();
  }

  void apply_settings() override {
    window_.configure(settings_.window_receives, settings_.window_past_sends, settings_.window_bytes);
    if (!settings_.comm_thread) {
      worker_.reset();
    } else if (!worker_) {
      worker_ = std::make_unique<CommWorker>();
    }
  }

  void join_threads() override {
    worker_.reset();
    MessagePath::join_threads();
  }

  void reset(size_t recv_count) override {
    MessagePath::reset(recv_count);
    window_.reset(recv_count);
    last_send_posted_ = -1;
  }

  void before(size_t at) override {
    if (ctx_.owner.discovering()) return;  // each receive at its own action (its shapes may not be known before)
    auto bytes_of = [this](size_t k) { return payload_bytes(ctx_.specs.received(program_[program_.recv_instrs[k]])); };
    post_recvs_until(window_.post_through(program_, at, bytes_of), at);
  }

  void post(size_t index, const RunMode& mode) override {
    // a receive is usually posted ahead already (the receive window); an aborted step must post it
    if (is_recv(program_[index].op)) return post_recvs_until(program_.recvs_through[index], index, mode.aborted);
    send_action(index, mode);
  }

  void let_go(Inbox& inbox) override { inbox = Inbox(); }

 private:
  bool host_reads() const override { return true; }

  // Posts receives up to ordinal `end` before program[at] (aborted: into the scratch).
  void post_recvs_until(size_t end, size_t at, bool aborted = false) {
    if (window_.posted() >= end) return;
    SpentOn spent(ctx_.profile, Spent::kPost);
    while (window_.posted() < end) {
      const size_t k = window_.posted();
      const size_t index = program_.recv_instrs[k];
      const Instr& in = program_[index];
      // a failed allocation leaves the receive unposted (an aborted step posts it); once posting
      // starts it counts as posted: a posting failure breaks the group, and parts must not go twice
      std::shared_ptr<CommTask> task = make_recv(in, aborted);
      record_posted_at(k, at);
      window_.mark_posted(k);
      if (!task) continue;
      task->action = static_cast<int64_t>(index);
      post_tasks({task}, {index});
    }
  }

  // SEND_F / SEND_B: its message (and a grown message's follow-up) posted.
  void send_action(size_t index, const RunMode& mode) {
    const Instr& in = program_[index];
    if (mode.aborted) {
      if (static_cast<int64_t>(index) == last_send_posted_) return;  // the failure came after its send
      std::vector<at::Tensor> parts = message_of(in, /*aborted=*/true, mode.status);
      if (!parts.empty()) send(std::move(parts), index, /*budgeted=*/mode.wait, /*aborted=*/true);
      return;
    }
    SpentOn spent(ctx_.profile, Spent::kPost);
    std::vector<at::Tensor> follow_up;
    std::vector<TensorSpec> crossing;
    int64_t key = 0;
    std::vector<at::Tensor> parts = message_of(in, /*aborted=*/false, 0, &follow_up, &crossing, &key);
    if (!parts.empty()) send(std::move(parts), index, /*budgeted=*/true, /*aborted=*/false);
    if (!follow_up.empty()) {
      // outside the peer's budget: it completes when the receiver reads the message, which later sends
      // must not wait for
      send(std::move(follow_up), index, /*budgeted=*/false, /*aborted=*/false, follow_up_tag(key));
    }
    // posted: the receiver reads it, in this run or its aborted rest, and records it alike
    if (!crossing.empty()) ctx_.specs.crossed_out(in.stage, std::move(crossing));
  }

  // Posts a message within the peer's send budget (unless `budgeted` is off); the send tracker frees it
  // once sent. `tag` 0: a message of the program; else a grown message's follow-up.
  void send(std::vector<at::Tensor> parts, size_t index, bool budgeted, bool aborted, int tag = 0) {
    const Instr& in = program_[index];
    const int64_t bytes = message_bytes(parts);
    if (budgeted) {
      SpentOn spent(ctx_.profile, Spent::kWait);
      const WaitingOn waiting(ctx_.flight, in.peer, in.mb, "room in its send budget", /*send=*/true);
      if (!sends_->reserve(static_cast<int>(in.peer), bytes, settings_.send_budget, ctx_.timeout)) {
        throw CommError(not_within(where(in) + ": earlier sends to rank " + std::to_string(in.peer) +
                                       " did not complete",
                                   ctx_.timeout, "the peer stopped receiving"));
      }
    }
    // an aborted step still releases every peer it can; once a grown message's header went, its
    // follow-up goes too (its receiver waits for it)
    if (!aborted && tag == 0) check_sends();
    auto task = std::make_shared<CommTask>();
    task->parts = std::move(parts);
    // the thread waits for a message next anyway: posting here spares the message the worker's wake-up
    post_tasks({task}, {index}, tag, tag == 0 && program_.waits_next[index] && bytes <= kPostHereBytes);
  }

  void submit(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions,
              bool here_if_idle, const std::vector<Inbox*>& /*inboxes*/, c10d::Backend* channel,
              const ComputeStream* /*on*/) override {
    for (size_t k = 0; k < tasks.size(); ++k) {
      const std::shared_ptr<CommTask>& task = tasks[k];
      const int64_t peer = task->peer;
      // travels to a lower rank
      if (!channel && settings_.reverse && (task->send ? peer < ctx_.rank : peer > ctx_.rank)) {
        task->channel = settings_.reverse.get();
#ifdef PIPECORE_TESTING
        ++counts_.reverse_posts;
#endif
      }
      bool here = !worker_;
      try {
        if (!worker_) {
          post_parts(*task);
        } else if (here_if_idle) {
          here = worker_->post_if_idle(*task);
#ifdef PIPECORE_TESTING
          counts_.posted_here += here;
#endif
        }
      } catch (const std::exception& e) {
        throw post_failure(*task, program_[actions[k]], error_text(e));
      }
      if (here) {
        task->mark_posted(nullptr);
      } else {
        task->queued = true;
        worker_->queue(task);
#ifdef PIPECORE_TESTING
        ++counts_.threaded_posts;
#endif
      }
      if (task->send) last_send_posted_ = static_cast<int64_t>(actions[k]);
    }
  }

  void read_in_order(CommTask& task, const Instr& consumer, bool draining) override {
    read_header(task, consumer, draining);
  }

  int64_t read_status(CommTask& task, const Instr& consumer, const char* what, ShapedHeader& header) override {
    wait_task(task, consumer, what);
    return read_shaped(task.parts, task.layout, format_.large_message_bytes, /*exact=*/false, header);
  }

  // Received on its key's tag at its own size, its header checked against the first one's shapes.
  std::vector<at::Tensor> follow_up(CommTask& task, const std::vector<TensorSpec>& layout, const Instr& consumer,
                                    const char* what, int64_t key, bool draining, bool& same) override {
    const Instr& in = program_[task.action];
    auto again = std::make_shared<CommTask>();
    again->send = false;
    again->layout = layout;
    const at::TensorOptions& options = ctx_.specs.options(in);
    // dropped unread: as an aborted step's receives, its data into the scratch, so that a rank out of
    // memory still releases its peer
    const at::Tensor dropped = draining ? scratch(options, payload_bytes(layout), /*for_sends=*/false) : at::Tensor();
    again->parts = alloc_shaped(layout, options, format_.large_message_bytes, dropped);
    {
      std::lock_guard<std::mutex> lock(settle_mu_);  // (the halves of an OVERLAP_F_B pair settle at once)
      post_tasks({again}, {static_cast<size_t>(task.action)}, follow_up_tag(key));
    }
    wait_task(*again, consumer, what);
    ShapedHeader second;
    same = same || (read_shaped(again->parts, layout, format_.large_message_bytes, /*exact=*/false, second) ==
                        kMessageOk &&
                    second.shapes == task.shapes);
    return std::move(again->parts);
  }

  RecvWindow window_;
  int64_t last_send_posted_ = -1;  // program index of the latest SEND that posted its message
  // after the send tracker (base; the comm worker marks the tasks it drops as posted, waking their waiters)
  std::unique_ptr<CommWorker> worker_;
};

}  // namespace

std::unique_ptr<MessagePath> make_host_path(PathContext context, MessageFormat format, PathSettings settings) {
  return std::make_unique<HostPath>(context, std::move(format), std::move(settings));
}

}  // namespace pipecore
