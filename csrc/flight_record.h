// What this rank is doing now and did last (issue 62): the phase of the step, the action running and
// since when, what part of it (user code, autograd, posting, waiting), what message it waits for, the
// last kKept actions with their times, and the messages posted and not seen complete. Always on. The
// threads that run the program write it with relaxed atomic stores and a clock read per action (no lock,
// no allocation); any thread reads it at any time (Executor::flight_record), as the watcher does while
// that thread is stuck in a step (pipecore/runtime/doctor.py). A read may pair one action's fields with
// its neighbour's: a diagnosis needs them recent, not consistent to the nanosecond.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>

#include <pthread.h>

namespace pipecore {

class FlightRecord {
 public:
  static constexpr int kKept = 32;  // actions kept, the newest last
  // where the step is: the run's phases (kRun, or kDiscovery for a run that learns its messages' shapes, then
  // kAbort) are the executor's, those around it the Python layer's (Executor.set_flight_phase); kReduce is
  // the data-parallel replicas' reduction that ends a training step (its buckets' reductions the run started)
  enum Phase : int64_t { kIdle = 0, kAgreement, kRun, kDiscovery, kAbort, kFinalise, kReduce, kPhases };

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void set_phase(Phase phase) {
    const int64_t now = mark();
    phase_since_.store(now, std::memory_order_relaxed);
    phase_.store(phase, std::memory_order_relaxed);
  }
  // The time an action that starts next starts at: one clock read per action, at its end (a clock read
  // costs 20-65 ns; bench/overhead.py). What runs between two actions (the host path's receives posted
  // ahead) counts to the second; a run of actions starts with a mark (a phase set, or this).
  int64_t mark() {
    const int64_t now = now_ns();
    mark_ns_.store(now, std::memory_order_relaxed);
    return now;
  }
  void begin_step(int64_t step) { step_.store(step, std::memory_order_relaxed); }

  // program[index] starts (a pair of halves: its bracket), at the last mark; ends at end_action, which
  // keeps it among the last actions unless `kept` is false (an aborted run's actions, which only release
  // the peers)
  void begin_action(int64_t index) {
    action_since_.store(mark_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    action_.store(index, std::memory_order_relaxed);
  }
  void end_action(bool kept = true) {
    const int64_t index = action_.load(std::memory_order_relaxed);  // (one writer: no read-modify-write)
    const int64_t now = mark();
    action_.store(-1, std::memory_order_relaxed);
    if (!kept) return;
    const int64_t n = kept_.load(std::memory_order_relaxed);
    Kept& slot = last_[static_cast<size_t>(n % kKept)];
    slot.index.store(index, std::memory_order_relaxed);
    slot.start_ns.store(action_since_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    slot.end_ns.store(now, std::memory_order_relaxed);
    kept_.store(n + 1, std::memory_order_release);
  }

  // The part of the action running now (step_profile.h's Spent, as an int): set by its SpentOn scopes.
  void set_part(int part) { part_.store(part, std::memory_order_relaxed); }
  // Threads other than the step's that run the program's actions (an OVERLAP_F_B pair's other half, or
  // halves a user's overlap hook runs on threads of its own): a slot each while they do (kHalves at once;
  // more are not recorded), with the part each runs, since when, and its id as Python's
  // threading.get_ident() gives it (the doctor reads its stack). A thread's outermost scope takes a slot
  // and gives it back.
  static constexpr int kHalves = 4;
  struct HalfScope {
    int slot = -1;      // -1: not recorded
    int previous = -1;  // the part to go back to (-1: the thread's outermost scope)
  };
  HalfScope enter_half(int part) {
    const uint64_t me = thread_ident();
    HalfScope scope;
    for (int k = 0; k < kHalves && scope.slot < 0; ++k) {
      if (halves_[k].thread.load(std::memory_order_relaxed) == me) scope.slot = k;
    }
    for (int k = 0; k < kHalves && scope.slot < 0; ++k) {
      uint64_t free = 0;
      if (halves_[k].thread.compare_exchange_strong(free, me, std::memory_order_relaxed)) scope.slot = k;
    }
    if (scope.slot < 0) return scope;
    Half& h = halves_[scope.slot];
    scope.previous = h.part.load(std::memory_order_relaxed);
    h.since_ns.store(now_ns(), std::memory_order_relaxed);
    h.part.store(part, std::memory_order_release);
    return scope;
  }
  void leave_half(const HalfScope& scope) {
    if (scope.slot < 0) return;
    Half& h = halves_[scope.slot];
    if (scope.previous >= 0) h.since_ns.store(now_ns(), std::memory_order_relaxed);
    h.part.store(scope.previous, std::memory_order_release);
    if (scope.previous < 0) h.thread.store(0, std::memory_order_release);  // (its outermost scope ended)
  }
  struct HalfState {
    int part;
    int64_t since_ns;
    uint64_t thread;
  };
  template <typename Fn>
  void for_each_half(Fn&& fn) const {
    for (const Half& h : halves_) {
      const int part = h.part.load(std::memory_order_acquire);
      const uint64_t thread = h.thread.load(std::memory_order_acquire);
      const int64_t since = h.since_ns.load(std::memory_order_relaxed);
      // (a slot one thread gave back and another took meanwhile: skipped, not paired with the wrong stack)
      if (part < 0 || thread == 0 || h.part.load(std::memory_order_acquire) != part) continue;
      fn(HalfState{part, since, thread});
    }
  }
  // This thread's id as Python's threading.get_ident() has it (pthread_self's value, as CPython casts it).
  static uint64_t thread_ident() {
    const pthread_t self = pthread_self();
    uint64_t id = 0;
    std::memcpy(&id, &self, std::min(sizeof(self), sizeof(id)));
    return id;
  }

  struct Waiting {
    int64_t peer = -1;  // -1: no one peer (the step's last sends)
    int64_t mb = -1;
    const char* what = nullptr;  // static text: "activations", "output gradients", ...
    bool send = false;           // for a send of this rank's to complete (else: for the peer's message)
    int64_t since_ns = 0;
  };
  // The slot holds the latest wait, and whether it ended (the last wait, for a run that fails after it:
  // its message said the sender's step was aborted). One clock read per wait, at its start. The two
  // halves of an OVERLAP_F_B pair wait on two threads: a wait ending marks the slot only if it is still
  // its own (`since`, its start, tells).
  void begin_wait(const Waiting& w) {
    wait_send_.store(w.send, std::memory_order_relaxed);
    wait_peer_.store(w.peer, std::memory_order_relaxed);
    wait_mb_.store(w.mb, std::memory_order_relaxed);
    wait_what_.store(w.what, std::memory_order_relaxed);
    wait_ended_.store(0, std::memory_order_relaxed);
    wait_since_.store(w.since_ns, std::memory_order_release);
  }
  void end_wait(int64_t since) {
    if (wait_since_.load(std::memory_order_relaxed) == since) wait_ended_.store(1, std::memory_order_release);
  }
  // Wait `w` ended in an error (a timeout, a broken connection), or the run failed right after it
  // (keep_last_wait): kept as the run's failed wait, with the action running, until the next run; the
  // diagnosis starts from it (the abort runs other actions). (Off the hot path, and both halves of a
  // pair may fail at once: under a lock.)
  void keep_failed_wait(Waiting w, int64_t ended_ns = 0) {
    std::lock_guard<std::mutex> lock(failed_mu_);
    if (failed_.since_ns != 0) return;  // (the first failure is the run's)
    w.since_ns = std::max<int64_t>((ended_ns ? ended_ns : now_ns()) - w.since_ns, 1);  // (kept as its duration)
    failed_action_ = action();
    failed_ = w;
  }
  // The run failed at `failed_ns` on a peer's "aborted" message (no wait failed): its last wait, if it
  // ended in the failing action, is kept as the failed one, its duration up to the failure (a wait's end
  // reads no clock; the failure is found as the wait returns).
  void keep_last_wait(int64_t action_started_ns, int64_t failed_ns) {
    const int64_t ended = wait_ended_.load(std::memory_order_acquire);
    Waiting w = slot();
    if (ended != 0 && w.since_ns >= action_started_ns) keep_failed_wait(w, failed_ns);
  }
  // A run starts: no failed wait, and the messages posted before are past.
  void begin_run() {
    settle_messages();
    std::lock_guard<std::mutex> lock(failed_mu_);
    failed_ = Waiting();
    failed_action_ = -1;
  }
  // The run's failed wait (since_ns: its duration; 0: none) and its action.
  std::pair<Waiting, int64_t> failed_wait() const {
    std::lock_guard<std::mutex> lock(failed_mu_);
    return {failed_, failed_action_};
  }

  // --- reading, from any thread
  int64_t step() const { return step_.load(std::memory_order_relaxed); }
  Phase phase() const { return static_cast<Phase>(phase_.load(std::memory_order_relaxed)); }
  int64_t phase_since_ns() const { return phase_since_.load(std::memory_order_relaxed); }
  int64_t action() const { return action_.load(std::memory_order_relaxed); }
  int64_t action_since_ns() const { return action_since_.load(std::memory_order_relaxed); }
  int part() const { return part_.load(std::memory_order_relaxed); }
  // the wait going on now (since_ns 0: none)
  Waiting waiting() const {
    if (wait_ended_.load(std::memory_order_acquire) != 0) return Waiting();
    return slot();
  }
  struct Done {
    int64_t index, start_ns, end_ns;
  };

  // --- messages posted and not completed (the doctor's dump lists them)
  // Message `action` (its SEND/RECV's program index; `follow_up`: a grown message's second sending) was
  // posted to or from `peer`: its ticket (from 1), which completed() takes. Called by the threads that post
  // (both halves of an OVERLAP_F_B pair may): a fetch_add and relaxed stores, no lock, no clock read (its
  // time is the last mark's: the action posting it started then, or the one before, for a receive posted
  // ahead), except for a follow-up, posted once its header was read, in the middle of an action. A reader
  // skips a slot being written (its ticket 0 meanwhile, as a sequence lock).
  int64_t posted(int64_t action, int64_t peer, int64_t bytes, bool send, bool follow_up) {
    const int64_t ticket = next_ticket_.fetch_add(1, std::memory_order_relaxed) + 1;
    Message& m = messages_[static_cast<size_t>(ticket % kMessagesKept)];
    const int64_t old = m.ticket.load(std::memory_order_relaxed);
    if (old >= settled_below_.load(std::memory_order_relaxed) && m.done.load(std::memory_order_relaxed) != old) {
      unlisted_.fetch_add(1, std::memory_order_relaxed);  // pushed out while in flight
    }
    m.ticket.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    m.action.store(action, std::memory_order_relaxed);
    m.peer.store(peer, std::memory_order_relaxed);
    m.bytes.store(bytes, std::memory_order_relaxed);
    m.flags.store((send ? 1 : 0) | (follow_up ? 2 : 0), std::memory_order_relaxed);
    m.posted_ns.store(follow_up ? now_ns() : mark_ns_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    m.ticket.store(ticket, std::memory_order_release);
    return ticket;
  }
  // The host saw message `ticket` complete (a wait returned, the send tracker released it), from any
  // thread. `done` keeps the largest ticket completed in the slot: a late completion of the slot's previous
  // message does not mark the present one.
  void completed(int64_t ticket) {
    if (ticket <= 0) return;
    std::atomic<int64_t>& done = messages_[static_cast<size_t>(ticket % kMessagesKept)].done;
    int64_t seen = done.load(std::memory_order_relaxed);
    while (seen < ticket && !done.compare_exchange_weak(seen, ticket, std::memory_order_release)) {
    }
  }
  // Every message posted so far is past (a run starts, or one finished: its sends drained, its status read).
  void settle_messages() {
    unlisted_.store(0, std::memory_order_relaxed);
    settled_below_.store(next_ticket_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  struct InFlight {
    int64_t action, peer, bytes, posted_ns;
    bool send, follow_up;
  };
  // The messages posted since the run's start and not seen complete, oldest first; returns how many more
  // were still in flight when later ones took their slots (not listed; some may have completed since).
  template <typename Fn>
  int64_t for_each_in_flight(Fn&& fn) const {
    const int64_t from = settled_below_.load(std::memory_order_relaxed);
    const int64_t last = next_ticket_.load(std::memory_order_relaxed);
    for (int64_t t = std::max<int64_t>(from, last - kMessagesKept + 1); t <= last; ++t) {
      const Message& m = messages_[static_cast<size_t>(t % kMessagesKept)];
      if (m.ticket.load(std::memory_order_acquire) != t) continue;  // being written, or taken since
      const InFlight f{m.action.load(std::memory_order_relaxed), m.peer.load(std::memory_order_relaxed),
                       m.bytes.load(std::memory_order_relaxed), m.posted_ns.load(std::memory_order_relaxed),
                       (m.flags.load(std::memory_order_relaxed) & 1) != 0,
                       (m.flags.load(std::memory_order_relaxed) & 2) != 0};
      std::atomic_thread_fence(std::memory_order_acquire);
      if (m.ticket.load(std::memory_order_relaxed) != t || m.done.load(std::memory_order_acquire) == t) continue;
      fn(f);
    }
    return unlisted_.load(std::memory_order_relaxed);
  }
  static constexpr int kMessagesKept = 256;  // messages in flight listed, the newest

 private:
  Waiting slot() const {
    Waiting w;
    w.since_ns = wait_since_.load(std::memory_order_acquire);
    if (w.since_ns == 0) return w;
    w.peer = wait_peer_.load(std::memory_order_relaxed);
    w.mb = wait_mb_.load(std::memory_order_relaxed);
    w.what = wait_what_.load(std::memory_order_relaxed);
    w.send = wait_send_.load(std::memory_order_relaxed);
    return w;
  }

 public:
  // the last actions that ended, oldest first (at most kKept)
  template <typename Fn>
  void for_each_done(Fn&& fn) const {
    const int64_t n = kept_.load(std::memory_order_acquire);
    for (int64_t k = n > kKept ? n - kKept : 0; k < n; ++k) {
      const Kept& slot = last_[static_cast<size_t>(k % kKept)];
      fn(Done{slot.index.load(std::memory_order_relaxed), slot.start_ns.load(std::memory_order_relaxed),
              slot.end_ns.load(std::memory_order_relaxed)});
    }
  }

 private:
  struct Kept {
    std::atomic<int64_t> index{-1}, start_ns{0}, end_ns{0};
  };
  std::atomic<int64_t> step_{-1};
  std::atomic<int64_t> phase_{kIdle};
  std::atomic<int64_t> phase_since_{0};
  std::atomic<int64_t> action_{-1};
  std::atomic<int64_t> action_since_{0};
  std::atomic<int64_t> mark_ns_{0};
  std::atomic<int> part_{0};
  struct Half {
    std::atomic<uint64_t> thread{0};  // 0: free
    std::atomic<int> part{-1};
    std::atomic<int64_t> since_ns{0};
  };
  std::array<Half, kHalves> halves_{};
  std::atomic<int64_t> wait_peer_{-1}, wait_mb_{-1}, wait_since_{0}, wait_ended_{0};
  std::atomic<const char*> wait_what_{nullptr};
  std::atomic<bool> wait_send_{false};
  std::atomic<int64_t> kept_{0};
  mutable std::mutex failed_mu_;
  Waiting failed_;
  int64_t failed_action_ = -1;
  std::array<Kept, kKept> last_{};
  struct alignas(64) Message {  // (a cache line each: the send tracker's threads complete them)
    std::atomic<int64_t> ticket{0}, done{0}, action{-1}, peer{-1}, bytes{0}, posted_ns{0};
    std::atomic<int> flags{0};
  };
  std::atomic<int64_t> next_ticket_{0}, settled_below_{1}, unlisted_{0};
  std::array<Message, kMessagesKept> messages_{};
};

// A wait for a message (or for sends to complete), in the flight record for its duration.
class WaitingOn {
 public:
  WaitingOn(FlightRecord& flight, int64_t peer, int64_t mb, const char* what, bool send = false)
      : flight_(flight), wait_{peer, mb, what, send, FlightRecord::now_ns()}, exceptions_(std::uncaught_exceptions()) {
    flight_.begin_wait(wait_);
  }
  ~WaitingOn() {
    if (std::uncaught_exceptions() > exceptions_) flight_.keep_failed_wait(wait_);  // (it ends in an error)
    flight_.end_wait(wait_.since_ns);
  }
  WaitingOn(const WaitingOn&) = delete;
  WaitingOn& operator=(const WaitingOn&) = delete;

 private:
  FlightRecord& flight_;
  FlightRecord::Waiting wait_;
  int exceptions_;
};

}  // namespace pipecore
