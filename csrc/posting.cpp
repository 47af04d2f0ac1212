// The one posting path of every message, host and device alike (as DualPipe's _commit_and_wait_comm
// owns post, wait and free): each message is addressed here, posted (on the device path as one group,
// on the host from the comm worker or this thread), counted, and a send handed to the send tracker,
// which frees it once it completed.
#include <thread>

#include "comm.h"
#include "comm_worker.h"
#include "device_comm.h"
#include "diagnostics.h"
#include "executor.h"
#include "send_tracker.h"

namespace pipecore {

void Executor::post(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions, int tag,
                    bool here_if_idle, const std::vector<Inbox*>& inboxes, c10d::Backend* channel) {
  for (size_t k = 0; k < tasks.size(); ++k) {
    CommTask& task = *tasks[k];
    const Instr& in = program_[actions[k]];
    task.peer = static_cast<int>(in.peer);
    task.tag = tag;
    task.group = pg_.get();
    task.channel = channel;
    // travels to a lower rank (the host path: a device batch is one group, on the group)
    if (!channel && reverse_ && !device_comm_ && (task.send ? in.peer < rank_ : in.peer > rank_)) {
      task.channel = reverse_.get();
      if constexpr (kTesting) ++counts_.reverse_posts;
    }
  }
  const bool follow_up_receive = tag != 0 && !tasks.front()->send;
  if (!follow_up_receive) maybe_delay();  // (posted under settle_mu_: the other half would wait out the delay)
  if (device_comm_) {
    std::shared_ptr<StreamMarker> ready;
    try {
      if (!channel && !group_backend_) group_backend_ = pg_->getBackend(device_comm_->device_type());
      ready = device_comm_->post_batch(channel ? *channel : *group_backend_, tasks, /*grouped=*/channel == nullptr);
    } catch (const std::exception& e) {
      throw post_failure(*tasks.front(), program_[actions.front()], e.what());
    }
    for (Inbox* inbox : inboxes) {
      if (inbox) inbox->ready = ready;  // at once: letting go of a receive needs it (stream_contract.h, rule 3)
    }
  } else {
    for (size_t k = 0; k < tasks.size(); ++k) {
      const std::shared_ptr<CommTask>& task = tasks[k];
      bool here = !worker_;
      try {
        if (!worker_) {
          post_parts(*task);
        } else if (here_if_idle) {
          here = worker_->post_if_idle(*task);
          counts_.posted_here += here;
        }
      } catch (const std::exception& e) {
        throw post_failure(*task, program_[actions[k]], e.what());
      }
      if (here) {
        task->mark_posted(nullptr);
      } else {
        task->queued = true;
        worker_->queue(task);
        ++counts_.threaded_posts;
      }
    }
  }
  for (size_t k = 0; k < tasks.size(); ++k) {
    if (!tasks[k]->send) continue;
    const Instr& in = program_[actions[k]];
    if (tag == 0) {
      ++counts_.sent_messages;
      ++counts_.sent_to[static_cast<int>(in.peer)];  // (a grown message's follow-up tag)
    } else {
      ++counts_.grown_messages;
    }
    counts_.sent_parts += static_cast<int64_t>(tasks[k]->parts.size());
    last_send_posted_ = static_cast<int64_t>(actions[k]);
    const int64_t bytes = message_bytes(tasks[k]->parts);
    sends_->track(tasks[k], bytes, where(in) + ": send to rank " + std::to_string(in.peer), timeout_,
                  /*aside=*/tag != 0);
  }
}

CommError Executor::post_failure(const CommTask& task, const Instr& in, const std::string& text) const {
  return CommError(where(in) + ": " + (task.send ? "sending to" : "receiving from") + " rank " +
                   std::to_string(task.peer) + " failed: " + text);
}

void Executor::await_posted(CommTask& task, const Instr& in) {
  if (!task.wait_posted(timeout_)) throw CommError(not_posted(where(in), task.send, task.peer, timeout_));
  if (task.error) throw post_failure(task, in, error_text(task.error));
}

#ifdef PIPECORE_TESTING
void Executor::maybe_delay() {
  if (delay_us_ <= 0) return;
  std::uniform_int_distribution<int64_t> dist(0, delay_us_);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
}
#endif

}  // namespace pipecore
