// OVERLAP_F_B: the two halves of an overlapped pair (its forwards, its backwards) on two threads.
//
// The executor runs a pair's backward half on a thread of its own (HalfThread) while the calling
// thread runs the forward half; both carry the calling thread's thread-local state (grad mode,
// autocast, profiler, saved-tensor hooks) and, on an accelerator, its device and current stream:
// the autograd engine runs each backward kernel on the stream its forward used, so the halves'
// kernels share the compute stream and what overlaps on a GPU is the host's work and each half's
// communication.
//
// Modes (Pipeline's `overlap_f_b`):
//   sequential  the halves one after the other (torch's behaviour);
//   lockstep    (default) one half computes at a time; a half hands over at OverlapHandoff points
//               (around its communication: an MoE all-to-all) and takes over again after, so that
//               one half's communication hides behind the other's compute (TorchTitan's
//               overlap_callback). Collectives inside the halves keep one order on every rank.
//   concurrent  both halves compute at once: for halves that share no process group and no
//               mutable state (each rank then orders the two halves' collectives as its threads
//               happen to run).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace pipecore {

enum class OverlapMode : int64_t { kSequential = 0, kConcurrent = 1, kLockstep = 2 };

// A thread that runs one job at a time (the backward half of a pair). Make it while the GIL is free.
class HalfThread {
 public:
  HalfThread();
  ~HalfThread();
  HalfThread(const HalfThread&) = delete;
  HalfThread& operator=(const HalfThread&) = delete;
  // Starts `job` on the thread; returns at once. A job that throws has its error kept for join(),
  // and the Python error it may leave on the thread cleared (see overlap.cpp).
  void start(std::function<void()> job);
  // Waits for the job; its exception, if any.
  std::exception_ptr join();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Lock-step turns between the two halves of a pair: 0 (forward) holds the turn first. A half waits
// for its turn before it starts; a finished half passes the turn on for good.
class Turns {
 public:
  explicit Turns(bool lockstep) : lockstep_(lockstep) {}
  void wait_turn(int half);
  void finish(int half);
  // OverlapHandoff: the half that holds the turn gives it to the other (unless that one finished)
  // and returns which half it is; take_back(half) waits until the turn comes back to it.
  int hand_over();
  void take_back(int half);
  // Called once, by the first hand_over: starts the other half, or returns false, and then no
  // hand_over gives the turn away (the other half runs after this one).
  void on_first_hand_over(std::function<bool()> start) { on_first_hand_over_ = std::move(start); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool lockstep_;
  int holder_ = 0;
  bool done_[2] = {false, false};
  std::function<bool()> on_first_hand_over_;
  bool refused_ = false;
};

// The pair running in lock-step now (at most one per process: a process runs one step at a time).
// Python's pipecore.overlap_handoff() reaches it through these; no pair, or a handoff inside
// another one on the same thread: they do nothing.
int overlap_hand_over();        // -1: nothing was handed over
void overlap_take_back(int half);

// Installs `turns` as the running pair's for its lifetime.
class CurrentTurns {
 public:
  explicit CurrentTurns(Turns* turns);
  ~CurrentTurns();
};

// Where a half's thread issues device work: the step thread's device and current stream (both are
// per thread), entered on the half's thread for the half's life. Nothing on CPU.
class OnStepStream {
 public:
  explicit OnStepStream(std::optional<c10::Stream> compute) : compute_(compute) {}
  void enter();  // on the half's thread, before its work
  void leave();  // after it
  ~OnStepStream() { leave(); }

 private:
  std::optional<c10::Stream> compute_;
  std::optional<c10::Stream> previous_;
  std::optional<c10::Device> previous_device_;
};

// The calling thread's current stream on `device`; none for CPU.
std::optional<c10::Stream> current_stream(const c10::Device& device);

}  // namespace pipecore
