// Sends and receives posted from a thread of their own (CPU groups). Posting a gloo operation takes
// locks shared with gloo's event-loop thread, and a send whose receiver is already waiting writes
// the whole message into the socket in the posting thread. Posted from here, compute goes on
// meanwhile, as a communication stream lets it on a GPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensor_spec.h"

namespace pipecore {

struct StreamMarker;  // stream_contract.h

// One message: its parts (sent or received in order), where they are posted, and once posted their
// Works or the error posting raised.
struct CommTask {
  bool send = true;
  std::vector<at::Tensor> parts;
  int peer = -1;
  int tag = 0;
  c10d::ProcessGroup* group = nullptr;  // posted here, unless `channel` is set
  c10d::Backend* channel = nullptr;     // the reverse channel (see Executor::set_reverse_channel)
  bool queued = false;                  // posted by the comm worker (else by the thread that made it)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::exception_ptr error;
  // shaped receives (comm.h), once settled: the header's status and shapes, and the capacity the parts
  // are laid out by (a grown message's: its own shapes)
  int64_t action = -1;  // the program index of its RECV
  int ordinal = 0;      // among the receives posted from its peer in the run (comm.h: follow-up tags)
  bool follow_up_failed = false;  // a grown message's second sending did not match its header
  bool settled = false;
  int64_t status = 0;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<TensorSpec> layout;
  // shaped device receives: the header's bytes, copied to the host on the communication stream after
  // their batch (`header_host`, pinned), ready at `header_ready` (DeviceComm::read_header)
  int64_t header_bytes = 0;
  at::Tensor header_host;
  std::shared_ptr<StreamMarker> header_ready;
  // a grown shaped message's follow-up (gloo: its second sending; the device path: on the follow-up
  // channel), read in place of `parts`, which stay until the executor lets go of it (DeviceComm::release:
  // stream_contract.h, rule 3)
  std::vector<at::Tensor> follow_up_parts;
  // the device path: the follow-up's receive (once: an aborted rest drains the message again), its
  // batch's ready marker, and whether the compute stream waited on it; let go of with the message
  std::shared_ptr<CommTask> follow_up;
  std::shared_ptr<StreamMarker> follow_up_ready;
  bool follow_up_consumed = false;

  CommTask() = default;
  CommTask(const CommTask&) = delete;
  CommTask& operator=(const CommTask&) = delete;

  // Once the parts are posted (or posting failed): `works` or `error` are set and may be read.
  void mark_posted(std::exception_ptr failure);
  // Waits until posted; false if `timeout` passed first.
  bool wait_posted(std::chrono::milliseconds timeout);
  bool posted() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool posted_ = false;
};

// `timeout` from now; the clock's end where that lies beyond it (a timeout of centuries never ends).
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto end_of_clock = std::chrono::steady_clock::time_point::max();
  return timeout < std::chrono::duration_cast<std::chrono::milliseconds>(end_of_clock - now) ? now + timeout
                                                                                              : end_of_clock;
}

// What is left until `deadline` (none or less: zero or negative).
inline std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
}

// The message of a stored exception ("unknown error" if it is not a std::exception).
std::string error_text(const std::exception_ptr& error);

// Names the calling thread (as profilers show it) and, on Linux, makes it SCHED_BATCH: woken, it does
// not preempt the thread running on its core (a rank's compute thread) but runs on an idle core, when
// that thread waits, or at the scheduler's next tick. Its weight is a normal thread's, so it is not
// starved as at a lower priority (nice 19 was tried: the worker starved). Measured on 2 gloo ranks
// sharing 2 cores: waking the comm worker had cost the compute thread up to 4 ms (docs/performance.md).
void become_helper_thread(const char* name);

// What goes on the wire for `task`'s parts: their bytes (views), whatever their dtypes. NCCL sends only
// its own dtypes (no int16, no complex), and a part's dtype tells the receiver nothing its buffer does
// not: a refused dtype would fail inside a batch, after some of it was posted (half a batch).
std::vector<at::Tensor> wire_parts(const CommTask& task);

// Posts `task`'s parts in order, as bytes, appending their Works (throws what the group throws).
void post_parts(CommTask& task);

class CommWorker {
 public:
  CommWorker();
  ~CommWorker();
  // Posts `task` after every task queued before it (operations with a peer keep their order), then
  // marks it posted.
  void queue(std::shared_ptr<CommTask> task);
  // Posts `task` on the calling thread if nothing queued waits or is being posted (so the order with a
  // peer is kept) and returns true; false, doing nothing, otherwise. Throws what posting throws.
  bool post_if_idle(CommTask& task);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<CommTask>> tasks_;
  bool stop_ = false;
  bool posting_ = false;  // the worker is posting a task it took
  std::thread thread_;
};

}  // namespace pipecore
