#include "overlap.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <pybind11/pybind11.h>

#include <utility>

namespace pipecore {

namespace {
// After a failure: the autograd engine carries a Python error raised in a backward (a hook) as a
// C++ exception but leaves it set in the thread's Python state too, where the next Python call on
// that thread trips over it (measured: the next step's backward there failed with a stale
// AttributeError). The exception holds the error; the thread state must not. Takes the GIL.
void forget_python_error() {
  pybind11::gil_scoped_acquire gil;
  PyErr_Clear();
}
}  // namespace

HalfThread::HalfThread() : thread_([this] { loop(); }) {}

HalfThread::~HalfThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void HalfThread::start(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mu_);
  job_ = std::move(job);
  error_ = nullptr;
  busy_ = true;
  cv_.notify_all();
}

std::exception_ptr HalfThread::join() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !busy_; });
  return std::exchange(error_, nullptr);
}

void HalfThread::loop() {
  // A Python thread state for the thread's whole life, as torch gives its autograd threads
  // (PythonEngine::thread_init): a Python error raised in a backward here (a hook, a Function) is
  // fetched by the engine after the GIL was let go, which a thread state made per acquisition
  // would have cleared by then. Kept to the end (never cleared: that would need the GIL at exit).
  // The executor makes this thread inside a step, when the GIL is free.
  new pybind11::gil_scoped_acquire();  // NOLINT: leaked on purpose, see above
  new pybind11::gil_scoped_release();  // NOLINT
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || (busy_ && job_); });
    if (stop_) return;
    std::function<void()> job = std::move(job_);
    job_ = nullptr;
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    job = nullptr;  // what the job holds goes before the caller hears of its end
    if (error) forget_python_error();
    lock.lock();
    error_ = error;
    busy_ = false;
    cv_.notify_all();
  }
}

void Turns::wait_turn(int half) {
  if (!lockstep_) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return holder_ == half || done_[1 - half]; });
  holder_ = half;
}

void Turns::finish(int half) {
  std::lock_guard<std::mutex> lock(mu_);
  done_[half] = true;
  holder_ = 1 - half;
  cv_.notify_all();
}

int Turns::hand_over() {
  std::function<bool()> start;
  int me;
  {
    std::lock_guard<std::mutex> lock(mu_);
    me = holder_;
    if (done_[1 - me] || refused_) return me;
    start = std::exchange(on_first_hand_over_, nullptr);
    if (!start) holder_ = 1 - me;
  }
  if (start) {
    const bool started = start();  // outside the lock: it may take the GIL
    std::lock_guard<std::mutex> lock(mu_);
    if (!started) {
      refused_ = true;  // the other half runs after this one: every handoff keeps the turn
      return me;
    }
    holder_ = 1 - me;
  }
  cv_.notify_all();
  return me;
}

void Turns::take_back(int half) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return holder_ == half || done_[1 - half]; });
  holder_ = half;
}

namespace {
std::mutex g_current_mu;
Turns* g_current = nullptr;
}  // namespace

CurrentTurns::CurrentTurns(Turns* turns) {
  std::lock_guard<std::mutex> lock(g_current_mu);
  g_current = turns;
}

CurrentTurns::~CurrentTurns() {
  std::lock_guard<std::mutex> lock(g_current_mu);
  g_current = nullptr;
}

namespace {
thread_local int t_handoff_depth = 0;  // handoff blocks open on this thread
}  // namespace

int overlap_hand_over() {
  if (t_handoff_depth++ > 0) return -1;  // nested: the outer block already handed over
  Turns* turns;
  {
    std::lock_guard<std::mutex> lock(g_current_mu);
    turns = g_current;
  }
  return turns ? turns->hand_over() : -1;
}

void overlap_take_back(int half) {
  if (t_handoff_depth > 0) --t_handoff_depth;
  if (half < 0) return;
  Turns* turns;
  {
    std::lock_guard<std::mutex> lock(g_current_mu);
    turns = g_current;
  }
  if (turns) turns->take_back(half);
}

std::optional<c10::Stream> current_stream(const c10::Device& device) {
  if (device.is_cpu()) return std::nullopt;
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

void OnStepStream::enter() {
  if (!compute_) return;
  c10::impl::VirtualGuardImpl impl(compute_->device_type());
  previous_device_ = impl.exchangeDevice(compute_->device());  // a new thread starts on device 0
  previous_ = impl.exchangeStream(*compute_);
}

void OnStepStream::leave() {
  if (!previous_) return;
  c10::impl::VirtualGuardImpl impl(compute_->device_type());
  impl.exchangeStream(*previous_);
  previous_.reset();
  if (previous_device_) impl.setDevice(*previous_device_);
  previous_device_.reset();
}

}  // namespace pipecore
