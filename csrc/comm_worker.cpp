#include "comm_worker.h"

#include <stdexcept>

#include "helper_thread.h"

namespace pipecore {

CommWorker::CommWorker() {
  thread_ = std::thread([this] {
    become_helper_thread("pipecore-post");
    loop();
  });
}

CommWorker::~CommWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
  for (auto& task : tasks_) {  // dropped with the executor: nobody waits for them in vain
    task->mark_posted(std::make_exception_ptr(std::runtime_error("pipecore: the executor closed before posting")));
  }
}

void CommWorker::queue(std::shared_ptr<CommTask> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  queued_.notify_one();
}

bool CommWorker::post_if_idle(CommTask& task) {
  std::lock_guard<std::mutex> lock(mu_);  // held while posting: no other thread queues meanwhile
  if (posting_ || !tasks_.empty()) return false;
  post_parts(task);
  return true;
}

void CommWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    queued_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;
    std::shared_ptr<CommTask> task = std::move(tasks_.front());
    tasks_.pop_front();
    posting_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      post_parts(*task);  // the task is not read by others until marked posted
    } catch (...) {
      error = std::current_exception();
    }
    task->mark_posted(error);
    lock.lock();
    posting_ = false;
  }
}

}  // namespace pipecore
