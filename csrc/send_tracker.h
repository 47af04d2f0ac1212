// Sends in flight, per peer. Each posted send is handed to a thread of its peer's, which waits for
// the transfer to complete and then drops the message's buffers and the Works that hold them: a sent
// activation is freed when it has left, not at its backward or the end of the step, and the compute
// thread never waits for it unless the peer's budget of bytes in flight is used up. (Small packed
// messages are collected in bulk: below.)
//
// gloo's send Works report completion only to a waiter (isCompleted stays false until wait), so
// completion is waited for, not polled. Sends to one peer complete in posting order (one channel per
// direction), so one thread per peer waits for them in that order; a slow peer does not hold back the
// freeing of another peer's messages.
//
// A send of one part and at most kWakeForSendBytes does not wake its peer's thread: the thread
// collects it when it next wakes (for another send, a wait for the budget, the drain at every run's
// end, or once kUncollectedBytes of such sends wait in the queue). A one-part message is the buffer it
// was packed into (comm.h), never a tensor of the sender's, so only those buffers live on until the
// thread wakes; each still times out from its own posting. A thread wake-up per message cost up to
// 10-20% of a step of small messages here (docs/performance.md).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm_task.h"
#include "errors.h"
#include "flight_record.h"

namespace pipecore {

constexpr int64_t kWakeForSendBytes = 16 << 10;
constexpr int64_t kUncollectedBytes = 1 << 20;

class SendTracker {
 public:
  // Completed sends are marked in `flight` (FlightRecord::completed).
  explicit SendTracker(FlightRecord& flight) : flight_(flight) {}
  // Aborts the waits still in flight (after a failure) and joins the threads.
  ~SendTracker();
  SendTracker(const SendTracker&) = delete;
  SendTracker& operator=(const SendTracker&) = delete;

  // Before posting `bytes` to `peer`: blocks while that peer's bytes in flight plus `bytes` exceed
  // `budget` (a message always goes when nothing else is in flight to its peer). False if `timeout`
  // passed first.
  bool reserve(int peer, int64_t bytes, int64_t budget, std::chrono::milliseconds timeout);
  // A posted (or queued) send of `bytes`: waited for and released by its peer's thread (woken for it
  // unless it is small and packed, above). `what` names it in an error. `aside`: a queue of its own
  // per peer, outside the budget: a grown message's second sending (comm.h), which completes when
  // the receiver reads the message, not in posting order.
  void track(std::shared_ptr<CommTask> task, int64_t bytes, std::string what, std::chrono::milliseconds timeout,
             bool aside = false);
  // Blocks until every tracked send completed or failed; false if `timeout` passed first.
  bool drain(std::chrono::milliseconds timeout);
  // Throws the first send that failed (timed out, broke, or could not be posted) as a CommError (its cause:
  // the backend's text), if one did.
  void raise_failure() const;
  // Sends that failed or timed out: their parts and Works are held until this tracker goes (a transfer
  // the backend still runs may read them until its communicator is aborted, which comes first).
  int64_t held_failed() const;
  bool failed() const { return failed_; }
  void clear_failure();

  // Largest sum of bytes not yet released to one peer (in flight, or small sends not collected yet)
  // since the last reset_peak().
  int64_t peak_bytes() const;
  void reset_peak();

 private:
  struct Entry {
    std::shared_ptr<CommTask> task;
    int64_t bytes;
    std::string what;
    std::chrono::milliseconds timeout;
    std::chrono::steady_clock::time_point deadline;  // its posting + timeout
  };
  struct PeerQueue {
    std::deque<Entry> queue;  // front: being waited for
    int64_t in_flight = 0;
    int64_t uncollected = 0;  // bytes of small sends queued since the thread was last woken
    std::thread thread;
  };
  void loop(int key);  // queues_'s key: a peer, or -2 - peer for its `aside` queue
  // Waits for `e`'s transfer; returns what failed (pipecore's text; the backend's as the cause), an empty
  // text on success.
  struct Failure {
    std::string text, cause;
  };
  Failure wait_entry(const Entry& e);  // never throws
  Failure wait_posted_and_sent(const Entry& e);

  FlightRecord& flight_;
  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::map<int, PeerQueue> queues_;
  Failure failure_;
  std::atomic<bool> failed_{false};
  int64_t peak_ = 0;
  int64_t pending_ = 0;  // sends not released yet, all peers
  std::vector<std::shared_ptr<CommTask>> failed_sends_;  // held_failed()
  std::atomic<bool> stop_{false};  // set under mu_; device polling reads it without the lock
};

}  // namespace pipecore
