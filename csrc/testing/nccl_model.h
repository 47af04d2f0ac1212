// The CPU model of NCCL's communicators, for the CPU model of the device path (host_device_comm.cpp),
// over gloo, failing where NCCL would:
// - a group's operations are posted together, as bytes, when it ends (a coalesced group launches as
//   one); a dtype NCCL lacks, or a peer the communicator does not have, is refused inside the group;
// - a communicator's groups launch one after another, each once the group before it completed (a
//   thread per communicator posts them), as NCCL's kernels run on the communicator's stream: a cycle
//   of groups across ranks leaves one never launched, and a wait for it says so ("this would hang"),
//   naming its operations and those of the group it waited behind. A group's Work is all of its
//   operations (a sender's buffers are held until its batch's receives completed too, as NCCL's
//   coalesced Work completes);
// - each operation tells its peer what it is (a note, on tags of the model's own, so the i-th note
//   between two ranks is of the operation NCCL would match with the i-th of theirs): a receive whose
//   send has another size, on which NCCL would wait forever, is an error on both ranks naming both
//   operations. A receive is posted once its sender's note matched (gloo kills the process on a
//   receive smaller than its send), by a thread per peer, so a group's receives from other peers go
//   on meanwhile, as NCCL's do;
// - a group launches only once what the stream current at its posting had waited for completed (c10d
//   makes the communicator's stream wait for that stream): a cycle through two communicators' streams
//   is reported as the hang it would be, naming both groups;
// - an abort ends every operation of the communicator launched and not completed;
// - a group, once launched, progresses by itself (its stream's thread waits for it), as a GPU runs it
//   whether or not the host waits: its Work's isCompleted says whether it completed, without a wait;
// - every send is a rendezvous (it completes once its receiver posted), the strictest of NCCL's
//   protocols, so that what completes on the model completes on every one of them; with `eager_bytes`,
//   a send of at most that many bytes completes before its receiver posts (NCCL's eager protocol: the
//   data waits in the receiver's buffers), and a larger one does not. Each send is judged on its own:
//   NCCL does so only while the connection's buffers have room, and over a network a send waits for
//   the receiver's buffer whatever its size, so eager_bytes is generous, for tests of that protocol only.
// The model's own waits have no timeout (a gloo wait that times out closes every pair of its group):
// the host's waits for a group, with the executor's timeout, say what did not complete.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../comm_task.h"

namespace pipecore {

// Refuses, as NCCL does inside a group, a dtype NCCL lacks or a peer the communicator does not have.
void check_nccl_op(const CommTask& task);

// "the receive from rank 0 (4096 bytes, action 12)", for reports
std::string message_name(const CommTask& task);

// One communicator's stream (or one pair's, for operations posted alone).
class CommStream {
 public:
  virtual ~CommStream() = default;
  // Queues a group of `tasks` (copied: the executor keeps its own), named `kind` in errors: its Work,
  // which completes once every operation of it did. It launches once the group before it completed and
  // once `after` did: what the stream current at its posting had waited for (c10d makes the
  // communicator's stream wait for that stream).
  virtual c10::intrusive_ptr<c10d::Work> queue(const char* kind, const std::vector<CommTask*>& tasks,
                                               std::vector<c10::intrusive_ptr<c10d::Work>> after) = 0;
  // NCCL's abort: every operation launched and not completed, and every group queued, end with `why`.
  virtual void abort(const std::string& why) = 0;
  // The group queued last (null if none): it completes after every group before it.
  virtual c10::intrusive_ptr<c10d::Work> last() = 0;
};

// A Work of the model named for reports ("the group: a send to rank 1 (800 bytes, action 2)"), or
// "another communicator's work".
std::string work_name(const c10d::Work& work);
// Waits up to `timeout` until `work` ended, completed or failed (an aborted communicator's work ends, as
// its kernels do): empty, or why it did not.
std::string wait_ended(c10d::Work& work, std::chrono::milliseconds timeout);

// Its waits have no timeout of their own (a gloo wait that times out closes every pair of the group):
// the host's waits for a group, which have the executor's, report what did not complete.
// `eager_bytes`: sends of at most that many bytes complete before their receiver posts (0: none do).
std::unique_ptr<CommStream> make_comm_stream(int64_t eager_bytes = 0);

}  // namespace pipecore
