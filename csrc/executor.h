// pipecore executor: the per-rank action loop (dispatch, P2P, freeing, backward).
//
// The class is one object; its members are defined in a file per job (docs/architecture.md draws them):
//   run.cpp             the run and its abort protocol (the driver)
//   dispatch.cpp        one dispatch of an action, in a normal or an aborted run
//   compute.cpp         F, B, I, W and the stage events
//   discovery.cpp       the shapes a first step learns, and the spec setters
//   tracing.cpp         per-action trace events
//   executor_overlap.cpp  OVERLAP_F_B pairs
//   executor.cpp        construction and settings
// with the objects it holds: Program (program.h), MessageSpecs (message_specs.h, capacities.cpp), and the
// MessagePath (message_path.h) that carries its messages, which it never asks which path it is.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>  // Node must be complete for Edge
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backward.h"
#include "comm.h"
#include "errors.h"
#include "message_path.h"
#include "message_specs.h"
#include "outcome.h"
#include "overlap.h"
#include "program.h"
#include "step_profile.h"
#include "tensor_spec.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace pipecore {

class DeviceTimer;
class GradReducer;

using StageEventFn = std::function<void(int64_t event, int64_t stage)>;

// State of one (stage, microbatch) during a step.
struct Slot {
  std::vector<at::Tensor> inputs;           // received activations (leaves)
  Inbox recv_f;                             // activations
  Inbox recv_b;                             // output gradients
  std::vector<at::Tensor> outputs;          // until sent
  torch::autograd::edge_list out_edges;     // gradient edges of outputs that need grad
  torch::autograd::Edge loss_edge;          // last stage: the loss
  at::Tensor loss_seed;                     // d(total loss)/d(this loss)
  std::vector<at::Tensor> out_grads;        // received output gradients
  std::vector<at::Tensor> input_grads;      // to be sent back
  WeightWork weight;                        // what I left for W
  bool has_loss = false;
  // An aborted step's: drops graphs and activations, keeps the receives posted (they are drained).
  void drop_compute();
  // The receive a RECV_F (activations) or a RECV_B (output gradients) posts into.
  Inbox& inbox_of(int64_t recv_op) { return carries_activations(recv_op) ? recv_f : recv_b; }
};

// Told once when this rank's own action fails (before its peers are told), with the error text.
using AbortFn = std::function<void(const std::string& error, const std::string& action)>;

// Discovery steps (the first step of each batch shape, pipecore/runtime/discovery.py) start without shapes:
// each message's shapes are learnt when the step reaches it. The spec source is asked for those of
// (stage, mb)'s receive of activations (kRecvF) or, in an aborted step, its send of activations
// (kSendF) when none are set; it sets them (set_input_specs / set_output_specs) and answers.
// `may_wait`: false once the group broke (answer from what already arrived).
enum SpecAnswer : int64_t {
  kSpecsSet = 0,       // set: the message travels with these shapes
  kSpecsAbsent = 1,    // the sender's step failed before its forward produced it: no message travels
  kSpecsTimedOut = 2,  // nothing arrived within the timeout: a peer hung or died
};
using SpecFn = std::function<int64_t(int64_t stage, int64_t mb, int64_t op, bool may_wait)>;

// What the executor calls back into Python for: a stage's forward.
// Returns (outputs to send, loss or undefined, loss seed).
using ForwardFn = std::function<void(int64_t stage, int64_t mb, std::vector<at::Tensor>& inputs,
                                     std::vector<at::Tensor>& outputs, at::Tensor& loss, double& seed)>;

class Executor final : private PathOwner {
 public:
  Executor(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t num_stages, int64_t num_microbatches,
           double timeout_s, std::string who = {});
  ~Executor();
  // Joins the threads it owns (the comm worker, the send tracker's threads, aborting sends still in
  // flight, and the overlap pairs' backward thread) before it is destroyed. Python's deleter calls it
  // with the GIL released: a tensor those threads free may need the GIL. Nothing may use the executor
  // afterwards.
  void join_threads();

  void set_program(std::vector<int64_t> flat, std::vector<std::string> labels);
  // What (stage, mb) receives from the previous stage (recv_f) and sends to the next one (send_f);
  // the gradients that come back are those of the sent tensors that need one.
  void set_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, std::vector<TensorSpec> send_f,
                 at::TensorOptions options);
  void set_input_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, at::TensorOptions options);
  void set_output_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> send_f, at::TensorOptions options);
  // Every message's shapes unknown, to be learnt by a discovery run.
  void forget_specs() { specs_.forget(); }
  // Messages carry their tensors' shapes (comm.h, shaped messages), so that microbatches may change
  // shapes at every step without a discovery run. The shapes set (set_specs) are then capacities
  // (message_specs.h). A message that outgrows them goes as its header, then, on the host path, at its
  // own size (kMessageGrown): one extra message, until the boundary's capacity has grown. On the device
  // path every message goes at its capacity's size (NCCL receives need their exact size), the host reads
  // each received header (device_comm.h), and a message that outgrows its capacity follows on the
  // follow-up channel (set_follow_up_channels). Every rank of the group must set the same, between steps.
  void set_shapes_travel(bool on) { path_->format().shaped = on; }
  // The device path's shaped messages: two more communicators of the group's ranks (NCCL on CUDA), on
  // which a message that outgrew its capacity follows, packed on the device at its own size: `up` for
  // follow-ups to higher group ranks, `down` to lower ones ([Note: NCCL pair order] in device_comm.h
  // says why not on the group, in which order, and why one per direction). Costs one message more and
  // the host's read of its header, for each message of a step that outgrows the capacity the step
  // started with; nothing goes through the store, whatever the size.
  void set_follow_up_channels(c10::intrusive_ptr<c10d::Backend> up, c10::intrusive_ptr<c10d::Backend> down) {
    path_->settings().up = std::move(up);
    path_->settings().down = std::move(down);
  }
  bool shapes_travel() const { return path_->format().shaped; }
  // Shaped messages carry the step's batch rows (the first stages' batch size, 0 if it has none)
  // from the ranks holding a first stage, which set it before each run, to the others, which set -1
  // and learn it from the first activations they receive: the last stage weighs its losses by it
  // without an agreement when only the shapes changed.
  void set_batch_rows(int64_t rows) { path_->format().batch_rows = rows; }
  int64_t batch_rows() const { return path_->format().batch_rows; }
  // Messages sent in the last run: (messages, their parts, i.e. point-to-point sends; messages that
  // outgrew their capacity and went a second time).
  std::tuple<int64_t, int64_t, int64_t> message_counts() const {
    const MessageCounts& counts = path_->counts();
    return {counts.sent_messages, counts.sent_parts, counts.grown_messages};
  }
#ifdef PIPECORE_TESTING
  // Tests: sleep a random 0..max_us before every send and receive.
  void set_delays(int64_t max_us, uint64_t seed) { path_->set_delays(max_us, seed); }
#endif
  // The receive window of the host path (recv_window.h).
  void set_recv_window(int64_t n, bool past_sends, int64_t max_bytes = kRecvWindowBytes);
#ifdef PIPECORE_TESTING
  // Messages of at least `min_bytes` payload go as their tensors plus a trailer (see comm.h). Every
  // rank of the group must use the same value (tests only: the default suits everyone).
  void set_large_messages(int64_t min_bytes) { path_->format().large_message_bytes = min_bytes; }
#endif
  // CPU groups: post every send and receive from a thread of its own (see comm_worker.h).
  void set_comm_thread(bool on);
  // Accelerator groups (NCCL): the device path (device_path.cpp over device_comm.h), communication
  // without host waits, for messages on `device`; make_message_path chooses it, keeping the settings
  // made so far (shapes travel is off: set_shapes_travel after). False where this build has none for
  // `device` (the path stays as it was). Before the first step only. Batches replace the receive window
  // and the send budget there.
  bool set_device_comm(const std::string& device);
  bool device_comm() const;  // for Python's description of the path (message_path.py)
  // Before the first step, on every rank of the group at the same point: connects every communicator the
  // message path will post on (NCCL connects one at its first operation, which inside a step can close a
  // cycle: [Note: connecting before the first step], device_comm.h). `pair_channels`: the communicators
  // whose operations go alone; `peers`: the ranks this rank's programs exchange messages with;
  // `exchange_peers`: those `exchange` goes to (ties, dualpipe's mirrors).
  void connect_communicators(const std::vector<c10::intrusive_ptr<c10d::Backend>>& pair_channels,
                             const std::vector<int64_t>& peers, const std::vector<int64_t>& exchange_peers);
  // Between steps (a tie's or a dualpipe mirror's sum): `tensor` sent to group rank `peer`, and what `peer`
  // sends, on the communicators the messages use (MessagePath::exchange); CommError naming `what`.
  at::Tensor exchange(const at::Tensor& tensor, int64_t peer, const std::string& what) {
    return path_->exchange(tensor, peer, what);
  }
#ifdef PIPECORE_TESTING
  // Tests on CPU: the device path's protocol run by the host over gloo (make_host_device_comm;
  // `all_ranks_connected`: as a group made with a device id; `eager_bytes`: sends of at most that many
  // bytes complete before their receiver posts, as NCCL's eager protocol makes them; 0: none do).
  void emulate_device_comm(bool all_ranks_connected, int64_t eager_bytes);
  // Communicators the path connected so far: (ahead of every step, by a step's operation, store operations).
  std::vector<int64_t> connection_counts() const;
  // What the CPU model's stream-contract checker refused so far (testing/stream_ledger.h).
  std::vector<std::string> stream_violations() const;
#endif
  // gloo: messages travelling to a lower group rank go through `channel`, a second gloo group over
  // the same ranks, so that each pair of ranks has one connection per direction. gloo holds a pair's
  // lock while a send is written into its socket, and its event loop skips a locked pair and polls
  // it again at once: on a shared connection, a rank's own sends stall the data arriving from that
  // peer and make its event loop spin. Every rank of the group must set the same (or none), between
  // steps.
  void set_reverse_channel(c10::intrusive_ptr<c10d::Backend> channel) {
    path_->settings().reverse = std::move(channel);
  }
  // Bytes of sends in flight to one peer: a send that would exceed it first waits (on the compute
  // thread) until enough earlier sends to that peer completed. A message larger than the budget goes
  // when nothing else is in flight to its peer. Sends free their buffers when they complete.
  void set_send_budget(int64_t bytes) {
    TORCH_CHECK(bytes >= 0, "pipecore: the send budget must be >= 0 bytes, got ", bytes);
    path_->settings().send_budget = bytes;
  }
  // Data-parallel gradient reduction of plain stages (grad_reduce.h): armed before each stage's last
  // backward, its REDUCE_GRAD sends what is left. Null: none.
  void set_grad_reducer(std::shared_ptr<GradReducer> reducer) { stages_.reducer = std::move(reducer); }
  // Stages whose events go to `fn` (the bindings take the GIL for it), and whose backward runs whole
  // at I (their W does nothing): DDP's and FSDP2's autograd hooks expect a microbatch's weight
  // gradients within one backward.
  void set_stage_events(std::vector<int64_t> stages, StageEventFn fn);
  // Stages with their own weight-gradient function (torch's PipelineStage dw_builder): their backward
  // runs whole at I (or B), then `builder(stage)` makes a microbatch's weight-gradient runner, which
  // W runs (B: at once). Empty `stages`: none.
  using WeightBuilderFn = std::function<std::unique_ptr<DeferredClosure>(int64_t stage)>;
  void set_weight_builders(std::vector<int64_t> stages, WeightBuilderFn builder);
  // How OVERLAP_F_B pairs run (overlap.h). With `hook`, each pair calls hook(bracket index) instead
  // (the bindings take the GIL for it), which runs the halves through run_pair_half / run_pair.
  using OverlapHook = std::function<void(int64_t bracket)>;
  // `device`: the stages' device (the backward half's thread issues onto the step's stream there).
  void set_overlap(OverlapMode mode, OverlapHook hook, c10::Device device);
  // For the hook of the pair whose OVERLAP_F_B bracket is program[bracket]: runs one half (0: its
  // forwards, 1: its backwards), once, on the calling thread; or both, as `mode` says (the
  // executor's own rules apply: a pair that must not overlap runs in sequence). Throws the half's
  // error (also kept for the step).
  void run_pair_half(int64_t bracket, int half);
  void run_pair(int64_t bracket, OverlapMode mode);
  // Why that pair must not overlap ("" if it may): a hook that overlaps halves itself asks this.
  std::string pair_sequential_reason(int64_t bracket);
  // Since construction: pairs whose halves ran on two threads under the concurrent or lockstep rules
  // (a hook's own run_pair_half calls are not counted), and those that ran in sequence although the
  // mode overlaps them, by why ("checkpoint": the backward half recomputes a checkpoint, which sets
  // the global RNG state the forward half may draw from; "stage_events": a DDP/FSDP stage;
  // "python_modes": a Python dispatch or function mode is active; "one_kind": the pair has no
  // forward or no backward).
  int64_t overlapped_pairs() const { return overlap_.overlapped; }
  const std::map<std::string, int64_t>& overlap_fallbacks() const { return overlap_.fallbacks; }
  // Benchmarks only: keep sent outputs alive until the end of the step (as torch does).
  void set_free_outputs(bool free) { free_outputs_ = free; }
  // Per-action start/end times (steady clock, microseconds) of the last run, when enabled.
  // On an accelerator (`device` not CPU) the times come from events on its current stream.
  void set_trace(bool on, const std::string& device = "cpu");
  struct TraceEvent {
    int64_t label;
    double start_us;
    double end_us;
    int64_t lane = 0;  // 1: the backward half of an OVERLAP_F_B pair that ran beside its forward half
  };
  const std::vector<TraceEvent>& trace();
  // Where the last run's host time went, by part (step_profile.h), when enabled.
  void set_profile(bool on) { profile_on_ = on; }
  const StepProfile& profile() const { return profile_; }
  // What this rank does now and did last (flight_record.h): read from any thread at any time; the Python
  // layer sets the phases around the run (FlightRecord::Phase) and the step.
  FlightRecord& flight() { return flight_; }
  // "PP:1F0" for program[index] ("" if the program has no such action)
  std::string action_label(int64_t index) const {
    return index >= 0 && static_cast<size_t>(index) < program_.size() ? program_.label(program_[index])
                                                                        : std::string();
  }
  const std::string& label(int64_t i) const { return program_.labels[i]; }
  // Stages that hand their data over on this rank, without communication (-1: none).
  void set_links(int64_t stage, int64_t next_local, int64_t prev_local);
  // Runs the program once. `forward` is called for every F. When an action fails, the rest of the
  // program still runs, without compute, sending "aborted" messages of the right sizes so that no
  // peer is left waiting; then the original error is rethrown (PeerAbort on ranks that were told
  // by a message, CommError where a wait timed out or a connection broke). When this rank's own
  // error is rethrown and communication failed too while releasing the peers, last_comm_failure()
  // says how (the group cannot be trusted then), and last_comm_failure_cause() what the backend said.
  // With `discover` (a discovery step, see SpecFn): the shapes not set are asked for as the step
  // reaches them; no receive is posted ahead (its sender's forward may not have run before) and
  // the host waits for and reads each message. On the device path its batches still go as groups,
  // each receive of activations after a batch's first action opening a new one (p2p_order.py, rule 5).
  void run(const ForwardFn& forward, const AbortFn& on_abort, const SpecFn* discover = nullptr);
  // Runs the whole program without compute, sending "aborted" (status 1) or "shapes changed"
  // (status 2) messages: how a rank that cannot start its step releases its peers.
  void run_aborted(int64_t status);
  // Drops every tensor and graph of the last step (also after an error).
  void reset();

  int64_t rank() const { return rank_; }
  const std::string& last_comm_failure() const { return comm_failure_.text; }
  const std::string& last_comm_failure_cause() const { return comm_failure_.cause; }
  // Per stage, since construction: microbatches whose I computed weight gradients (or all of its
  // backward) because of a node that cannot be split, by (node, why).
  const std::vector<std::map<SplitFallback, int64_t>>& split_fallbacks() const { return split_fallbacks_; }
#ifdef PIPECORE_TESTING
  // Records of the last run, for tests (bindings.cpp binds them in test builds only).
  int64_t freed_outputs() const { return freed_outputs_; }
  // Largest number of bytes in flight to one peer during the last run.
  int64_t peak_send_bytes() const { return path_->peak_send_bytes(); }
  // Sends that failed or timed out, held with their buffers until this executor goes (send_tracker.h).
  int64_t held_failed_sends() const { return path_->held_failed_sends(); }
  int64_t threaded_posts() const { return path_->counts().threaded_posts; }
  int64_t posted_here() const { return path_->counts().posted_here; }
  int64_t reverse_posts() const { return path_->counts().reverse_posts; }
  const std::vector<int64_t>& recv_posted_at() const { return path_->recv_posted_at(); }
  // Per program index: for a SEND/RECV, one past the last action of its device batch (`learning`:
  // as a discovery run posts them); else 0.
  const std::vector<size_t>& batch_ends(bool learning) const {
    return learning ? program_.learning_end : program_.batch_end;
  }
#endif

 private:
  // --- run.cpp: the driver and its abort protocol
  // What stopped a run's program, by what it means for the rest of the step.
  void begin_run(const ForwardFn& forward);
  Outcome execute_program();
  void tell_abort(const Outcome& outcome, const AbortFn& on_abort);
  CommError release_peers(const Outcome& outcome);
  [[noreturn]] void rethrow(const Outcome& outcome, const CommError& comm_failure);
  void end_step();
  // Runs program[from..] aborted; returns the first communication failure met (its text empty if none).
  CommError finish_aborted(size_t from, bool wait, int64_t status);
  std::string action_name(size_t index) const;

  // --- dispatch.cpp
  void exec(size_t index, const RunMode& mode);
  void exec_traced(size_t index);

  // --- compute.cpp
  void do_forward(const Instr& in);
  void do_backward(const Instr& in, bool split);
  void do_weight(const Instr& in);
  void stage_event(int64_t event, int64_t stage);
  bool evented(int64_t stage) const { return in_mask(stages_.evented, stage); }
  bool builds_weight(int64_t stage) const { return stages_.weight_builder && in_mask(stages_.builds_weight, stage); }
  static bool in_mask(const std::vector<uint8_t>& mask, int64_t stage) {
    return stage >= 0 && stage < static_cast<int64_t>(mask.size()) && mask[stage];
  }
  std::vector<uint8_t> stage_mask(const std::vector<int64_t>& stages) const;  // [stage]: 1 for these
  // One gradient per input that needs one, in input order (zeros where none flowed); the slot lets go.
  std::vector<at::Tensor> take_input_grads(Slot& s);

  // --- what the message path asks (PathOwner); outgoing in compute.cpp
  std::vector<at::Tensor> outgoing(const Instr& in) override;
  Inbox& inbox_of(const Instr& in) override { return slot(in).inbox_of(in.op); }
  bool discovering() const override { return run_.discovering(); }
  // Lets go of every slot's receives and drops every slot's state.
  void clear_slots();

  // --- discovery.cpp
  // Are the shapes of RECV_F/SEND_F `in` known? In a discovery run, asks the spec source for them (may
  // wait for the peer's forward); false: no message travels (a receive that is not aborted throws
  // PeerAbort then).
  bool learn_specs(const Instr& in, bool aborted) override;
  // Shapes of what SEND action `in` sends, for an aborted message of the same size (a SEND_F's may be
  // learnt: waits as learn_specs does).
  std::vector<TensorSpec> learn_send_specs(const Instr& in) override;

  // --- executor_overlap.cpp: OVERLAP_F_B
  // Runs the pair whose bracket is program[index]; returns the index of its closing bracket. On failure
  // `index` becomes the first failed action's.
  size_t exec_pair(size_t& index);
  struct PairRun;
  // Runs `actions` of `half` up to the first failure, which `pair` keeps; traced in `lane`.
  void run_half(PairRun& pair, int half, const std::vector<size_t>& actions, int64_t lane);
  // A hook's pair (checked, under overlap_.mu): marks the halves it runs, counts it running until released.
  PairRun& claim_pair(int64_t bracket, bool first, bool second);
  void release_pair(PairRun& pair);
  void run_halves(PairRun& pair, OverlapMode mode);
  // Why the pair must run in sequence (null if it may overlap); `walk`: also look for checkpoints
  // in its backward graphs (pair_recomputes), the one costly question.
  const char* sequential_reason(const PairRun& pair, bool walk);
  bool pair_recomputes(const PairRun& pair);
  // Does the backward action `in` recompute a checkpointed region (walks the graph it will run)?
  bool backward_recomputes(const Instr& in);

  // --- tracing.cpp
  void begin_trace();   // a run's start: no events yet
  double trace_time();  // host time now, or an event index on an accelerator

  // "pipecore rank 5 (pp rank 1), action L": where an error happened.
  std::string where(const Instr& in) const override;
  Slot& slot(const Instr& in) { return slots_[grid_.key(in)]; }
  Slot& slot(int64_t stage, int64_t mb) { return slots_[grid_.key(stage, mb)]; }

  // The group.
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_;
  std::string who_;  // this rank in errors: "rank 5 (pp rank 1)" where the group is not the world
  std::chrono::milliseconds timeout_;

  // The program, its slots and what their messages carry.
  SlotGrid grid_;
  Program program_;
  std::vector<Slot> slots_;  // [grid_.key]
  MessageSpecs specs_;
  std::vector<int64_t> next_local_, prev_local_;  // [stage]: see set_links
  const ForwardFn* forward_ = nullptr;            // during run()

#ifdef PIPECORE_TESTING
  int64_t freed_outputs_ = 0;  // sent outputs the last run let go of (zeroed when a run begins)
#endif
  struct {
    std::string text, cause;
  } comm_failure_;  // see last_comm_failure()

  // The kind of the run under way (run() sets it, and puts it back however the run ends): one place for
  // "is this a discovery run" and "may the aborted rest wait".
  struct RunContext {
    const SpecFn* discover = nullptr;  // a discovery run: asked for the shapes it does not know (learn_specs)
    bool may_wait = true;  // the aborted rest's RunMode.wait (false once a wait in it failed, or one for shapes
                           // timed out: learn_specs)
    bool discovering() const { return discover != nullptr; }
  } run_;

  // Stages with hooks of their own.
  struct StageHooks {
    std::shared_ptr<GradReducer> reducer;
    StageEventFn event;
    std::vector<uint8_t> evented;        // [stage]: its events go to `event`
    WeightBuilderFn weight_builder;
    std::vector<uint8_t> builds_weight;  // [stage]: weight_builder makes its W
  } stages_;
  std::vector<std::map<SplitFallback, int64_t>> split_fallbacks_;  // [stage]
  bool free_outputs_ = true;
  std::vector<at::Tensor> kept_;  // sent outputs when free_outputs_ is off

  // OVERLAP_F_B pairs (executor_overlap.cpp).
  struct OverlapPairs {
    OverlapMode mode = OverlapMode::kLockstep;
    OverlapHook hook;
    c10::Device device{c10::kCPU};
    std::unique_ptr<HalfThread> half_thread;  // the backward half's, made at the first pair
    PairRun* pair = nullptr;                  // the pair whose hook runs (guarded by mu)
    std::mutex mu;
    std::condition_variable idle;  // a hook's half ended
    int64_t overlapped = 0;        // see overlapped_pairs()
    std::map<std::string, int64_t> fallbacks;  // see overlap_fallbacks()
  } overlap_;

  // Tracing (tracing.cpp) and profiling.
  struct Tracing {
    bool on = false;
    std::vector<TraceEvent> events;
    std::unique_ptr<DeviceTimer> timer;  // accelerators: event times are event indices until read
    bool resolved = true;
    std::mutex mu;  // the two halves of a pair trace at once
  } tracing_;
  bool profile_on_ = false;
  FlightRecord flight_;  // what this rank does now and did last (flight_record.h); before profile_, which writes it
  StepProfile profile_{flight_};

  // How messages travel (message_path.h): after what it reads of the executor (PathContext), which
  // outlives it.
  std::unique_ptr<MessagePath> path_;
  PathContext path_context();
  bool stepped_ = false;  // a step ran: the path is chosen before (set_device_comm)
  void check_no_step_ran(const char* what) const;
};

}  // namespace pipecore
