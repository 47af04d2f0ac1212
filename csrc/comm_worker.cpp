#include "comm_worker.h"

namespace pipecore {

void post_parts(CommTask& task) {
  auto post = [&](auto& on, std::vector<at::Tensor>& bufs) {  // a ProcessGroup or a Backend
    return task.send ? on.send(bufs, task.peer, task.tag) : on.recv(bufs, task.peer, task.tag);
  };
  for (auto& part : task.parts) {
    std::vector<at::Tensor> bufs{part};
    task.works.push_back(task.channel ? post(*task.channel, bufs) : post(*task.group, bufs));
  }
}

CommWorker::CommWorker() { thread_ = std::thread([this] { loop(); }); }

CommWorker::~CommWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
}

void CommWorker::queue(std::shared_ptr<CommTask> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  queued_.notify_one();
}

void CommWorker::wait_posted(CommTask& task) {
  std::unique_lock<std::mutex> lock(mu_);
  posted_.wait(lock, [&] { return task.posted; });
}

void CommWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    queued_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;  // queued sends are dropped with the executor
    std::shared_ptr<CommTask> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      post_parts(*task);  // the task is not read by others until `posted`
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    task->error = error;
    task->posted = true;
    posted_.notify_all();
  }
}

}  // namespace pipecore
