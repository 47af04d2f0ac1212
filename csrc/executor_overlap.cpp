// The executor's OVERLAP_F_B pairs: the forward half on the step's thread, the backward half beside
// it (overlap.h), or in sequence where they must not overlap, or as the user's hook says.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
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
  std::vector<TraceEvent> traced;   // [j - begin - 1]: sub-action j's event, when tracing
  at::ThreadLocalState tls;         // the step thread's (captured when made), for halves run elsewhere
  std::optional<c10::Stream> compute;  // the step thread's current stream on the stages' device
  bool ran[2] = {false, false};     // guarded by the executor's overlap_.mu
  int running = 0;                  // halves a hook runs now (on threads of its own, maybe)

  // Keeps the half's first failure (`at`: the action it failed in; the half's first if unknown).
  void fail(int half, std::exception_ptr error, size_t at) {
    if (this->error[half]) return;
    this->error[half] = std::move(error);
    failed_at[half] = at;
  }
  size_t first_action(int half) const { return halves[half].empty() ? begin : halves[half].front(); }
};

namespace {
// Runs `f` when the scope ends, however it ends.
template <typename F>
struct AtExit {
  F f;
  ~AtExit() { f(); }
};
template <typename F>
AtExit(F) -> AtExit<F>;
}  // namespace

void Executor::set_overlap(OverlapMode mode, OverlapHook hook, c10::Device device) {
  overlap_.mode = mode;
  overlap_.hook = std::move(hook);
  overlap_.device = device;
}

void Executor::run_half(PairRun& pair, int half, const std::vector<size_t>& actions, int64_t lane) {
  for (size_t j : actions) {
    try {
      if (!tracing_.on) {
        exec(j, RunMode());
        continue;
      }
      double t0;
      {
        std::lock_guard<std::mutex> lock(tracing_.mu);  // a device timer records its events in order
        t0 = trace_time();
      }
      exec(j, RunMode());
      std::lock_guard<std::mutex> lock(tracing_.mu);
      pair.traced[j - pair.begin - 1] = {program_[j].label, t0, trace_time(), lane};
    } catch (...) {
      pair.fail(half, std::current_exception(), j);
      return;
    }
  }
}

bool Executor::backward_recomputes(const Instr& in) {
  // The graph this backward action will run: from its roots (I, B), or what its I left for W.
  Slot& s = slot(in.stage, in.mb);
  std::vector<torch::autograd::Node*> todo;
  auto add = [&](const torch::autograd::Edge& e) {
    if (e.is_valid()) todo.push_back(e.function.get());
  };
  if (in.op == kW) {
    for (const auto& e : s.weight.roots) add(e);
  } else {
    add(s.loss_edge);
    for (const auto& e : s.out_edges) add(e);
  }
  std::unordered_set<torch::autograd::Node*> seen(todo.begin(), todo.end());
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    // non-reentrant checkpoints leave saved-tensor hooks; a reentrant one is a Python Function
    // that runs its region's backward itself
    if (has_saved_tensor_hooks(node) ||
        (is_python_node(node) && node_name(node).find("Checkpoint") != std::string::npos)) {
      return true;
    }
    for (const auto& e : node->next_edges()) {
      if (e.is_valid() && seen.insert(e.function.get()).second) todo.push_back(e.function.get());
    }
  }
  return false;
}

const char* Executor::sequential_reason(const PairRun& pair, bool walk) {
  if (pair.halves[0].empty() || pair.halves[1].empty()) return "one_kind";
  for (size_t j = pair.begin + 1; j < pair.end; ++j) {
    const int64_t stage = program_[j].stage;
    if (evented(stage)) return "stage_events";
  }
  // a Python mode (FlopCounterMode, DebugMode, ...) is one object: two threads would drive it at once
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::PythonTorchFunctionTLS::stack_len() > 0) {
    return "python_modes";
  }
  // torch.utils.checkpoint sets the global RNG state while it recomputes (preserve_rng_state) and
  // puts it back after: a forward drawing random numbers meanwhile would draw from that state.
  // Asked of every backward action: a graph may checkpoint some microbatches only.
  return walk && pair_recomputes(pair) ? "checkpoint" : nullptr;
}

bool Executor::pair_recomputes(const PairRun& pair) {
  for (size_t j : pair.halves[1]) {
    if (backward_recomputes(program_[j])) return true;
  }
  return false;
}

void Executor::run_halves(PairRun& pair, OverlapMode mode) {
  // a discovery step publishes shapes as forwards run: in program order. Lock-step pairs look for
  // checkpoints only when the forward first hands over (a pair that never does costs nothing).
  const bool lockstep = mode == OverlapMode::kLockstep;
  const char* why = mode == OverlapMode::kSequential || run_.discovering() ? nullptr : sequential_reason(pair, !lockstep);
  if (mode == OverlapMode::kSequential || run_.discovering() || why) {
    if (why) ++overlap_.fallbacks[why];
    for (size_t j = pair.begin + 1; j < pair.end; ++j) {  // program order, up to the first failure
      const int half = program_[j].op == kF ? 0 : 1;
      run_half(pair, half, {j}, 0);
      if (pair.error[half]) return;
    }
    return;
  }
  if (!overlap_.half_thread) overlap_.half_thread = std::make_unique<HalfThread>();  // inside a step: the GIL is free
  Turns turns(lockstep);
  std::atomic<bool> started{false};  // the backward half runs on the half thread
  auto backward = [&] {
    AtExit finished{[&] { turns.finish(1); }};  // the forward half may wait for its turn
    at::ThreadLocalStateGuard tls(pair.tls);
    OnStepStream stream(pair.compute);
    stream.enter();
    turns.wait_turn(1);
    run_half(pair, 1, pair.halves[1], 1);
    // to the HalfThread, which clears the Python error a failed backward leaves on the thread
    if (pair.error[1]) std::rethrow_exception(pair.error[1]);
  };
  std::optional<CurrentTurns> current;
  if (lockstep) {  // the backward half starts when the forward half first hands over
    turns.on_first_hand_over([&] {
      if (pair_recomputes(pair)) {  // the forward keeps its turn; the backward runs after it
        ++overlap_.fallbacks["checkpoint"];
        return false;
      }
      started = true;
      overlap_.half_thread->start(backward);
      return true;
    });
    current.emplace(&turns);
  } else {
    started = true;
    overlap_.half_thread->start(backward);
  }
  {
    AtExit finished{[&] { turns.finish(0); }};
    turns.wait_turn(0);
    run_half(pair, 0, pair.halves[0], 0);
  }
  current.reset();
  if (!started) {  // lock-step, and the forward never handed over: the backward after it, right here
    if (!pair.error[0]) run_half(pair, 1, pair.halves[1], 0);
    return;
  }
  if (std::exception_ptr error = overlap_.half_thread->join()) pair.fail(1, error, pair.first_action(1));
  ++overlap_.overlapped;
}

size_t Executor::exec_pair(size_t& index) {
  PairRun pair;
  pair.begin = index;
  pair.end = program_.pair_end[index];
  for (size_t j = pair.begin + 1; j < pair.end; ++j) pair.halves[program_[j].op == kF ? 0 : 1].push_back(j);
  if (tracing_.on) pair.traced.assign(pair.end - pair.begin - 1, TraceEvent{-1, 0.0, 0.0, 0});
  pair.compute = current_stream(overlap_.device);
  const Instr& bracket = program_[pair.begin];
  double t0 = 0.0;
  if (tracing_.on) {
    std::lock_guard<std::mutex> lock(tracing_.mu);
    t0 = trace_time();
  }
  std::exception_ptr hook_error;
  {
    ActionScope scope(program_.label(bracket));  // spans both halves
    if (overlap_.hook && !run_.discovering()) {
      {
        std::lock_guard<std::mutex> lock(overlap_.mu);
        overlap_.pair = &pair;
      }
      try {
        overlap_.hook(static_cast<int64_t>(pair.begin));
      } catch (...) {
        hook_error = std::current_exception();
      }
      // halves the hook left running on threads of its own finish first; none starts after this
      std::unique_lock<std::mutex> lock(overlap_.mu);
      overlap_.idle.wait(lock, [&] { return pair.running == 0; });
      overlap_.pair = nullptr;
    } else {
      run_halves(pair, overlap_.mode);
      pair.ran[0] = pair.ran[1] = true;
    }
  }
  if (tracing_.on) {
    std::lock_guard<std::mutex> lock(tracing_.mu);
    tracing_.events.push_back({bracket.label, t0, trace_time(), 0});
    for (const auto& e : pair.traced) {
      if (e.label >= 0) tracing_.events.push_back(e);
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
    TORCH_CHECK(pair.ran[h] || pair.halves[h].empty(), "pipecore: the overlap hook of ", program_.label(bracket),
                " returned without running its ", h == 0 ? "forward" : "backward",
                " half: call pair.run(), or pair.run_forward() and pair.run_backward(), once each");
  }
  return pair.end;
}

Executor::PairRun& Executor::claim_pair(int64_t bracket, bool first, bool second) {
  std::lock_guard<std::mutex> lock(overlap_.mu);
  TORCH_CHECK(overlap_.pair != nullptr && static_cast<int64_t>(overlap_.pair->begin) == bracket,
              "pipecore: an OVERLAP_F_B pair runs only from the overlap hook it was given to, before the hook "
              "returns");
  PairRun& pair = *overlap_.pair;
  const std::string& label = program_.label(program_[pair.begin]);
  TORCH_CHECK(!(first && pair.ran[0]) && !(second && pair.ran[1]), "pipecore: the ",
              first && second ? "halves" : first ? "forward half" : "backward half", " of ", label,
              " already ran: each half runs once");
  pair.ran[0] = pair.ran[0] || first;
  pair.ran[1] = pair.ran[1] || second;
  ++pair.running;
  return pair;
}

void Executor::release_pair(PairRun& pair) {
  {
    std::lock_guard<std::mutex> lock(overlap_.mu);
    --pair.running;
  }
  overlap_.idle.notify_all();
}

std::string Executor::pair_sequential_reason(int64_t bracket) {
  PairRun& pair = claim_pair(bracket, false, false);
  AtExit released{[&] { release_pair(pair); }};
  at::ThreadLocalStateGuard tls(pair.tls);  // the step's Python modes
  const char* why = sequential_reason(pair, /*walk=*/true);
  return why ? why : "";
}

void Executor::run_pair_half(int64_t bracket, int half) {
  TORCH_CHECK(half == 0 || half == 1, "pipecore: a pair has halves 0 (forward) and 1 (backward), got ", half);
  PairRun& pair = claim_pair(bracket, half == 0, half == 1);
  AtExit released{[&] { release_pair(pair); }};
  try {
    at::ThreadLocalStateGuard tls(pair.tls);
    OnStepStream stream(pair.compute);  // the hook may run a half on a thread of its own
    stream.enter();
    run_half(pair, half, pair.halves[half], half);
  } catch (...) {
    pair.fail(half, std::current_exception(), pair.first_action(half));
  }
  if (pair.error[half]) std::rethrow_exception(pair.error[half]);
}

void Executor::run_pair(int64_t bracket, OverlapMode mode) {
  PairRun& pair = claim_pair(bracket, true, true);
  AtExit released{[&] { release_pair(pair); }};
  {
    at::ThreadLocalStateGuard tls(pair.tls);
    OnStepStream stream(pair.compute);
    stream.enter();
    run_halves(pair, mode);
  }
  for (int h = 0; h < 2; ++h) {
    if (pair.error[h]) std::rethrow_exception(pair.error[h]);
  }
}

}  // namespace pipecore
