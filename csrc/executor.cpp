#include "executor.h"

#include <ATen/ops/full_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "backward.h"
#include "comm.h"
#include "device_comm.h"
#include "device_timer.h"
#include "grad_reduce.h"
#include "comm_worker.h"
#include "send_tracker.h"
#include "trace.h"

namespace pipecore {

namespace {
double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
constexpr int kTag = 0;  // channel order, agreed by both sides, matches messages
}  // namespace

Executor::Executor(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t num_stages, int64_t num_microbatches,
                   double timeout_s)
    : pg_(std::move(pg)),
      rank_(pg_->getRank()),
      num_stages_(num_stages),
      num_microbatches_(num_microbatches),
      timeout_(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))),
      slots_(num_stages * num_microbatches),
      recv_f_specs_(num_stages * num_microbatches),
      recv_b_specs_(num_stages * num_microbatches),
      send_f_specs_(num_stages * num_microbatches),
      options_(num_stages * num_microbatches),
      input_known_(num_stages * num_microbatches, 0),
      output_known_(num_stages * num_microbatches, 0),
      crossed_in_(num_stages),
      crossed_out_(num_stages),
      sends_(std::make_unique<SendTracker>()),
      next_local_(num_stages, -1),
      prev_local_(num_stages, -1),
      split_fallbacks_(num_stages) {}

Executor::~Executor() = default;

void Executor::stop_threads() {
  worker_.reset();
  sends_.reset();
}

void Executor::set_links(int64_t stage, int64_t next_local, int64_t prev_local) {
  TORCH_CHECK(stage >= 0 && stage < num_stages_, "pipecore: bad stage index ", stage);
  next_local_[stage] = next_local;
  prev_local_[stage] = prev_local;
}

std::vector<at::Tensor> Executor::take_input_grads(Slot& s) {
  // one gradient per input that needs one, in input order (zeros where none flowed)
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < s.inputs.size(); ++k) {
    if (!s.inputs[k].requires_grad()) continue;
    at::Tensor g = k < s.input_grads.size() ? s.input_grads[k] : at::Tensor();
    grads.push_back(g.defined() ? g : at::zeros_like(s.inputs[k]));
  }
  s.input_grads.clear();
  s.inputs.clear();
  return grads;
}

void Executor::set_timeout(double seconds) {
  timeout_ = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void Executor::set_program(std::vector<int64_t> flat, std::vector<std::string> labels) {
  TORCH_CHECK(flat.size() % 5 == 0, "pipecore: program must hold 5 integers per instruction");
  program_.clear();
  program_.reserve(flat.size() / 5);
  for (size_t i = 0; i < flat.size(); i += 5) {
    Instr in{flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4]};
    TORCH_CHECK(in.op >= 0 && in.op <= kOverlapEnd, "pipecore: bad opcode ", in.op);
    if (in.op != kOverlapBegin && in.op != kOverlapEnd && in.op != kReduceGrad && in.op != kUnshard &&
        in.op != kReshard) {
      TORCH_CHECK(in.stage >= 0 && in.stage < num_stages_ && in.mb >= 0 && in.mb < num_microbatches_,
                  "pipecore: instruction ", i / 5, " names stage ", in.stage, " microbatch ", in.mb,
                  " outside this executor's ", num_stages_, " stages x ", num_microbatches_, " microbatches");
    }
    TORCH_CHECK(in.label >= 0 && in.label < static_cast<int64_t>(labels.size()), "pipecore: bad label index");
    program_.push_back(in);
  }
  labels_ = std::move(labels);
  recv_instrs_.clear();
  send_before_recv_.clear();
  recvs_through_.assign(program_.size(), 0);
  std::unordered_map<int64_t, int64_t> last_send;  // peer -> program index
  for (size_t i = 0; i < program_.size(); ++i) {
    const int64_t op = program_[i].op;
    if (op == kSendF || op == kSendB) last_send[program_[i].peer] = static_cast<int64_t>(i);
    if (op == kRecvF || op == kRecvB) {
      recv_instrs_.push_back(i);
      auto it = last_send.find(program_[i].peer);
      send_before_recv_.push_back(it == last_send.end() ? -1 : it->second);
    }
    recvs_through_[i] = recv_instrs_.size();
  }
  // whether the compute action after each SEND takes a received message (the thread will wait next)
  std::unordered_set<int64_t> received;  // (op, stage, mb) of each RECV
  auto key_of = [&](int64_t op, const Instr& in) { return (op * num_stages_ + in.stage) * num_microbatches_ + in.mb; };
  for (const Instr& in : program_) {
    if (in.op == kRecvF || in.op == kRecvB) received.insert(key_of(in.op, in));
  }
  waits_next_.assign(program_.size(), 0);
  bool next_waits = false;
  for (size_t i = program_.size(); i-- > 0;) {
    const Instr& in = program_[i];
    if (in.op == kF) next_waits = received.count(key_of(kRecvF, in)) > 0;
    else if (in.op == kB || in.op == kI) next_waits = received.count(key_of(kRecvB, in)) > 0;
    else if (in.op != kSendF && in.op != kSendB && in.op != kRecvF && in.op != kRecvB) next_waits = false;
    waits_next_[i] = next_waits;
  }
  pair_end_.assign(program_.size(), 0);
  constexpr size_t kNone = static_cast<size_t>(-1);
  size_t open = kNone;  // the OVERLAP_F_B bracket open at i
  for (size_t i = 0; i < program_.size(); ++i) {
    const int64_t op = program_[i].op;
    if (op == kOverlapBegin) {
      TORCH_CHECK(open == kNone, "pipecore: instruction ", i, " opens an OVERLAP_F_B pair inside another");
      open = i;
    } else if (op == kOverlapEnd) {
      TORCH_CHECK(open != kNone, "pipecore: instruction ", i, " closes an OVERLAP_F_B pair that is not open");
      pair_end_[open] = i;
      open = kNone;
    } else {
      TORCH_CHECK(open == kNone || op <= kB, "pipecore: instruction ", i,
                  " inside an OVERLAP_F_B pair is not F, I, W or B");
    }
  }
  TORCH_CHECK(open == kNone, "pipecore: the OVERLAP_F_B pair opened at instruction ", open, " is never closed");
  mark_last_backwards();
  // a batch: a run of consecutive SEND/RECV actions; in a discovery run, also cut before each
  // receive of activations (p2p_order.py, rules 1 and 5)
  batch_end_.assign(program_.size(), 0);
  learning_end_.assign(program_.size(), 0);
  for (size_t i = program_.size(); i-- > 0;) {
    const int64_t op = program_[i].op;
    if (op >= kSendF && op <= kRecvB) {
      const bool next_comm = i + 1 < program_.size() && batch_end_[i + 1] != 0;
      batch_end_[i] = next_comm ? batch_end_[i + 1] : i + 1;
      learning_end_[i] = next_comm && program_[i + 1].op != kRecvF ? learning_end_[i + 1] : i + 1;
    }
  }
}

void Executor::set_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, std::vector<TensorSpec> send_f,
                         at::TensorOptions options) {
  set_input_specs(stage, mb, std::move(recv_f), options);
  set_output_specs(stage, mb, std::move(send_f), options);
}

void Executor::set_input_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> recv_f, at::TensorOptions options) {
  TORCH_CHECK(stage >= 0 && stage < num_stages_ && mb >= 0 && mb < num_microbatches_, "pipecore: bad spec index");
  const size_t key = stage * num_microbatches_ + mb;
  recv_f_specs_[key] = std::move(recv_f);
  options_[key] = options;
  input_known_[key] = 1;
}

void Executor::set_output_specs(int64_t stage, int64_t mb, std::vector<TensorSpec> send_f,
                                at::TensorOptions options) {
  TORCH_CHECK(stage >= 0 && stage < num_stages_ && mb >= 0 && mb < num_microbatches_, "pipecore: bad spec index");
  const size_t key = stage * num_microbatches_ + mb;
  recv_b_specs_[key].clear();  // a gradient comes back for each sent tensor that needs one
  for (const auto& sp : send_f) {
    if (sp.requires_grad) recv_b_specs_[key].push_back(sp);
  }
  send_f_specs_[key] = std::move(send_f);
  options_[key] = options;
  output_known_[key] = 1;
}

void Executor::forget_specs() {
  for (auto* specs : {&recv_f_specs_, &recv_b_specs_, &send_f_specs_}) {
    for (auto& v : *specs) v.clear();
  }
  std::fill(input_known_.begin(), input_known_.end(), 0);
  std::fill(output_known_.begin(), output_known_.end(), 0);
}

void Executor::set_shapes_travel(bool on) { shapes_travel_ = on; }

namespace {
// Same count, dtypes and ranks: one layout of capacities (gradient flags do not matter to buffers).
bool same_structure(const std::vector<TensorSpec>& a, const std::vector<TensorSpec>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].dtype != b[k].dtype || a[k].shape.size() != b[k].shape.size()) return false;
  }
  return true;
}
// A capacity of `n` elements at rank `rank`: [n, 1, ...] (buffers need the count, the header the rank).
std::vector<int64_t> capacity_shape(int64_t n, size_t rank) {
  std::vector<int64_t> shape(rank, 1);
  if (rank > 0) shape[0] = n;
  return shape;
}
// `into` takes, per tensor, the larger element count of the two (same structure assumed).
void widen(std::vector<TensorSpec>& into, const std::vector<TensorSpec>& by) {
  for (size_t k = 0; k < into.size(); ++k) {
    into[k].shape = capacity_shape(std::max(elements(into[k].shape), elements(by[k].shape)), into[k].shape.size());
  }
}
// What crossed a boundary joins its record (a message of another structure starts it anew).
void record_crossing(std::vector<TensorSpec>& crossed, std::vector<TensorSpec> message) {
  if (same_structure(crossed, message)) {
    widen(crossed, message);
  } else {
    crossed = std::move(message);
  }
}
// The widest of one stage's capacities (over its microbatches and what crossed), then each of its
// microbatches' capacities widened to it (their gradient flags kept). Nothing where they differ in
// structure: each microbatch keeps its own then.
void widen_stage(std::vector<std::vector<TensorSpec>>& specs, const std::vector<uint8_t>& known, size_t first,
                 size_t count, const std::vector<TensorSpec>& crossed) {
  std::vector<TensorSpec> widest;
  for (size_t key = first; key < first + count; ++key) {
    if (!known[key] || specs[key].empty()) continue;
    if (widest.empty()) {
      widest = specs[key];
    } else if (!same_structure(widest, specs[key])) {
      return;
    }
    widen(widest, specs[key]);
  }
  if (widest.empty()) return;
  if (same_structure(widest, crossed)) widen(widest, crossed);
  for (size_t key = first; key < first + count; ++key) {
    if (known[key] && !specs[key].empty()) widen(specs[key], widest);
  }
}
}  // namespace

void Executor::widen_capacities() {
  const size_t m = static_cast<size_t>(num_microbatches_);
  for (int64_t stage = 0; stage < num_stages_; ++stage) {
    const size_t first = static_cast<size_t>(stage) * m;
    widen_stage(recv_f_specs_, input_known_, first, m, crossed_in_[stage]);
    widen_stage(send_f_specs_, output_known_, first, m, crossed_out_[stage]);
    // the gradients that come back: of the sent tensors that need one
    for (size_t key = first; key < first + m; ++key) {
      if (!output_known_[key]) continue;
      recv_b_specs_[key].clear();
      for (const auto& sp : send_f_specs_[key]) {
        if (sp.requires_grad) recv_b_specs_[key].push_back(sp);
      }
    }
  }
}

std::vector<TensorSpec> Executor::capacity(const Instr& in) const {
  const size_t key = in.stage * num_microbatches_ + in.mb;
  switch (in.op) {
    case kRecvF:
    case kF:
      return recv_f_specs_[key];
    case kRecvB:
    case kB:
    case kI:
      return recv_b_specs_[key];
    case kSendF:
      return send_f_specs_[key];
    default: {  // kSendB: the gradients of the received tensors that need one
      std::vector<TensorSpec> specs;
      for (const auto& sp : recv_f_specs_[key]) {
        if (sp.requires_grad) specs.push_back(sp);
      }
      return specs;
    }
  }
}

void Executor::settle(CommTask& task, const Instr& action, const char* what, bool draining) {
  Instr in = action;  // the action that consumes the message (F, B, I): it came from the task's peer
  in.peer = task.peer;
  if (!task.settled) read_header(task, in, draining);
  if (draining) return;
  if (task.status == kMessageUnknown) {
    std::ostringstream os;
    os << where(in) << ": the " << what << " of microbatch " << in.mb << " from rank " << in.peer
       << (task.follow_up_failed ? " came again (grown) with other shapes than their header said"
                                 : " do not start with pipecore's header")
       << ": the messages between the two ranks are out of step (another send or receive on this process group "
          "with the same peer, or a schedule lowered differently there)";
    throw CommError(os.str());
  }
  check_message_status(task.status, in, what);
}

void Executor::read_header(CommTask& task, const Instr& consumer, bool draining) {
  if (task.settled) return;
  const Instr& in = program_[task.action];  // its RECV (waits are the consuming action's, in errors)
  const char* what = in.op == kRecvF ? "activations" : "output gradients";
  const bool exact = device_comm_ != nullptr;  // NCCL: every message at its capacity's size (comm.h)
  ShapedHeader header;
  if (device_comm_ && !host_reads_) {  // its header's copy on the host, not the data on the device
    at::Tensor bytes;
    {
      SpentOn spent(profile_, Spent::kWait);
      try {
        bytes = device_comm_->read_header(task, timeout_);
      } catch (const CommError& e) {
        throw CommError(wait_failure(consumer, what, task.peer, e.what()));
      }
    }
    task.status = read_shaped_header(bytes, task.layout, large_message_bytes_, message_bytes(task.parts), exact,
                                     header);
  } else {
    wait_task(task, consumer, what);
    task.status = read_shaped(task.parts, task.layout, large_message_bytes_, exact, header);
  }
  task.shapes = header.shapes;
  if (task.status == kMessageGrown) {
    // its data follows as a message of its own shapes (comm.h): on gloo at its own size on a tag of
    // its own, on the device path through the store
    const std::vector<TensorSpec> layout = with_shapes(task.layout, task.shapes);
    std::vector<at::Tensor> parts = exact ? follow_up_from_store(task, consumer, what, header.follow_up, draining)
                                          : follow_up_by_tag(task, layout, consumer, what, draining);
    ShapedHeader second;
    const bool same = draining || (read_shaped(parts, layout, exact ? kAlwaysPacked : large_message_bytes_, exact,
                                               second) == kMessageOk &&
                                   second.shapes == task.shapes);
    task.status = same ? kMessageOk : kMessageUnknown;
    task.follow_up_failed = !same;
    if (same && !draining) {
      // the store's is on the host: to the device on the compute stream, which reads it next (once per
      // boundary's growth)
      const at::Device device = options_[in.stage * num_microbatches_ + in.mb].device();
      task.follow_up_parts = exact ? std::vector<at::Tensor>{parts[0].to(device)} : std::move(parts);
      task.layout = layout;
    }
  }
  task.settled = true;
  if (task.status == kMessageOk && in.op == kRecvF) {
    std::lock_guard<std::mutex> lock(settle_mu_);
    record_crossing(crossed_in_[in.stage], with_shapes(task.layout, task.shapes));
    if (batch_rows_ < 0) batch_rows_ = header.rows;  // (set_batch_rows)
  }
}

std::string Executor::follow_up_key(int64_t from, int64_t to, int64_t key) {
  return std::to_string(from) + ">" + std::to_string(to) + "/" + std::to_string(key);
}

std::vector<at::Tensor> Executor::follow_up_by_tag(const CommTask& task, const std::vector<TensorSpec>& layout,
                                                   const Instr& consumer, const char* what, bool draining) {
  const Instr& in = program_[task.action];
  auto again = std::make_shared<CommTask>();
  again->send = false;
  again->layout = layout;
  const at::TensorOptions& options = options_[in.stage * num_microbatches_ + in.mb];
  // dropped unread: as an aborted step's receives, its data into the abort scratch, so that a rank
  // out of memory still releases its peer
  const at::Tensor scratch = draining ? abort_scratch(options, payload_bytes(layout)) : at::Tensor();
  again->parts = alloc_shaped(layout, options, large_message_bytes_, scratch);
  {
    std::lock_guard<std::mutex> lock(settle_mu_);  // (the halves of an OVERLAP_F_B pair settle at once)
    post_task(again, in, kFollowUpTag + task.ordinal);
  }
  wait_task(*again, consumer, what);
  return std::move(again->parts);
}

std::vector<at::Tensor> Executor::follow_up_from_store(CommTask& task, const Instr& consumer, const char* what,
                                                       int64_t key, bool draining) {
  TORCH_CHECK(follow_up_store_, where(consumer),
              ": a grown message on the device path, and no store for its follow-up");
  if (task.follow_up_taken) return {};  // (a failure after taking it, e.g. out of memory: this is its drain)
  const std::string name = follow_up_key(task.peer, rank_, key);
  std::vector<uint8_t> bytes;
  {
    SpentOn spent(profile_, Spent::kWait);
    try {
      follow_up_store_->wait({name}, timeout_);  // set by the sender before it posted the header
      bytes = follow_up_store_->get(name);
      follow_up_store_->deleteKey(name);
    } catch (const std::exception& e) {
      throw CommError(wait_failure(consumer, what, task.peer, e.what()));
    }
  }
  task.follow_up_taken = true;
  if (draining) return {};  // taken from the store, not read
  auto host = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  return {host};
}

bool Executor::learn_specs(const Instr& in, bool aborted) {
  const size_t key = in.stage * num_microbatches_ + in.mb;
  const bool input = in.op == kRecvF;
  auto& known = input ? input_known_ : output_known_;
  if (known[key]) return true;
  TORCH_CHECK(spec_source_ != nullptr, where(in), ": no shapes known for this message");
  int64_t answer;
  {
    SpentOn spent(profile_, Spent::kWait);  // for the peer's forward that makes them known
    answer = (*spec_source_)(in.stage, in.mb, input ? kRecvF : kSendF, !aborted || abort_may_wait_);
  }
  if (answer == kSpecsTimedOut) {
    abort_may_wait_ = false;  // the rest of an aborted run does not wait a timeout per receive
    std::ostringstream os;
    os << where(in) << ": the shapes of microbatch " << in.mb << "'s activations did not arrive from rank "
       << in.peer << " within " << timeout_.count() / 1000.0
       << " s (its forward of the first step with this batch shape did not finish: a first forward that "
          "compiles or loads for longer needs a larger timeout=)";
    throw CommError(os.str());
  }
  if (answer == kSpecsSet) {
    TORCH_CHECK(known[key], where(in), ": the spec source answered without setting the shapes");
    return true;
  }
  // absent: no message travels for it, in this run or its aborted rest
  if (input) {
    recv_f_specs_[key].clear();
  } else {
    recv_b_specs_[key].clear();
    send_f_specs_[key].clear();
  }
  known[key] = 1;
  if (input && !aborted) {
    std::ostringstream os;
    os << where(in) << ": rank " << in.peer << "'s step failed before it produced the activations of microbatch "
       << in.mb;
    throw PeerAbort(os.str());
  }
  return false;
}

std::string Executor::where(const Instr& in) const {
  std::ostringstream os;
  os << "pipecore rank " << rank_ << ", action " << labels_[in.label];
  return os.str();
}

void Executor::reset() {
  recvs_posted_ = 0;
  recvs_reached_ = 0;
  ahead_bytes_ = 0;
  ahead_bytes_of_.assign(recv_instrs_.size(), 0);
  threaded_posts_ = posted_here_ = 0;
  reverse_posts_ = 0;
  sent_messages_ = sent_parts_ = grown_messages_ = 0;
  sent_to_.clear();
  received_from_.clear();
  if constexpr (kTesting) recv_posted_at_.assign(recv_instrs_.size(), -1);
  for (auto& s : slots_) s = Slot();
  sends_->clear_failure();
  sends_->reset_peak();
  last_send_posted_ = -1;
  posted_through_ = 0;
  kept_.clear();
}

int64_t Executor::peak_send_bytes() const { return sends_->peak_bytes(); }

void Executor::wait_recv(Inbox& inbox, const Instr& in, const char* what) {
  if (inbox.task && (!device_comm_ || host_reads_)) wait_task(*inbox.task, in, what);  // the device waits on its own
}

const std::vector<at::Tensor>& Executor::receive(Inbox& inbox, const Instr& in, const char* what) {
  if (device_comm_ && !host_reads_) {
    if (shapes_travel_) settle(*inbox.task, in, what, /*draining=*/false);  // the host reads its header
    try {
      SpentOn spent(profile_, Spent::kWait);
      device_comm_->consume(*inbox.task);  // (a trailer's status folds on the device, read at the step's end)
    } catch (const CommError& e) {  // a consume that waits on the host (host_device_comm.cpp)
      throw CommError(wait_failure(in, what, inbox.task->peer, e.what()));
    }
  } else if (shapes_travel_) {
    settle(*inbox.task, in, what, /*draining=*/false);  // (waits for it)
  } else {
    wait_task(*inbox.task, in, what);
    Instr from = in;  // (a consuming action names no peer)
    from.peer = inbox.task->peer;
    check_message(inbox.task->parts, from, what);
  }
  return inbox.task->follow_up_parts.empty() ? inbox.task->parts : inbox.task->follow_up_parts;
}

void Executor::wait_task(CommTask& task, const Instr& in, const char* what) {
  SpentOn spent(profile_, Spent::kWait);
  if (task.queued) await_posted(task, in);
  if (device_comm_) device_comm_->waited_on_host(task);  // (only a discovery run waits here on that path)
  for (auto& work : task.works) {
    if (!work) continue;
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw CommError(wait_failure(in, what, task.peer, e.what()));
    }
    work.reset();
  }
  task.works.clear();
}

std::string Executor::wait_failure(const Instr& in, const char* what, int peer, const char* why) const {
  std::ostringstream os;
  os << where(in) << ": waiting for " << what << " of microbatch " << in.mb << " from rank " << peer << " failed (timeout "
     << timeout_.count() / 1000.0 << " s): " << why;
  return os.str();
}

void Executor::check_device_status() {
  int64_t status = kMessageOk;
  if (!device_comm_->finish_step(timeout_, status)) {
    std::ostringstream os;
    os << "pipecore rank " << rank_ << ": the step's work on the device did not finish within "
       << timeout_.count() / 1000.0 << " s (a peer stopped sending or receiving)";
    throw CommError(os.str());
  }
  if (status == kMessageUnknown) throw CommError(device_status_text(status));
  if (status == kMessageReplan) throw PeerReplan(device_status_text(status));
  if (status == kMessageAborted) throw PeerAbort(device_status_text(status));
}

std::string Executor::device_status_text(int64_t status) const {
  std::ostringstream os;
  os << "pipecore rank " << rank_ << ": ";
  if (status == kMessageUnknown) {
    os << "a message received in this step does not end with pipecore's trailer: the messages between this rank "
          "and a peer are out of step (another send or receive on this process group with the same peer, or a "
          "schedule lowered differently there)";
  } else if (status == kMessageReplan) {
    os << "messages of this step say a first stage's batch changed shape";
  } else {
    os << "messages of this step say a peer's step was aborted";
  }
  return os.str();
}

void Executor::check_message(const std::vector<at::Tensor>& parts, const Instr& in, const char* what) {
  const int64_t status = message_status(parts);
  if (status == kMessageUnknown) {  // not this rank's error: the channel to the peer is out of step
    std::ostringstream os;
    os << where(in) << ": the " << what << " of microbatch " << in.mb << " from rank " << in.peer
       << " do not end with pipecore's trailer: the messages between the two ranks are out of step (another "
          "send or receive on this process group with the same peer, or a schedule lowered differently there)";
    throw CommError(os.str());
  }
  check_message_status(status, in, what);
}

void Executor::check_message_status(int64_t status, const Instr& in, const char* what) {
  if (status == kMessageReplan) {
    std::ostringstream os;
    os << where(in) << ": the " << what << " of microbatch " << in.mb << " say a first stage's batch changed shape";
    throw PeerReplan(os.str());
  }
  if (status == kMessageAborted) {
    std::ostringstream os;
    os << where(in) << ": the " << what << " of microbatch " << in.mb << " say the sender's step was aborted";
    throw PeerAbort(os.str());
  }
}

std::shared_ptr<CommTask> Executor::make_recv(const Instr& in, bool aborted) {
  const size_t key = in.stage * num_microbatches_ + in.mb;
  const bool activations = in.op == kRecvF;
  // output gradients whose shapes were never learnt: this stage's forward did not run, nothing comes
  if (activations ? !learn_specs(in, aborted) : !output_known_[key]) return nullptr;
  const auto& specs = activations ? recv_f_specs_[key] : recv_b_specs_[key];
  if (specs.empty()) return nullptr;  // nothing of the message needs a gradient, or it never comes
  auto task = std::make_shared<CommTask>();
  task->send = false;
  // allocated before anything records the receive as posted: a failed allocation leaves it unposted
  const at::Tensor scratch = aborted ? abort_scratch(options_[key], payload_bytes(specs)) : at::Tensor();
  task->parts = shapes_travel_ ? alloc_shaped(specs, options_[key], large_message_bytes_, scratch)
                               : alloc_frame(specs, options_[key], large_message_bytes_, scratch);
  if (shapes_travel_) {
    task->layout = specs;
    if (device_comm_) task->header_bytes = shaped_header_bytes(specs);  // read by the host (device_comm.h)
  }
  Slot& s = slot(in.stage, in.mb);
  (activations ? s.recv_f : s.recv_b).task = task;
  return task;
}

void Executor::post_recvs_until(size_t end, size_t at, bool aborted) {
  if (recvs_posted_ >= end) return;
  SpentOn spent(profile_, Spent::kPost);
  while (recvs_posted_ < end) {
    const Instr& in = program_[recv_instrs_[recvs_posted_]];
    // a failed allocation leaves the receive unposted (an aborted step posts it); once posting
    // starts it counts as posted: a posting failure breaks the group, and parts must not go twice
    std::shared_ptr<CommTask> task = make_recv(in, aborted);
    if constexpr (kTesting) recv_posted_at_[recvs_posted_] = static_cast<int64_t>(at);
    ++recvs_posted_;
    if (!task) continue;
    maybe_delay();
    task->action = recv_instrs_[recvs_posted_ - 1];
    task->ordinal = received_from_[static_cast<int>(in.peer)]++;  // (a grown message's follow-up tag)
    post_task(task, in);
  }
}

at::Tensor Executor::abort_scratch(const at::TensorOptions& options, int64_t bytes, bool for_sends) {
  // sends have their own: a receive dropped unread waits (on the device) for its own transfer only,
  // not for a later send's from the same block (stream_contract.h, rule 3)
  at::Tensor& scratch = for_sends ? abort_send_scratch_ : abort_scratch_;
  if (!scratch.defined() || scratch.device() != options.device() || scratch.numel() < bytes) {
    // zeros: on a device, compute may run on an aborted message before its status is read
    scratch = at::zeros({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  return scratch;
}

void Executor::prefetch_recvs(size_t at) {
  const size_t reached = recvs_through_[at];
  for (; recvs_reached_ < std::min(reached, recvs_posted_); ++recvs_reached_) {
    ahead_bytes_ -= ahead_bytes_of_[recvs_reached_];
  }
  const size_t end = std::min(reached + static_cast<size_t>(recv_window_), recv_instrs_.size());
  while (recvs_posted_ < end) {
    const size_t k = recvs_posted_;
    // a receive behind a send to its peer that has not run yet waits (in-order backends)
    if (!recv_past_sends_ && send_before_recv_[k] >= static_cast<int64_t>(at)) return;
    if (k >= reached) {  // ahead of the program: within the byte budget, or the next one
      const Instr& in = program_[recv_instrs_[k]];
      const size_t key = in.stage * num_microbatches_ + in.mb;
      const int64_t bytes = payload_bytes(in.op == kRecvF ? recv_f_specs_[key] : recv_b_specs_[key]);
      if (k > reached && ahead_bytes_ + bytes > recv_window_bytes_) return;
      ahead_bytes_of_[k] = bytes;
      ahead_bytes_ += bytes;
    }
    post_recvs_until(k + 1, at);
  }
}

bool Executor::set_device_comm(const std::string& device) {
  device_comm_ = make_device_comm(c10::Device(device));
  if (device_comm_) shapes_travel_ = false;  // (set_shapes_travel)
  return device_comm_ != nullptr;
}

#ifdef PIPECORE_TESTING
void Executor::emulate_device_comm() {
  device_comm_ = make_host_device_comm(timeout_);
  shapes_travel_ = false;
}
std::vector<std::string> Executor::stream_violations() const {
  return device_comm_ ? device_comm_->contract_violations() : std::vector<std::string>();
}
#endif

void Executor::post_batch(size_t index, bool aborted, int64_t status) {
  if (index < posted_through_) return;  // posted with an earlier action of its batch
  // a discovery run cuts before each later receive of activations, whose shapes may come from the
  // forward of a message the group sends (p2p_order.py, rule 5)
  const size_t end = (host_reads_ ? learning_end_ : batch_end_)[index];
  TORCH_CHECK(end > index, "pipecore: action ", index, " is not a send or receive");
  SpentOn spent(profile_, Spent::kPost);
  std::vector<std::shared_ptr<CommTask>> tasks;
  std::vector<size_t> task_index;  // tasks[k] is program_[task_index[k]]'s message
  std::vector<std::pair<int64_t, std::vector<TensorSpec>>> crossings;  // shaped SEND_Fs': (stage, shapes)
  std::vector<std::pair<std::string, at::Tensor>> follow_ups;  // grown device messages': (store key, bytes)
  for (size_t j = index; j < end; ++j) {
    const Instr& in = program_[j];
    std::shared_ptr<CommTask> task;
    if (in.op == kRecvF || in.op == kRecvB) {
      task = make_recv(in, aborted);
      if constexpr (kTesting) recv_posted_at_[recvs_through_[j] - 1] = static_cast<int64_t>(index);
      if (task) task->action = static_cast<int64_t>(j);
    } else {
      std::vector<TensorSpec> crossing;
      std::vector<at::Tensor> follow_up;
      int64_t key = 0;
      std::vector<at::Tensor> parts = message_of(in, aborted, status, &follow_up, &crossing, &key);
      if (parts.empty()) continue;
      if (!crossing.empty()) crossings.emplace_back(in.stage, std::move(crossing));
      if (!follow_up.empty()) follow_ups.emplace_back(follow_up_key(rank_, in.peer, key), follow_up.front());
      task = std::make_shared<CommTask>();
      task->parts = std::move(parts);
    }
    if (!task) continue;
    task->peer = static_cast<int>(in.peer);
    task->tag = kTag;
    task->group = pg_.get();
    tasks.push_back(std::move(task));
    task_index.push_back(j);
  }
  posted_through_ = end;  // once posting starts nothing of it is posted again
  // in the store before their headers go: their receivers wait for them
  for (const auto& [name, bytes] : follow_ups) {
    TORCH_CHECK(follow_up_store_, where(program_[index]), ": a grown message on the device path, and no store "
                "for its follow-up");
    const auto* data = static_cast<const uint8_t*>(bytes.data_ptr());
    try {
      follow_up_store_->set(name, std::vector<uint8_t>(data, data + bytes.numel()));
    } catch (const std::exception& e) {
      throw CommError(where(program_[index]) + ": leaving a grown message's follow-up in the store failed: " +
                      e.what());
    }
    ++grown_messages_;
  }
  if (tasks.empty()) return;
  maybe_delay();
  try {
    device_comm_->post_batch(*pg_, tasks);
  } catch (const std::exception& e) {
    throw post_failure(*tasks.front(), program_[index], e.what());
  }
  for (size_t k = 0; k < tasks.size(); ++k) {
    if (!tasks[k]->send) continue;
    ++sent_messages_;
    sent_parts_ += static_cast<int64_t>(tasks[k]->parts.size());
    const Instr& in = program_[task_index[k]];
    const int64_t bytes = message_bytes(tasks[k]->parts);
    sends_->track(std::move(tasks[k]), bytes, where(in) + ": send to rank " + std::to_string(in.peer), timeout_);
  }
  // posted: the receivers read them, in this run or its aborted rest, and record them alike
  for (auto& [stage, crossing] : crossings) record_crossing(crossed_out_[stage], std::move(crossing));
}

std::vector<at::Tensor> Executor::message_of(const Instr& in, bool aborted, int64_t status,
                                             std::vector<at::Tensor>* follow_up, std::vector<TensorSpec>* crossing,
                                             int64_t* key) {
  const at::TensorOptions& options = options_[in.stage * num_microbatches_ + in.mb];
  const bool exact = device_comm_ != nullptr;  // NCCL: a message at its capacity's size (comm.h)
  if (aborted) {
    const std::vector<TensorSpec> specs = send_specs(in);
    if (specs.empty()) return {};
    // (a message without data on gloo is its header: no scratch)
    const at::Tensor scratch =
        shapes_travel_ && !exact ? at::Tensor() : abort_scratch(options, payload_bytes(specs), /*for_sends=*/true);
    if (shapes_travel_) return frame_shaped({}, specs, large_message_bytes_, status, 0, options, exact, scratch);
    return abort_frame(specs, options, status, large_message_bytes_, scratch);
  }
  std::vector<at::Tensor> tensors = outgoing(in);
  if (tensors.empty()) return {};
  if (shapes_travel_) {
    const std::vector<TensorSpec> cap = capacity(in);
    TORCH_CHECK(tensors.size() == cap.size(), where(in), ": a message of ", tensors.size(), " tensors where ",
                cap.size(), " were planned");
    std::vector<TensorSpec> sent = with_shapes(cap, shapes_of(tensors));
    const int64_t rows = std::max<int64_t>(batch_rows_, 0);
    const bool fits = fits_capacity(sent, cap, large_message_bytes_);
    int64_t follow_up_key = 0;
    if (!fits) {  // its header now (status grown, its shapes), then the message at its own size
      TORCH_CHECK(follow_up != nullptr, where(in), ": a grown message without a follow-up");
      if (exact) {  // through the store, from the host (set_follow_up_store)
        TORCH_CHECK(key != nullptr, where(in), ": a grown device message without a key");
        std::vector<at::Tensor> host;
        for (const auto& t : tensors) host.push_back(t.detach().cpu());  // (waits for the device: once per growth)
        *follow_up = frame_shaped(host, sent, kAlwaysPacked, kMessageOk, rows, at::TensorOptions());
        follow_up_key = *key = ++follow_ups_to_[static_cast<int>(in.peer)];
      } else {
        *follow_up = frame_shaped(tensors, sent, large_message_bytes_, kMessageOk, rows, options);
      }
    }
    const at::Tensor scratch =
        !fits && exact ? abort_scratch(options, payload_bytes(cap), /*for_sends=*/true) : at::Tensor();
    std::vector<at::Tensor> parts = frame_shaped(tensors, cap, large_message_bytes_, fits ? kMessageOk : kMessageGrown,
                                                 rows, options, exact, scratch, follow_up_key);
    if (in.op == kSendF && crossing != nullptr) *crossing = std::move(sent);
    return parts;
  }
  if (!device_comm_) return frame(tensors, large_message_bytes_);
  // the device path's trailers carry the step status on (device_comm.h)
  return frame(tensors, large_message_bytes_, [this](at::Tensor& trailer) { device_comm_->write_trailer(trailer); });
}

std::vector<TensorSpec> Executor::send_specs(const Instr& in) {
  const size_t key = in.stage * num_microbatches_ + in.mb;
  if (in.op == kSendF) return learn_specs(in, /*aborted=*/true) ? send_f_specs_[key] : std::vector<TensorSpec>();
  std::vector<TensorSpec> specs;
  if (!input_known_[key]) return specs;  // its activations never came: no gradients go back
  for (const auto& sp : recv_f_specs_[key]) {
    if (sp.requires_grad) specs.push_back(sp);
  }
  return specs;
}

std::vector<at::Tensor> Executor::outgoing(const Instr& in) {
  Slot& s = slot(in.stage, in.mb);
  if (in.op == kSendB) return take_input_grads(s);
  TORCH_CHECK(!s.outputs.empty(), where(in), ": nothing to send (forward produced no tensors)");
  // The slot lets go of the outputs: the message keeps the data alive until sent, the autograd graph
  // lives on through the stored gradient edges.
  std::vector<at::Tensor> tensors = std::move(s.outputs);
  s.outputs.clear();
  if (free_outputs_) {
    ++freed_outputs_;
  } else {
    kept_.insert(kept_.end(), tensors.begin(), tensors.end());
  }
  return tensors;
}

void Executor::set_comm_thread(bool on) {
  if (!on) {
    worker_.reset();
  } else if (!worker_) {
    worker_ = std::make_unique<CommWorker>();
  }
}

void Executor::post_task(const std::shared_ptr<CommTask>& task, const Instr& in, int tag, bool here_if_idle) {
  task->peer = static_cast<int>(in.peer);
  task->tag = tag;
  task->group = pg_.get();
  if (reverse_ && (task->send ? in.peer < rank_ : in.peer > rank_)) {  // travels to a lower rank
    task->channel = reverse_.get();
    if constexpr (kTesting) ++reverse_posts_;
  }
  bool here = !worker_;
  try {
    if (!worker_) {
      post_parts(*task);
    } else if (here_if_idle) {
      here = worker_->post_if_idle(*task);
      posted_here_ += here;
    }
  } catch (const std::exception& e) {
    throw post_failure(*task, in, e.what());
  }
  if (!here) {
    task->queued = true;
    worker_->queue(task);
    ++threaded_posts_;
    return;
  }
  task->mark_posted(nullptr);
}

CommError Executor::post_failure(const CommTask& task, const Instr& in, const std::string& text) const {
  return CommError(where(in) + ": " + (task.send ? "sending to" : "receiving from") + " rank " +
                   std::to_string(task.peer) + " failed: " + text);
}

void Executor::await_posted(CommTask& task, const Instr& in) {
  if (!task.wait_posted(timeout_)) {
    std::ostringstream os;
    os << where(in) << ": " << (task.send ? "a send to" : "a receive from") << " rank " << task.peer
       << " was not posted within " << timeout_.count() / 1000.0 << " s (the group's posting is stuck)";
    throw CommError(os.str());
  }
  if (task.error) throw post_failure(task, in, error_text(task.error));
}

void Executor::send(std::vector<at::Tensor> parts, size_t index, bool budgeted, bool aborted, int tag) {
  const Instr& in = program_[index];
  const int64_t bytes = message_bytes(parts);
  bool reserved = true;
  if (budgeted) {
    SpentOn spent(profile_, Spent::kWait);
    reserved = sends_->reserve(static_cast<int>(in.peer), bytes, send_budget_, timeout_);
  }
  if (!reserved) {
    std::ostringstream os;
    os << where(in) << ": earlier sends to rank " << in.peer << " did not complete within "
       << timeout_.count() / 1000.0 << " s (the peer stopped receiving)";
    throw CommError(os.str());
  }
  if (!aborted) check_sends();  // an aborted step still releases every peer it can
  auto task = std::make_shared<CommTask>();
  task->parts = std::move(parts);
  if (tag == 0) {
    ++sent_messages_;
    ++sent_to_[static_cast<int>(in.peer)];  // (a grown message's follow-up tag)
  } else {
    ++grown_messages_;
  }
  sent_parts_ += static_cast<int64_t>(task->parts.size());
  maybe_delay();
  // the thread waits for a message next anyway: posting here spares the message the worker's wake-up
  post_task(task, in, tag, tag == 0 && waits_next_[index] && bytes <= kPostHereBytes);
  last_send_posted_ = static_cast<int64_t>(index);
  sends_->track(std::move(task), bytes, where(in) + ": send to rank " + std::to_string(in.peer), timeout_,
                /*aside=*/tag != 0);
}

void Executor::check_sends() {
  if (sends_->failed()) throw CommError(sends_->failure());
}

void Executor::drain_sends() {
  SpentOn spent(profile_, Spent::kWait);
  if (!sends_->drain(timeout_)) {
    std::ostringstream os;
    os << "pipecore rank " << rank_ << ": sends of this step did not complete within " << timeout_.count() / 1000.0
       << " s (a peer stopped receiving)";
    throw CommError(os.str());
  }
  check_sends();
}

#ifdef PIPECORE_TESTING
void Executor::maybe_delay() {
  if (delay_us_ <= 0) return;
  std::uniform_int_distribution<int64_t> dist(0, delay_us_);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng_)));
}
#endif

void Executor::run(const ForwardFn& forward, const AbortFn& on_abort, const SpecFn* discover) {
  // A discovery run posts no receive ahead: a receive's shapes are known only once its sender's
  // forward ran. On the device path its batches still go as one group each, at their first action
  // (NCCL may serialise a group's operations: posted one by one, a send and a receive that cross
  // between two ranks would wait for each other), their receives' shapes learnt first; the host
  // reads each message (its trailer says whether the peer's step was aborted or its shapes
  // changed) and waits for it. Everything is put back however the run ends.
  struct Discovering {
    Executor& ex;
    int64_t window;
    ~Discovering() {
      ex.host_reads_ = false;
      ex.recv_window_ = window;
      ex.spec_source_ = nullptr;
    }
  } discovering{*this, recv_window_};
  if (discover) {
    recv_window_ = 0;
    spec_source_ = discover;
    host_reads_ = device_comm_ != nullptr;
  }
  reset();
  if (shapes_travel_) widen_capacities();
  struct Profiled {  // the run's time, however it ends
    StepProfile& profile;
    ~Profiled() { profile.end(); }
  } profiled{profile_};
  profile_.begin(profile_on_);
  comm_failure_.clear();
  freed_outputs_ = 0;
  trace_.clear();
  forward_ = &forward;
  if (trace_on_ && timer_) timer_->start(now_us());
  trace_resolved_ = !timer_;
  if (device_comm_) device_comm_->begin_step();
  size_t i = 0;
  std::exception_ptr origin;  // this rank's own failure
  std::string failure;        // what stopped the normal run
  enum { kNone, kOrigin, kPeer, kReplan, kComm } why = kNone;
  try {
    for (; i < program_.size(); ++i) {
      check_sends();
      if (!device_comm_) prefetch_recvs(i);  // the device path posts receives with their batch
      if (program_[i].op == kOverlapBegin) {
        i = exec_pair(i);  // on failure, i is the failed action's
      } else {
        exec_traced(i, forward);
      }
    }
    drain_sends();
    if (device_comm_) check_device_status();
  } catch (const PeerAbort& e) {
    why = kPeer;
    failure = e.what();
  } catch (const PeerReplan& e) {
    why = kReplan;
    failure = e.what();
  } catch (const CommError& e) {
    why = kComm;
    failure = e.what();
  } catch (...) {
    why = kOrigin;
    origin = std::current_exception();
  }
  const std::string action = i < program_.size() ? labels_[program_[i].label] : std::string("end of step");
  int64_t status = kMessageOk;
  auto read_status = [&] {  // false where the status cannot be read: this rank's error stands
    try {
      return device_comm_->finish_step(timeout_, status);
    } catch (...) {
      return false;
    }
  };
  if (why == kOrigin && device_comm_ && read_status() && status != kMessageOk) {
    // The device path computes on what arrived before its status is known: on a peer's aborted or
    // "shapes changed" message (zeros of the old shapes) a stage or the loss may fail (this step's
    // targets against the old shapes). Then the status says what happened; this error is its echo.
    why = status == kMessageReplan ? kReplan : status == kMessageAborted ? kPeer : kComm;
    failure = device_status_text(status) + " (here that made action " + action + " fail: " + error_text(origin) + ")";
  }
  if (why == kNone) {
    for (auto& s : slots_) s = Slot();  // the step is done: drop graphs, buffers, received tensors
    kept_.clear();
    abort_send_scratch_ = at::Tensor();  // (grown device messages' parts: sends in flight keep theirs)
    return;
  }
  // Abort: drop this step's compute state, tell whoever listens, then run the rest of the program
  // without compute so that every peer gets every message it waits for.
  if (why == kOrigin && on_abort) {
    try {
      on_abort(error_text(origin), action);
    } catch (...) {
    }
  }
  for (auto& s : slots_) {  // graphs and activations are not needed any more
    s.out_edges.clear();
    s.loss_edge = torch::autograd::Edge();
    s.outputs.clear();
    s.weight = WeightWork();
    s.input_grads.clear();
    s.out_grads.clear();
  }
  // after a broken connection or a timeout, waiting again could take a timeout per receive:
  // only post the sends then. Action i runs again aborted: it may have failed before posting.
  const std::string comm_failure =
      finish_aborted(i, /*wait=*/why != kComm, why == kReplan ? kMessageReplan : kMessageAborted);
  kept_.clear();
  if (why == kOrigin) {
    comm_failure_ = comm_failure;
    std::rethrow_exception(origin);
  }
  if (why == kComm) throw CommError(failure);
  if (!comm_failure.empty()) throw CommError(failure + "; then: " + comm_failure);
  if (why == kReplan) throw PeerReplan(failure);
  throw PeerAbort(failure);
}

void Executor::run_aborted(int64_t status) {
  reset();
  if (shapes_travel_) widen_capacities();
  const std::string comm_failure = finish_aborted(0, /*wait=*/true, status);
  if (!comm_failure.empty()) throw CommError(comm_failure);
}

std::string Executor::finish_aborted(size_t from, bool wait, int64_t status) {
  // The rest of the program without compute: receives posted and drained, sends carry `status`.
  std::string comm_failure;
  abort_may_wait_ = wait;
  for (size_t j = from; j < program_.size(); ++j) {
    try {
      exec_aborted(j, wait, status);
    } catch (const std::exception& e) {
      if (comm_failure.empty()) comm_failure = e.what();
    }
  }
  if (wait) {
    try {
      drain_sends();
    } catch (const std::exception& e) {
      if (comm_failure.empty()) comm_failure = e.what();
    }
  }
  for (auto& s : slots_) s = Slot();
  abort_scratch_ = abort_send_scratch_ = at::Tensor();  // in-flight sends keep theirs alive as long as needed
  return comm_failure;
}

std::vector<uint8_t> Executor::stage_mask(const std::vector<int64_t>& stages) const {
  std::vector<uint8_t> mask(num_stages_, 0);
  for (int64_t s : stages) {
    TORCH_CHECK(s >= 0 && s < num_stages_, "pipecore: stage ", s, " outside this executor's ", num_stages_, " stages");
    mask[s] = 1;
  }
  return mask;
}

void Executor::set_stage_events(std::vector<int64_t> stages, StageEventFn fn) {
  evented_ = stage_mask(stages);
  stage_event_ = stages.empty() ? StageEventFn() : std::move(fn);
  mark_last_backwards();
}

void Executor::set_weight_builders(std::vector<int64_t> stages, WeightBuilderFn builder) {
  builds_weight_ = stage_mask(stages);
  weight_builder_ = stages.empty() ? WeightBuilderFn() : std::move(builder);
}

void Executor::mark_last_backwards() {
  // Each stage's last action that accumulates weight gradients before its REDUCE_GRAD (lowering puts
  // REDUCE_GRAD after it): its last B or W, or, for a stage whose backward runs whole at I, its last
  // B or I.
  last_backward_of_.assign(program_.size(), -1);
  for (size_t j = 0; j < program_.size(); ++j) {
    if (program_[j].op != kReduceGrad) continue;
    const int64_t stage = program_[j].stage;
    const bool whole = evented(stage);
    for (size_t i = j; i-- > 0;) {
      const int64_t op = program_[i].op;
      if ((op == kB || op == (whole ? kI : kW)) && program_[i].stage == stage) {
        last_backward_of_[i] = stage;
        break;
      }
    }
  }
}

void Executor::set_trace(bool on, const std::string& device) {
  trace_on_ = on;
  const c10::Device dev(device);
  timer_.reset();
  if (on && !dev.is_cpu()) timer_ = std::make_unique<DeviceTimer>(dev);
}

double Executor::trace_time() { return timer_ ? static_cast<double>(timer_->mark()) : now_us(); }

const std::vector<Executor::TraceEvent>& Executor::trace() {
  if (!trace_resolved_ && timer_) {
    for (auto& e : trace_) {
      e.start_us = timer_->host_us(static_cast<size_t>(e.start_us));
      e.end_us = timer_->host_us(static_cast<size_t>(e.end_us));
    }
  }
  trace_resolved_ = true;
  return trace_;
}

void Executor::exec_traced(size_t i, const ForwardFn& forward) {
  if (!trace_on_) {
    exec(i, forward);
    return;
  }
  double t0 = trace_time();
  exec(i, forward);
  trace_.push_back({program_[i].label, t0, trace_time(), 0});
}

void Executor::exec_aborted(size_t index, bool wait, int64_t status) {
  const Instr& in = program_[index];
  switch (in.op) {
    case kRecvF:
    case kRecvB:  // post (unless posted ahead): the peer's send must complete
      if (device_comm_) {
        post_batch(index, /*aborted=*/true, status);
      } else {
        post_recvs_until(recvs_through_[index], index, /*aborted=*/true);
      }
      break;
    case kF:
    case kB:
    case kI: {  // drain what this action would have consumed
      Slot& s = slot(in.stage, in.mb);
      Inbox& inbox = in.op == kF ? s.recv_f : s.recv_b;
      const char* what = in.op == kF ? "activations" : "output gradients";
      if (wait && shapes_travel_ && inbox.task) {
        // waited for and read: its header says whether it comes again (grown) and what crossed, as
        // the sender counts it
        settle(*inbox.task, in, what, /*draining=*/true);
      } else if (wait) {
        wait_recv(inbox, in, what);
      }
      inbox = Inbox();
      break;
    }
    case kSendF:
    case kSendB: {
      if (device_comm_) {
        post_batch(index, /*aborted=*/true, status);
        break;
      }
      if (static_cast<int64_t>(index) == last_send_posted_) break;  // the failure came after its send
      std::vector<at::Tensor> parts = message_of(in, /*aborted=*/true, status);
      if (!parts.empty()) send(std::move(parts), index, /*budgeted=*/wait, /*aborted=*/true);
      break;
    }
    default:
      break;
  }
}

void Executor::exec(size_t index, const ForwardFn& forward) {
  const Instr& in = program_[index];
  ActionScope scope(labels_[in.label]);
  if (last_backward_of_[index] >= 0) {
    // A dw_builder's runner writes .grad outside the engine, after the hooks that send buckets: such a
    // stage's buckets all go at its REDUCE_GRAD.
    if (reducer_ && !builds_weight(in.stage)) reducer_->arm(in.stage);
    stage_event(kLastBackwardEvent, in.stage);
  }
  switch (in.op) {
    case kF:
      do_forward(in, forward);
      break;
    case kB:
      do_backward(in, /*split=*/false);
      break;
    case kI:
      do_backward(in, /*split=*/true);
      break;
    case kW:
      do_weight(in);
      break;
    case kRecvF:
    case kRecvB:  // usually posted ahead already (recv window)
      if (device_comm_) {
        post_batch(index, /*aborted=*/false);
      } else {
        post_recvs_until(recvs_through_[index], index);
      }
      break;
    case kSendF:
    case kSendB: {
      if (device_comm_) {
        post_batch(index, /*aborted=*/false);
        break;
      }
      SpentOn spent(profile_, Spent::kPost);
      std::vector<at::Tensor> follow_up;
      std::vector<TensorSpec> crossing;
      std::vector<at::Tensor> parts = message_of(in, /*aborted=*/false, 0, &follow_up, &crossing);
      const int ordinal = sent_to_[static_cast<int>(in.peer)];  // this message's among those to its peer
      if (!parts.empty()) send(std::move(parts), index);
      if (!follow_up.empty()) {
        // outside the peer's budget: it completes when the receiver reads the message, which later
        // sends must not wait for
        send(std::move(follow_up), index, /*budgeted=*/false, /*aborted=*/false, kFollowUpTag + ordinal);
      }
      // posted: the receiver reads it, in this run or its aborted rest, and records it alike
      if (!crossing.empty()) record_crossing(crossed_out_[in.stage], std::move(crossing));
      break;
    }
    case kReduceGrad:
      if (reducer_) reducer_->reduce_stage(in.stage);
      stage_event(kReduceGrad, in.stage);
      break;
    case kUnshard:
    case kReshard:
      stage_event(in.op, in.stage);
      break;
    case kOverlapBegin:
    case kOverlapEnd:
      break;
    default:
      TORCH_CHECK(false, "pipecore: unknown opcode ", in.op);
  }
}

void Executor::do_forward(const Instr& in, const ForwardFn& forward) {
  Slot& s = slot(in.stage, in.mb);
  const size_t key = in.stage * num_microbatches_ + in.mb;
  if (s.recv_f.posted()) {
    const auto& specs = recv_f_specs_[key];
    const auto& parts = receive(s.recv_f, in, "activations");
    s.inputs = shapes_travel_ ? unframe_shaped(parts, s.recv_f.task->layout, s.recv_f.task->shapes)
                              : unframe(parts, specs);
    for (size_t k = 0; k < specs.size(); ++k) {
      if (specs[k].requires_grad) s.inputs[k].requires_grad_(true);
    }
    s.recv_f = Inbox();
  }
  at::Tensor loss;
  double seed = 1.0;
  s.outputs.clear();
  {
    SpentOn spent(profile_, Spent::kForward);
    forward(in.stage, in.mb, s.inputs, s.outputs, loss, seed);
  }
  s.out_edges.clear();
  for (const auto& t : s.outputs) {
    if (t.defined() && t.requires_grad()) s.out_edges.push_back(torch::autograd::impl::gradient_edge(t));
  }
  if (next_local_[in.stage] >= 0) {
    // the next stage lives on this rank: its inputs are new leaves over these outputs
    Slot& dst = slot(next_local_[in.stage], in.mb);
    dst.inputs.clear();
    for (const auto& t : s.outputs) {
      at::Tensor leaf = t.detach();
      if (t.requires_grad()) leaf.requires_grad_(true);
      dst.inputs.push_back(leaf);
    }
    s.outputs.clear();
  }
  if (loss.defined()) {
    s.has_loss = true;
    if (loss.requires_grad()) {
      s.loss_edge = torch::autograd::impl::gradient_edge(loss);
      // zero unless every message of the step so far was ok
      if (device_comm_ && loss.device().type() == device_comm_->device_type()) {
        s.loss_seed = at::empty_like(loss);
        device_comm_->fill_seed(s.loss_seed, seed);
      } else {
        s.loss_seed = at::full_like(loss, seed);
      }
    }
  }
}

void Executor::do_backward(const Instr& in, bool split) {
  Slot& s = slot(in.stage, in.mb);
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> grads;
  if (s.has_loss) {
    if (s.loss_edge.is_valid()) {
      roots.push_back(s.loss_edge);
      grads.push_back(s.loss_seed);
    }
  } else {
    if (s.recv_b.posted()) {
      const auto& parts = receive(s.recv_b, in, "output gradients");
      s.out_grads = shapes_travel_ ? unframe_shaped(parts, s.recv_b.task->layout, s.recv_b.task->shapes)
                                   : unframe(parts, recv_b_specs_[in.stage * num_microbatches_ + in.mb]);
      s.recv_b = Inbox();
    }
    TORCH_CHECK(s.out_grads.size() == s.out_edges.size(), where(in), ": received ", s.out_grads.size(),
                " output gradients for ", s.out_edges.size(), " outputs that need one");
    roots = s.out_edges;
    grads = s.out_grads;
  }
  const bool own_weight_grads = builds_weight(in.stage);
  SpentOn spent(profile_, Spent::kBackward);
  if (split && !evented(in.stage) && !own_weight_grads) {
    std::vector<SplitFallback> fallbacks;
    s.input_grads = backward_input(roots, grads, s.inputs, s.weight, fallbacks);
    for (auto& f : fallbacks) ++split_fallbacks_[in.stage][f];
  } else {
    s.input_grads = backward_full(roots, grads, s.inputs);
  }
  if (own_weight_grads) {  // as torch: the runner is made after the backward, run at W (B: now)
    s.weight.closures.fns.push_back(weight_builder_(in.stage));
    s.weight.closures.nodes.push_back(nullptr);
    if (!split) backward_weight(s.weight);
  }
  s.out_edges.clear();
  s.out_grads.clear();
  s.loss_edge = torch::autograd::Edge();
  s.loss_seed.reset();
  if (prev_local_[in.stage] >= 0) {
    slot(prev_local_[in.stage], in.mb).out_grads = take_input_grads(s);
  }
}

void Executor::do_weight(const Instr& in) {
  SpentOn spent(profile_, Spent::kBackward);
  backward_weight(slot(in.stage, in.mb).weight);
}

}  // namespace pipecore
