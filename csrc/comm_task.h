// One message as the executor posts it (CommTask), and how its parts go on the wire: its own header,
// used by every path (the comm worker, the send tracker, the device path and the CPU model of NCCL).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
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
  int64_t flight_ticket = 0;  // its entry among the flight record's messages in flight (FlightRecord::posted)
  // shaped receives (comm.h), once settled: the header's status and shapes, and the capacity the parts
  // are laid out by (a grown message's: its own shapes)
  int64_t action = -1;  // the program index of its RECV
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
  bool header_landed = false;  // its header was on the host when the path looked (its follow-up then posted)
  // a grown shaped message's follow-up (gloo: its second sending; the device path: on the follow-up
  // channel), read in place of `parts`, which stay until the executor lets go of it (DeviceComm::release:
  // stream_contract.h, rule 3)
  std::vector<at::Tensor> follow_up_parts;
  // the device path: the follow-up's receive (once: an aborted rest drains the message again), its
  // batch's ready marker, and whether the compute stream waited on it; let go of with the message
  std::shared_ptr<CommTask> follow_up;
  std::shared_ptr<StreamMarker> follow_up_ready;
  bool follow_up_consumed = false;
  std::exception_ptr follow_up_failure;  // posting it as its header landed failed: raised by its consumer

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

// What goes on the wire for `task`'s parts: their bytes (views), whatever their dtypes. NCCL sends only
// its own dtypes (no int16, no complex), and a part's dtype tells the receiver nothing its buffer does
// not: a refused dtype would fail inside a batch, after some of it was posted (half a batch).
std::vector<at::Tensor> wire_parts(const CommTask& task);

// Posts `task`'s parts in order, as bytes, appending their Works (throws what the group throws).
void post_parts(CommTask& task);

}  // namespace pipecore
