#include "send_tracker.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>

#include "deadline.h"
#include "diagnostics.h"
#include "helper_thread.h"

namespace pipecore {

SendTracker::~SendTracker() {
  std::unique_lock<std::mutex> lock(mu_);
  stop_ = true;
  // Only a failed step leaves sends in flight: their waits would run to their timeouts. A device message's
  // thread polls, and stops with stop_: its Work is not aborted, as on NCCL that aborts the whole
  // communicator (WorkNCCL::abort), which is the Pipeline's to do (Comm.abort_nccl).
  auto abort = [](CommTask& task) {
    if (!task.posted() || (!task.parts.empty() && !task.parts.front().is_cpu())) return;
    for (auto& work : task.works) {
      if (!work) continue;
      try {
        work->abort();
      } catch (...) {
      }
    }
  };
  for (auto& [peer, queue] : queues_) {
    for (auto& e : queue.queue) abort(*e.task);
  }
  for (auto& task : failed_sends_) abort(*task);
  lock.unlock();
  changed_.notify_all();
  for (auto& [peer, queue] : queues_) {
    if (queue.thread.joinable()) queue.thread.join();
  }
}

bool SendTracker::reserve(int peer, int64_t bytes, int64_t budget, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = queues_.find(peer);
  if (it == queues_.end()) return true;
  const PeerQueue& queue = it->second;
  auto room = [&] { return queue.in_flight == 0 || queue.in_flight + bytes <= budget || failed_; };
  if (room()) return true;
  changed_.notify_all();  // small sends in the queue may wait for their thread to wake
  return changed_.wait_for(lock, timeout, room);
}

void SendTracker::track(std::shared_ptr<CommTask> task, int64_t bytes, std::string what,
                        std::chrono::milliseconds timeout, bool aside) {
  // one part: a buffer the message was packed into (comm.h), never a tensor of the sender's
  bool wake = aside || bytes > kWakeForSendBytes || task->parts.size() != 1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int key = aside ? -2 - task->peer : task->peer;
    auto [it, fresh] = queues_.try_emplace(key);
    PeerQueue& queue = it->second;
    if (fresh) queue.thread = std::thread([this, key] {
      become_helper_thread("pipecore-sends");
      loop(key);
    });
    if (!wake) {
      queue.uncollected += bytes;
      wake = queue.uncollected > kUncollectedBytes;
    }
    if (wake) queue.uncollected = 0;
    queue.queue.push_back(Entry{std::move(task), bytes, std::move(what), timeout, deadline_after(timeout)});
    queue.in_flight += bytes;
    ++pending_;
    if (queue.in_flight > peak_) peak_ = queue.in_flight;
  }
  if (wake) changed_.notify_all();
}

namespace {
bool poll_until_completed(c10d::Work& work, std::chrono::milliseconds timeout, const std::atomic<bool>& stop) {
  const auto deadline = deadline_after(timeout);
  auto pause = std::chrono::microseconds(20);
  while (!work.isCompleted()) {
    if (stop || std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  if (auto error = work.exception()) std::rethrow_exception(error);
  return true;
}
}  // namespace

SendTracker::Failure SendTracker::wait_entry(const Entry& e) {
  try {
    return wait_posted_and_sent(e);
  } catch (const std::exception& ex) {
    return {e.what + " failed", error_text(ex)};
  } catch (...) {
    return {e.what + " failed", "unknown error"};
  }
}

SendTracker::Failure SendTracker::wait_posted_and_sent(const Entry& e) {
  CommTask& task = *e.task;
  // what is left of the send's timeout, which started at its posting (a small send is collected late);
  // at least 1 ms: c10d reads a zero timeout as "none"
  auto left = [&] { return std::max(time_left(e.deadline), std::chrono::milliseconds(1)); };
  if (!task.wait_posted(left())) return {not_within(e.what + " was not posted", e.timeout, kPostingStuck), ""};
  if (task.error) return {e.what + " failed to post", error_text(task.error)};
  std::string why, cause;  // pipecore's reason, or the backend's error
  // Device messages (NCCL): polled. Work::wait would make this thread's current stream wait for the
  // transfer, i.e. the device's default stream, where compute may run.
  const bool on_device = !task.parts.empty() && !task.parts.front().is_cpu();
  // a new thread's current device is device 0: events are queried on the message's own device
  c10::OptionalDeviceGuard device_guard;
  if (on_device) device_guard.reset_device(task.parts.front().device());
  for (const auto& work : task.works) {  // not modified while the task is in its queue
    if (!work) continue;
    try {
      if (on_device) {
        if (!poll_until_completed(*work, left(), stop_)) why = "timed out";
      } else if (!work->wait(left())) {
        why = "the wait was aborted";
      }
    } catch (const std::exception& ex) {
      cause = error_text(ex);
    }
    if (!why.empty() || !cause.empty()) {
      return {failed_waiting(e.what, e.timeout, why.empty() ? nullptr : why.c_str()), cause};
    }
  }
  return {};
}

void SendTracker::loop(int key) {
  std::unique_lock<std::mutex> lock(mu_);
  PeerQueue& queue = queues_.at(key);  // std::map: stable while other queues are added
  while (true) {
    changed_.wait(lock, [&] { return stop_ || !queue.queue.empty(); });
    if (stop_) return;
    Entry e = queue.queue.front();  // stays queued (and counted) until released
    lock.unlock();
    Failure error = wait_entry(e);
    lock.lock();
    const bool failed = !error.text.empty();
    if (failed && failure_.text.empty()) {
      failure_ = std::move(error);
      failed_ = true;
    }
    queue.queue.pop_front();
    if (failed) {
      // a transfer that failed or timed out may still read its buffers (NCCL) until its communicator is
      // aborted: they are held until this tracker goes, with the executor, after the abort
      failed_sends_.push_back(std::move(e.task));
    } else {
      lock.unlock();
      flight_.completed(e.task->flight_ticket);
      // the buffers go with the last references: the task's parts and its Works (which hold the
      // tensors); freed before the bytes count as released, outside the lock
      e.task->works.clear();
      e.task->parts.clear();
      e.task.reset();
      lock.lock();
    }
    queue.in_flight -= e.bytes;
    --pending_;
    changed_.notify_all();
  }
}

bool SendTracker::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.notify_all();  // small sends wait for their thread to wake
  return changed_.wait_for(lock, timeout, [&] { return pending_ == 0; });
}

void SendTracker::raise_failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.text.empty()) throw CommError(failure_.text, failure_.cause);
}

void SendTracker::clear_failure() {
  std::lock_guard<std::mutex> lock(mu_);
  failure_ = Failure{};
  failed_ = false;
}

int64_t SendTracker::held_failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(failed_sends_.size());
}

int64_t SendTracker::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void SendTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = 0;
  for (const auto& [peer, queue] : queues_) peak_ = std::max(peak_, queue.in_flight);
}

}  // namespace pipecore


