// The CPU model of NCCL (nccl_model.h): a group's Work, which completes once every operation of it did.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../deadline.h"

namespace pipecore {
namespace nccl_model {

constexpr std::chrono::milliseconds kWaitForever{0};  // c10d::Work::wait's "no timeout" (gloo: the group's)

// One operation of a group: its gloo Works (a receive's once its sender's note matched: `pending`
// until then) and what to check once they completed (the note of a send's receiver).
struct PostedOp {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::function<void()> check;
  bool pending = false;
  c10::intrusive_ptr<c10d::Work> note;  // a receive's: its sender's note (PairReceiver waits for it)
  bool note_done = false;
  bool eager = false;  // a send NCCL's eager protocol completes at its launch (its works go on by themselves)
};

// A group's Work: every operation of it, once its communicator's stream launched it. Each gloo Work is
// waited for once (a second wait would wait for another message); later waiters wait for that first
// wait's outcome.
class GroupWork final : public c10d::Work {
 public:
  explicit GroupWork(std::string what) : what_(std::move(what)) {}

  // Its operations were posted (or `never`: it cannot launch, and why).
  void launch(std::vector<PostedOp> ops, const std::string& never = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_ = std::move(ops);
    state_.assign(ops_.size(), kIdle);
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (ops_[i].eager) state_[i] = kDone;
    }
    errors_.assign(ops_.size(), nullptr);
    never_ = never;
    launched_ = true;
    changed_.notify_all();
  }
  // A pending receive was posted (`works`), or could not be (`why`).
  void fill(size_t slot, std::vector<c10::intrusive_ptr<c10d::Work>> works, const std::string& why = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_[slot].works = std::move(works);
    ops_[slot].note_done = why.empty();
    if (!why.empty()) ops_[slot].check = [why] { throw std::runtime_error(why); };
    ops_[slot].pending = false;
    changed_.notify_all();
  }
  const std::string& what() const { return what_; }
  // What its launch waits for now, for the report of a launch that never came.
  void waiting_for(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    waits_for_ = why;
  }
  bool aborted() {
    std::lock_guard<std::mutex> lock(mu_);
    return !aborted_.empty();
  }
  // Launched and done, failed, aborted, or never to launch.
  bool ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return launched_ && (!never_.empty() || !aborted_.empty() ||
                         std::all_of(state_.begin(), state_.end(), [](int s) { return s == kDone || s == kFailed; }));
  }
  // Ends a wait on its operations (gloo's abortWaitSend/abortWaitRecv): the model's teardown.
  void abort() override { abort_with("pipecore (model of NCCL): the executor went first"); }
  // NCCL's abort of the communicator: every wait on the group ends with `why`.
  void abort_with(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = why;
    for (auto& op : ops_) {
      for (auto& work : op.works) work->abort();
      if (op.note) op.note->abort();
    }
    changed_.notify_all();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    const auto deadline = deadline_after(timeout.count() > 0 ? timeout : std::chrono::milliseconds::max());
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!changed_.wait_until(lock, deadline, [&] { return launched_; })) {
        throw std::runtime_error("pipecore (model of NCCL): " + what_ + " was never launched: " +
                                 (waits_for_.empty() ? "a group queued before it on its communicator did not "
                                                       "complete (on a GPU, groups on one stream run one after "
                                                       "another: this would hang)"
                                                     : waits_for_));
      }
      if (!never_.empty()) throw std::runtime_error(never_);
    }
    for (size_t i = 0; i < ops_.size(); ++i) {
      std::unique_lock<std::mutex> lock(mu_);
      if (!changed_.wait_until(lock, deadline, [&] { return !ops_[i].pending || !aborted_.empty(); })) {
        throw std::runtime_error("pipecore (model of NCCL): " + what_ + " did not complete: a receive's peer has "
                                 "not posted the send it matches");
      }
      // Only a wait without a deadline (its stream's thread, which waits for each group it launched) waits
      // on gloo: a gloo wait that times out closes every pair of its group. Others wait for its outcome.
      const bool drives = deadline == std::chrono::steady_clock::time_point::max();
      if (state_[i] == kIdle && aborted_.empty() && drives) {
        state_[i] = kWaiting;
        const PostedOp op = ops_[i];
        lock.unlock();
        std::exception_ptr error;
        try {
          for (const auto& work : op.works) {
            if (!work->wait(kWaitForever)) throw std::runtime_error("the wait was aborted");
          }
          if (op.check) op.check();
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        if (error && !aborted_.empty()) error = std::make_exception_ptr(std::runtime_error(aborted_));
        state_[i] = error ? kFailed : kDone;
        errors_[i] = error;
        changed_.notify_all();
      } else if (!changed_.wait_until(lock, deadline, [&] {
                   return state_[i] == kDone || state_[i] == kFailed || (state_[i] == kIdle && !aborted_.empty());
                 })) {
        throw std::runtime_error("pipecore (model of NCCL): " + what_ + " did not complete: an operation of it "
                                 "waits for its peer to post the one it matches");
      }
      if (state_[i] == kIdle && !aborted_.empty()) {  // (gloo ends one wait per abort)
        state_[i] = kFailed;
        errors_[i] = std::make_exception_ptr(std::runtime_error(aborted_));
      }
      if (state_[i] == kFailed) std::rethrow_exception(errors_[i]);
    }
    return true;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mu_);
    return launched_ && never_.empty() && std::all_of(state_.begin(), state_.end(), [](int s) { return s == kDone; });
  }

  // The last strong reference went: its operations go, whatever weak ones remain, except those gloo
  // may still write or read (not completed), which stay, with their buffers, as long as the process.
  void release_resources() override {
    std::vector<c10::intrusive_ptr<c10d::Work>> posted;
    for (size_t i = 0; i < ops_.size(); ++i) {
      if (state_[i] != kDone || ops_[i].eager) posted.insert(posted.end(), ops_[i].works.begin(), ops_[i].works.end());
      if (ops_[i].note && !ops_[i].note_done) posted.push_back(ops_[i].note);
    }
    ops_.clear();
    static std::mutex mu;
    static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();  // (never destroyed)
    std::lock_guard<std::mutex> lock(mu);
    kept->insert(kept->end(), posted.begin(), posted.end());
  }

 private:
  enum { kIdle, kWaiting, kDone, kFailed };
  const std::string what_;  // its operations, named for errors
  bool launched_ = false;
  std::string never_;
  std::string waits_for_;
  std::string aborted_;  // why its communicator was aborted
  std::vector<PostedOp> ops_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<int> state_;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace nccl_model
}  // namespace pipecore
