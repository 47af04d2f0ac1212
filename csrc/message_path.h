// How messages travel: one MessagePath per executor, chosen before its first step (make_message_path: the
// host path, replaced by the device path where Python asks for it), which the executor asks to post a
// SEND/RECV action, take or drop a received message, and finish the step, never asking which path it is
// (docs/architecture.md, "C++", draws it):
//   host_path.cpp    the host path (gloo): a receive window posted ahead, a send budget per peer, the comm
//                    worker, the reverse channel, a grown message's follow-up on a tag of its own
//   device_path.cpp  the device path (NCCL, or the CPU model in test builds): batches of a run of SEND/RECV
//                    actions as one group, ready markers, statuses folded on the device and read at the
//                    step's end, follow-ups on channels of their own (device_comm.h)
//   message_path.cpp what both share: a message's buffers and framing (MessageFormat), posting and counting,
//                    the send tracker, the scratch, reading a shaped message's header; and the factory
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "comm.h"
#include "connection_counts.h"
#include "errors.h"
#include "message_specs.h"
#include "outcome.h"
#include "program.h"
#include "recv_window.h"
#include "step_profile.h"
#include "stream_contract.h"
#include "tensor_spec.h"

namespace pipecore {

// Test builds (PIPECORE_TESTING, `make test`) add hooks that production builds leave out: random
// delays before posting, a forced large-message threshold, the device protocol on the host, and
// records of where receives were posted (bindings.cpp binds those only there).
#ifdef PIPECORE_TESTING
constexpr bool kTesting = true;
#else
constexpr bool kTesting = false;
#endif

class DeviceComm;
class SendTracker;
struct CommTask;

// A posted receive: the buffers of its message's parts and their pending Works; on the device path its
// batch's ready marker, which reading it (DeviceComm::consume) and letting go of it (release) take.
struct Inbox {
  std::shared_ptr<CommTask> task;
  std::shared_ptr<StreamMarker> ready;
  bool consumed = false;  // the compute stream waited on `ready` to read it
  bool posted() const { return task != nullptr; }
};

// Bytes of sends in flight to one peer before the next send to it waits for the oldest to complete
// (a message larger than this still goes, alone).
constexpr int64_t kDefaultSendBudget = 64 << 20;
// On a CPU group a send this small is posted on the compute thread, not handed to the comm worker,
// when the thread's next compute action takes a received message (it would wait anyway) and the
// worker has nothing queued. The hand-off's wake-up (25-50 us here) sat on every round trip of a
// latency-bound schedule such as 2-rank 1F1B; a larger message's copy into the socket would cost the
// thread more than it saves (bench/vs_torch.py, docs/performance.md).
constexpr int64_t kPostHereBytes = 16 << 10;

// How an action runs (dispatch.cpp): normally, or in an aborted step, with only its communication,
// sends carrying `status` (message_status.h); receives waited for and drained, and sends held to their
// peer's budget, only if `wait`.
struct RunMode {
  bool aborted = false;
  bool wait = true;
  int64_t status = 0;
};

// The one scheme of a path's messages (comm.h): plain (a trailer) or shaped (a header naming the shapes),
// small ones packed, on a path that needs every message at its exact size (NCCL) each at its capacity's
// size, and a grown message's follow-up numbered per peer (its key, which its header names).
struct MessageFormat {
  bool shaped = false;   // Executor::set_shapes_travel
  bool exact = false;    // the device path: a message at its capacity's size; the host reads each header's copy
  int64_t large_message_bytes = kLargeMessageBytes;
  int64_t batch_rows = -1;  // Executor::set_batch_rows
  // Follow-ups, per peer: numbered (message_of: the key), and on the device path sent (committed once a
  // batch is posted, so that a batch that failed to post leaves no gap on the channel) and received (each
  // key checked against it); gloo matches a key by its tag ([Note: NCCL pair order] in device_comm.h).
  std::unordered_map<int, int64_t> follow_ups_numbered, follow_ups_to, follow_ups_from;
};

// The settings Python gives the executor's messages (pipecore/runtime/message_path.py); a path made later
// takes them over.
struct PathSettings {
  int64_t window_receives = kDefaultRecvWindow;  // the host path's receive window (recv_window.h)
  bool window_past_sends = true;
  int64_t window_bytes = kRecvWindowBytes;
  int64_t send_budget = kDefaultSendBudget;  // Executor::set_send_budget
  bool comm_thread = false;                  // Executor::set_comm_thread
  c10::intrusive_ptr<c10d::Backend> reverse;   // Executor::set_reverse_channel
  c10::intrusive_ptr<c10d::Backend> up, down;  // Executor::set_follow_up_channels
  int64_t delay_us = 0;                        // tests: Executor::set_delays
  uint64_t delay_seed = 0;
  // the channel of a follow-up between this rank and `peer` (`send`: this rank sends it)
  c10d::Backend* channel(int64_t rank, int64_t peer, bool send) const {
    return (send ? peer > rank : peer < rank) ? up.get() : down.get();
  }
};

// What the last run sent and posted (reset at each run's start).
struct MessageCounts {
  int64_t sent_messages = 0, sent_parts = 0, grown_messages = 0;  // Executor::message_counts()
#ifdef PIPECORE_TESTING
  int64_t threaded_posts = 0;  // messages posted by the comm worker
  int64_t posted_here = 0;     // small sends posted on the compute thread (kPostHereBytes)
  int64_t reverse_posts = 0;   // messages posted on the reverse channel
#endif
};

// What a path asks of the executor that runs it.
class PathOwner {
 public:
  // "pipecore rank 5 (pp rank 1), action L": where an error happened.
  virtual std::string where(const Instr& in) const = 0;
  // Are the shapes of RECV_F/SEND_F `in` known? In a discovery run, learnt (discovery.cpp).
  virtual bool learn_specs(const Instr& in, bool aborted) = 0;
  // Shapes of what SEND `in` sends, for an aborted message of the same size.
  virtual std::vector<TensorSpec> learn_send_specs(const Instr& in) = 0;
  // What SEND `in` sends: the stage's outputs (let go of by the slot) or its input gradients.
  virtual std::vector<at::Tensor> outgoing(const Instr& in) = 0;
  // The receive RECV `in` posts into (its slot's).
  virtual Inbox& inbox_of(const Instr& in) = 0;
  // A discovery run (Executor::run's `discover`): each message's shapes are learnt as the step reaches it.
  virtual bool discovering() const = 0;

 protected:
  ~PathOwner() = default;
};

// The executor's parts a path reads (they outlive it).
struct PathContext {
  PathOwner& owner;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int64_t rank;
  const std::string& who;
  const std::chrono::milliseconds& timeout;
  const Program& program;
  MessageSpecs& specs;
  StepProfile& profile;
  FlightRecord& flight;
};

class MessagePath {
 public:
  virtual ~MessagePath();
  MessagePath(const MessagePath&) = delete;
  MessagePath& operator=(const MessagePath&) = delete;

  // --- the step, as the executor runs it
  // Between steps (`recv_count`: the program's RECV actions): nothing posted, counted or held.
  virtual void reset(size_t recv_count);
  // A run's start, after reset (the device path: the step status is ok).
  virtual void begin_step() {}
  // Before program[at] runs: what the path posts ahead (the host path's receive window).
  virtual void before(size_t at) = 0;
  // SEND/RECV action program[index]: its message posted (or its batch's; `mode.aborted`: sends carry
  // its status, receives land in the scratch). Safe on an action already posted: nothing goes twice.
  virtual void post(size_t index, const RunMode& mode) = 0;
  // The tensors of the message `inbox` received, for compute action `in` (`specs`: a plain message's);
  // the inbox is let go of. Throws what a bad status says (outcome.h).
  std::vector<at::Tensor> take(Inbox& inbox, const Instr& in, const std::vector<TensorSpec>& specs);
  // An aborted step's consuming action: waits for (if `wait`) and lets go of what it would have read.
  void drop(Inbox& inbox, const Instr& in, bool wait);
  // Lets go of a receive.
  virtual void let_go(Inbox& inbox) = 0;
  // The step's end: every send completed and (device) the step's status read. Ok, or why not.
  Outcome finish_step();
  // Throws CommError if a send failed.
  void check_sends();
  // A failure of this rank's own (kOrigin) that the step's status explains (the device path computes on
  // what arrived before its status is known): the outcome the status says, naming the failure.
  virtual Outcome explained(Outcome outcome, const std::string& action) { return outcome; }
  // May the aborted rest post after `outcome`? Not where posting onto a wedged communicator could block.
  virtual bool may_post_after(const Outcome& outcome) const { return true; }
  // The aborted rest's end: every send waited for (throws CommError).
  void drain_sends();
  // Lets go of every receive of `slots`.
  template <class Slots>
  void let_go_all(Slots& slots) {
    for (auto& s : slots) {
      let_go(s.recv_f);
      let_go(s.recv_b);
    }
    forget_unread();
  }
  // Lets go of the sends' scratch (and the receives': an aborted rest's end); sends in flight keep theirs.
  void drop_scratch(bool receives_too);
  // The last stage's loss seed, `value`, gated (device path) by the step's status.
  virtual at::Tensor seed_of(const at::Tensor& loss, double value);

  // --- settings and what the last run did
  MessageFormat& format() { return format_; }
  const MessageFormat& format() const { return format_; }
  PathSettings& settings() { return settings_; }
  virtual void apply_settings() {}  // after a setting changed (the comm worker made or ended)
  // Before the first step: connects every communicator the path will post on, with this rank's `peers`
  // ([Note: connecting before the first step], device_comm.h); `pair_channels`: those whose operations go
  // alone (c10d posts them on a communicator of the two ranks); `exchange_peers`: the ranks `exchange` goes
  // to. Nothing on the host path: gloo connects every pair when its group is made.
  virtual void connect(const std::vector<c10d::Backend*>& /*pair_channels*/, const std::vector<int>& /*peers*/,
                       const std::vector<int>& /*exchange_peers*/) {}
  // Between steps: `tensor` sent to group rank `peer` and what `peer` sends back (the same size), within the
  // timeout (CommError naming `what`). The host path sends and receives on the group (collectives.h); the
  // device path sends both as one group on the communicator its messages use, whose connection with `peer`
  // the Pipeline made ahead (a tie's or a dualpipe mirror's partner is among `connect`'s peers), not on a
  // communicator of the two ranks that c10d would make at the first operation.
  virtual at::Tensor exchange(const at::Tensor& tensor, int64_t peer, const std::string& what);
  virtual ConnectionCounts connection_counts() const { return {}; }
#ifdef PIPECORE_TESTING
  // Tests: sleep a random 0..max_us before every send and receive.
  void set_delays(int64_t max_us, uint64_t seed) {
    settings_.delay_us = max_us;
    settings_.delay_seed = seed;
    rng_.seed(seed);
  }
#endif
  // Moves the format and settings out, for the path that replaces this one (make_message_path): its
  // follow-ups are numbered from the start again (every rank replaces its path before its first step)
  // and shapes do not travel until asked for again (Executor::set_shapes_travel).
  std::pair<MessageFormat, PathSettings> pass_on();
  const MessageCounts& counts() const { return counts_; }
#ifdef PIPECORE_TESTING
  const std::vector<int64_t>& recv_posted_at() const { return recv_posted_at_; }
#endif
  int64_t peak_send_bytes() const;
  int64_t held_failed_sends() const;
  virtual bool on_device() const { return false; }  // for Python's description of the path only
  virtual std::vector<std::string> stream_violations() const { return {}; }
  // Joins the threads the path owns (the comm worker, the send tracker's threads).
  virtual void join_threads();

 protected:
  MessagePath(PathContext context, MessageFormat format, PathSettings settings);

  // The parts of a received message, once waited for (host) or ordered on the device; a status other
  // than ok that the host reads throws what it says.
  const std::vector<at::Tensor>& receive(Inbox& inbox, const Instr& in, const char* what);
  // Does the host wait for each message and read it (the host path; the device path in a discovery run)?
  // Else the device orders its reads and reads a plain message's status, at the step's end.
  virtual bool host_reads() const = 0;
  // Before a received message is read (its header or its data): the device path orders the compute
  // stream's reads after its batch (stream_contract.h, rule 2); nothing on the host.
  virtual void before_reading(Inbox& /*inbox*/, const Instr& /*in*/, const char* /*what*/) {}
  virtual void forget_unread() {}
  // finish_step's second half, once the sends completed: the device path reads the step's status (throws
  // what it says).
  virtual void check_step_status() {}
  // RECV_F / RECV_B: its buffers allocated and set in the slot, to be posted (null: nothing to receive).
  std::shared_ptr<CommTask> make_recv(const Instr& in, bool aborted);
  // The parts of SEND action `in`'s message (empty: nothing to send): what it sends, or (`aborted`) a
  // message of the same size whose trailer carries `status`. A shaped message that outgrew its
  // capacity is its header; `follow_up` then gets the message at its own size (on the device path
  // packed), and `key` its key (MessageFormat). `crossing`: the shapes of a
  // shaped SEND_F's tensors, to record once it is posted. `trailer`: a plain message's trailer writer
  // (the device path carries the step status on), or none.
  std::vector<at::Tensor> message_of(const Instr& in, bool aborted, int64_t status = 0,
                                     std::vector<at::Tensor>* follow_up = nullptr,
                                     std::vector<TensorSpec>* crossing = nullptr, int64_t* key = nullptr,
                                     const std::function<void(at::Tensor&)>& trailer = {});
  // Posts `tasks` (program order; `actions[k]` is tasks[k]'s action) to their action's peer on `tag`
  // (submit), counts them, and hands sends to the tracker, which frees them once complete (a follow-up,
  // tag != 0, outside the budget). `inboxes`, `channel`, `here_if_idle`, `on`: see submit.
  void post_tasks(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions, int tag = 0,
                  bool here_if_idle = false, const std::vector<Inbox*>& inboxes = {},
                  c10d::Backend* channel = nullptr, const ComputeStream* on = nullptr);
  // The path's own posting of addressed tasks: on the host from the comm worker or (none, or
  // `here_if_idle` and it has nothing queued) this thread; on the device path as one group from compute
  // stream `on` (on `channel`, a follow-up channel, alone), each receive's batch ready marker into its
  // `inboxes` entry (null for a send), set as soon as the batch is posted.
  virtual void submit(const std::vector<std::shared_ptr<CommTask>>& tasks, const std::vector<size_t>& actions,
                      bool here_if_idle, const std::vector<Inbox*>& inboxes, c10d::Backend* channel,
                      const ComputeStream* on) = 0;
  // Waits until a queued task is posted; a posting error becomes a CommError.
  void await_posted(CommTask& task, const Instr& in);
  // The CommError for a send or receive the group refused to post (`cause`: the backend's error).
  CommError post_failure(const CommTask& task, const Instr& in, const std::string& cause) const;
  // Waits for every part of the receive `task` (`what`: its message_name, for the error).
  void wait_task(CommTask& task, const Instr& in, const char* what);
  // Shaped messages: reads a received message's header (once, in the path's order); a grown one is
  // received again at its own size (comm.h). Records what crossed the boundary. Unless `draining`
  // (an aborted run's receive, dropped), a status other than ok throws what it says. The two halves of
  // an OVERLAP_F_B pair may settle at once.
  void settle(CommTask& task, const Instr& in, const char* what, bool draining);
  virtual void read_in_order(CommTask& task, const Instr& consumer, bool draining) = 0;
  // settle's reading of one message for action `consumer`: its status and header (read_status), a grown
  // one's follow-up (follow_up, its data into the scratch when `draining`).
  void read_header(CommTask& task, const Instr& consumer, bool draining);
  virtual int64_t read_status(CommTask& task, const Instr& consumer, const char* what, ShapedHeader& header) = 0;
  // A grown message's follow-up, laid out by `layout`; `same`: it matches its header.
  virtual std::vector<at::Tensor> follow_up(CommTask& task, const std::vector<TensorSpec>& layout,
                                            const Instr& consumer, const char* what, int64_t key, bool draining,
                                            bool& same) = 0;
  // Bytes for messages whose contents do not matter: aborted messages' payloads, the receives an aborted
  // step drops, and the padding of a grown message's header on the device path. One buffer each for sends
  // and receives, so that a rank out of memory can still release its peers.
  at::Tensor scratch(const at::TensorOptions& options, int64_t bytes, bool for_sends);
  std::string where(const Instr& in) const { return ctx_.owner.where(in); }
#ifdef PIPECORE_TESTING
  void maybe_delay();
#else
  void maybe_delay() {}
#endif

  PathContext ctx_;
  const Program& program_;
  MessageFormat format_;
  PathSettings settings_;  // before sends_: the tracker's Works may be on the reverse channel
  MessageCounts counts_;
#ifdef PIPECORE_TESTING
  std::vector<int64_t> recv_posted_at_;  // [k]: program index before which RECV k was posted
  void record_posted_at(size_t k, size_t at) { recv_posted_at_[k] = static_cast<int64_t>(at); }
#else
  void record_posted_at(size_t, size_t) {}
#endif
  std::unique_ptr<SendTracker> sends_;
  at::Tensor recv_scratch_, send_scratch_;  // see scratch()
  // the crossings into a stage (specs.crossed_in), batch rows and a follow-up's posting, from the halves of
  // a pair (crossings out are recorded by SENDs, on the step's thread only)
  std::mutex settle_mu_;
#ifdef PIPECORE_TESTING
  std::mt19937_64 rng_;
#endif

};

// The factory, the one place that chooses a path. Without `device`: the host path with the default
// settings (an executor's first). With one: the device path for it where this build has one (CUDA),
// taking over `replacing`'s format and settings (pass_on; if making it throws, `replacing` keeps them),
// or null where the build has none for `device` (the caller keeps `replacing`).
std::unique_ptr<MessagePath> make_message_path(PathContext context, const c10::Device* device, MessagePath* replacing);
// The two paths (host_path.cpp, device_path.cpp); only the factory and, in test builds, the CPU model's
// emulation (Executor::emulate_device_comm) call them.
std::unique_ptr<MessagePath> make_host_path(PathContext context, MessageFormat format, PathSettings settings);
std::unique_ptr<MessagePath> make_device_path(PathContext context, MessageFormat format, PathSettings settings,
                                              std::unique_ptr<DeviceComm> device);

}  // namespace pipecore
