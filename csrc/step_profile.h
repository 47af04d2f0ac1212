// Where a run's host time went (Executor::set_profile): each moment of the run is charged to one
// part, so the parts add up to the run. Off, a part's scope only tells the flight record which part
// runs now (flight_record.h: a thread id compare and a relaxed store).
//
// Only the thread that runs the program is counted: the other half of an OVERLAP_F_B pair runs on
// a thread of its own, and its time shows as the time the running thread waited for it; its parts go
// to the flight record as the other half's.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "flight_record.h"

namespace pipecore {

enum class Spent : int {
  kLoop = 0,   // the executor's own work: dispatch, bookkeeping, unframing, freeing
  kForward,    // the forward callback: the stage's forward and loss, and the Python around them
  kBackward,   // the autograd engine: backward of a B, I or W (the stage's own kernels included)
  kPost,       // framing and posting sends and receives
  kWait,       // waiting: for a receive, a posting, the send budget, the step's last sends
  kParts,
};

// Each part's names, in Spent's order: the key of Executor.profile()'s dict, and the word the flight
// record says of an action in that part.
struct SpentNames {
  const char* key;
  const char* said;
};
constexpr SpentNames kSpentNames[] = {
    {"loop", "executor"}, {"forward", "forward"}, {"backward", "backward"}, {"post", "posting"}, {"wait", "waiting"}};
static_assert(sizeof(kSpentNames) / sizeof(kSpentNames[0]) == static_cast<size_t>(Spent::kParts));

class StepProfile {
 public:
  explicit StepProfile(FlightRecord& flight) : flight_(flight) {}
  void begin(bool on) {
    on_ = on;
    owner_ = std::this_thread::get_id();
    current_ = Spent::kLoop;
    flight_.set_part(static_cast<int>(current_));
    if (!on) return;
    spent_.fill(Clock::duration::zero());
    start_ = last_ = Clock::now();
  }
  void end() {
    if (!on_) return;
    charge();
    total_ = last_ - start_;
    on_ = false;
  }
  bool on_owner_thread() const { return std::this_thread::get_id() == owner_; }
  // On the thread that runs the program: charges the time so far to the current part and makes `part`
  // current; returns the part to go back to.
  Spent enter(Spent part) {
    if (on_) charge();
    const Spent previous = current_;
    current_ = part;
    flight_.set_part(static_cast<int>(part));
    return previous;
  }
  void leave(Spent previous) {
    if (on_) charge();
    current_ = previous;
    flight_.set_part(static_cast<int>(previous));
  }
  // On another thread (the other half of a pair): only the flight record's part of the other half.
  FlightRecord::HalfScope enter_half(Spent part) { return flight_.enter_half(static_cast<int>(part)); }
  void leave_half(const FlightRecord::HalfScope& scope) { flight_.leave_half(scope); }
  double us(Spent part) const { return micro(spent_[static_cast<int>(part)]); }
  double total_us() const { return micro(total_); }

 private:
  using Clock = std::chrono::steady_clock;
  static double micro(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
  void charge() {
    const auto now = Clock::now();
    spent_[static_cast<int>(current_)] += now - last_;
    last_ = now;
  }
  FlightRecord& flight_;
  bool on_ = false;
  std::thread::id owner_;
  Spent current_ = Spent::kLoop;
  Clock::time_point start_, last_;
  Clock::duration total_{};
  std::array<Clock::duration, static_cast<int>(Spent::kParts)> spent_{};
};

// Charges the scope's time to `part` (exclusive of the parts of scopes inside it).
class SpentOn {
 public:
  SpentOn(StepProfile& profile, Spent part) : profile_(profile), half_(!profile.on_owner_thread()) {
    if (half_) {
      previous_half_ = profile.enter_half(part);
    } else {
      previous_ = profile.enter(part);
    }
  }
  ~SpentOn() {
    if (half_) {
      profile_.leave_half(previous_half_);
    } else {
      profile_.leave(previous_);
    }
  }
  SpentOn(const SpentOn&) = delete;
  SpentOn& operator=(const SpentOn&) = delete;

 private:
  StepProfile& profile_;
  bool half_;
  Spent previous_ = Spent::kLoop;
  FlightRecord::HalfScope previous_half_;
};

}  // namespace pipecore
