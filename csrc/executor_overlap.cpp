// The executor's OVERLAP_F_B pairs: the forward half on the step's thread, the backward half beside
// it (overlap.h), or in sequence where they must not overlap, or as the user's hook says.
#include <ATen/ThreadLocalState.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "executor.h"
#include "node_info.h"
#include "overlap.h"
#include "trace.h"

namespace pipecore {

struct Executor::PairRun {
  size_t begin = 0;  // program index of the opening bracket
  size_t end = 0;    // ... of the closing one
  std::vector<size_t> halves[2];  // program indices: 0 the forwards, 1 the backwards (I, B, W)
  std::exception_ptr error[2];
  size_t failed_at[2] = {0, 0};
  std::vector<TraceEvent> traced;  // [j - begin - 1]: sub-action j's event, when tracing
  at::ThreadLocalState tls;        // the step's thread's (captured when made), for halves run elsewhere
  std::mutex mu;
  std::condition_variable idle;
  bool ran[2] = {false, false};
  int running = 0;  // halves running now (a hook may run them on threads of its own)
};

void Executor::set_overlap(OverlapMode mode, OverlapHook hook, c10::Device device) {
  overlap_mode_ = mode;
  overlap_hook_ = std::move(hook);
  overlap_device_ = device;
}

void Executor::run_half(PairRun& pair, int half, const std::vector<size_t>& actions, int64_t lane) {
  for (size_t j : actions) {
    try {
      if (!trace_on_) {
        exec(j, *forward_);
        continue;
      }
      double t0;
      {
        std::lock_guard<std::mutex> lock(trace_mu_);  // a device timer records its events in order
        t0 = trace_time();
      }
      exec(j, *forward_);
      std::lock_guard<std::mutex> lock(trace_mu_);
      pair.traced[j - pair.begin - 1] = {program_[j].label, t0, trace_time(), lane};
    } catch (...) {
      pair.error[half] = std::current_exception();
      pair.failed_at[half] = j;
      return;
    }
  }
}

bool Executor::backward_hooks_saved_tensors(int64_t stage, int64_t mb) {
  // Asked once per stage and step: a stage's graph has the same kinds of nodes every microbatch.
  int8_t& known = hooked_backward_[stage];
  if (known >= 0) return known != 0;
  Slot& s = slot(stage, mb);
  std::vector<torch::autograd::Node*> todo;
  if (s.loss_edge.is_valid()) todo.push_back(s.loss_edge.function.get());
  for (const auto& e : s.out_edges) {
    if (e.is_valid()) todo.push_back(e.function.get());
  }
  std::unordered_set<torch::autograd::Node*> seen(todo.begin(), todo.end());
  bool hooked = false;
  while (!todo.empty() && !hooked) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    // a reentrant checkpoint is a Python Function that runs its own backward (and forks the RNG)
    hooked = has_saved_tensor_hooks(node) ||
             (is_python_node(node) && node_name(node).find("CheckpointFunction") != std::string::npos);
    for (const auto& e : node->next_edges()) {
      if (e.is_valid() && seen.insert(e.function.get()).second) todo.push_back(e.function.get());
    }
  }
  known = hooked ? 1 : 0;
  return hooked;
}

const char* Executor::sequential_reason(const PairRun& pair) {
  if (pair.halves[0].empty() || pair.halves[1].empty()) return "one_kind";
  for (size_t j = pair.begin + 1; j < pair.end; ++j) {
    const int64_t stage = program_[j].stage;
    if (stage < static_cast<int64_t>(evented_.size()) && evented_[stage]) return "stage_events";
  }
  // torch.utils.checkpoint sets the global RNG state while it recomputes (preserve_rng_state) and
  // puts it back after: a forward drawing random numbers meanwhile would draw from that state
  for (size_t j : pair.halves[1]) {
    const Instr& in = program_[j];
    if (in.op != kW && backward_hooks_saved_tensors(in.stage, in.mb)) return "saved_tensor_hooks";
  }
  return nullptr;
}

void Executor::run_halves(PairRun& pair, OverlapMode mode) {
  // a discovery step publishes shapes as forwards run: in program order
  const char* why = mode == OverlapMode::kSequential || spec_source_ ? nullptr : sequential_reason(pair);
  if (mode == OverlapMode::kSequential || spec_source_ || why) {
    if (why) ++overlap_fallbacks_[why];
    for (size_t j = pair.begin + 1; j < pair.end; ++j) {  // program order, up to the first failure
      const int half = program_[j].op == kF ? 0 : 1;
      run_half(pair, half, {j}, 0);
      if (pair.error[half]) return;
    }
    return;
  }
  Turns turns(mode == OverlapMode::kLockstep);
  std::optional<CurrentTurns> current;
  if (mode == OverlapMode::kLockstep) current.emplace(&turns);
  HalfStream stream(current_stream(overlap_device_));
  if (!half_thread_) half_thread_ = std::make_unique<HalfThread>();  // inside a step: the GIL is free
  half_thread_->start([&] {
    at::ThreadLocalStateGuard tls(pair.tls);
    try {
      stream.enter();
      turns.wait_turn(1);
      run_half(pair, 1, pair.halves[1], 1);
      stream.leave();
    } catch (...) {
      if (!pair.error[1]) {
        pair.error[1] = std::current_exception();
        pair.failed_at[1] = pair.halves[1].front();
      }
    }
    if (pair.error[1]) forget_python_error();
    turns.finish(1);
  });
  turns.wait_turn(0);
  run_half(pair, 0, pair.halves[0], 0);
  turns.finish(0);
  half_thread_->join();  // the job keeps its errors in `pair`
  ++overlapped_pairs_;
}

size_t Executor::exec_pair(size_t& index) {
  PairRun pair;
  pair.begin = index;
  pair.end = pair_end_[index];
  for (size_t j = pair.begin + 1; j < pair.end; ++j) pair.halves[program_[j].op == kF ? 0 : 1].push_back(j);
  if (trace_on_) pair.traced.assign(pair.end - pair.begin - 1, TraceEvent{-1, 0.0, 0.0, 0});
  const Instr& bracket = program_[pair.begin];
  double t0 = 0.0;
  if (trace_on_) {
    std::lock_guard<std::mutex> lock(trace_mu_);
    t0 = trace_time();
  }
  std::exception_ptr hook_error;
  {
    ActionScope scope(labels_[bracket.label]);  // spans both halves
    if (overlap_hook_ && !spec_source_) {
      pair_ = &pair;
      try {
        overlap_hook_(static_cast<int64_t>(pair.begin));
      } catch (...) {
        hook_error = std::current_exception();
      }
      std::unique_lock<std::mutex> lock(pair.mu);  // halves the hook left running on its threads
      pair.idle.wait(lock, [&] { return pair.running == 0; });
      pair_ = nullptr;
    } else {
      run_halves(pair, overlap_mode_);
      pair.ran[0] = pair.ran[1] = true;
    }
  }
  if (trace_on_) {
    std::lock_guard<std::mutex> lock(trace_mu_);
    trace_.push_back({bracket.label, t0, trace_time(), 0});
    for (const auto& e : pair.traced) {
      if (e.label >= 0) trace_.push_back(e);
    }
  }
  // the first failure in program order is the step's (a peer's abort keeps its type)
  int first = -1;
  for (int h = 0; h < 2; ++h) {
    if (pair.error[h] && (first < 0 || pair.failed_at[h] < pair.failed_at[first])) first = h;
  }
  if (first >= 0) {
    index = pair.failed_at[first];
    std::rethrow_exception(pair.error[first]);
  }
  if (hook_error) std::rethrow_exception(hook_error);
  for (int h = 0; h < 2; ++h) {
    TORCH_CHECK(pair.ran[h] || pair.halves[h].empty(), "pipecore: the overlap hook of ", labels_[bracket.label],
                " returned without running its ", h == 0 ? "forward" : "backward",
                " half: call pair.run(), or pair.run_forward() and pair.run_backward(), once each");
  }
  return pair.end;
}

Executor::PairRun& Executor::hooked_pair(int64_t bracket) {
  TORCH_CHECK(pair_ != nullptr && static_cast<int64_t>(pair_->begin) == bracket,
              "pipecore: an OVERLAP_F_B pair runs only from the overlap hook it was given to, while it runs");
  return *pair_;
}

void Executor::run_pair_half(int64_t bracket, int half) {
  TORCH_CHECK(half == 0 || half == 1, "pipecore: a pair has halves 0 (forward) and 1 (backward), got ", half);
  PairRun& pair = hooked_pair(bracket);
  {
    std::lock_guard<std::mutex> lock(pair.mu);
    TORCH_CHECK(!pair.ran[half], "pipecore: the ", half == 0 ? "forward" : "backward", " half of ",
                labels_[program_[pair.begin].label], " already ran: each half runs once");
    pair.ran[half] = true;
    ++pair.running;
  }
  {
    at::ThreadLocalStateGuard tls(pair.tls);
    std::optional<HalfStream> stream;
    if (half == 1) stream.emplace(current_stream(overlap_device_));
    try {
      if (stream) stream->enter();
      run_half(pair, half, pair.halves[half], half);
      if (stream) stream->leave();
    } catch (...) {
      if (!pair.error[half]) {
        pair.error[half] = std::current_exception();
        pair.failed_at[half] = pair.halves[half].empty() ? pair.begin : pair.halves[half].front();
      }
    }
  }
  std::exception_ptr error = pair.error[half];
  {
    std::lock_guard<std::mutex> lock(pair.mu);
    --pair.running;
  }
  pair.idle.notify_all();
  if (error) std::rethrow_exception(error);
}

void Executor::run_pair(int64_t bracket, OverlapMode mode) {
  PairRun& pair = hooked_pair(bracket);
  {
    std::lock_guard<std::mutex> lock(pair.mu);
    TORCH_CHECK(!pair.ran[0] && !pair.ran[1], "pipecore: a half of ", labels_[program_[pair.begin].label],
                " already ran: pair.run() runs both halves, once");
    pair.ran[0] = pair.ran[1] = true;
    ++pair.running;
  }
  {
    at::ThreadLocalStateGuard tls(pair.tls);
    run_halves(pair, mode);
  }
  {
    std::lock_guard<std::mutex> lock(pair.mu);
    --pair.running;
  }
  pair.idle.notify_all();
  for (int h = 0; h < 2; ++h) {
    if (pair.error[h]) std::rethrow_exception(pair.error[h]);
  }
}

}  // namespace pipecore
