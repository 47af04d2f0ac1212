#include "send_worker.h"

namespace pipecore {

SendWorker::SendWorker(c10::intrusive_ptr<c10d::ProcessGroup> pg) : pg_(std::move(pg)) {
  thread_ = std::thread([this] { loop(); });
}

SendWorker::~SendWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  thread_.join();
}

void SendWorker::queue(std::shared_ptr<SendTask> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  queued_.notify_one();
}

void SendWorker::wait_posted(SendTask& task) {
  std::unique_lock<std::mutex> lock(mu_);
  posted_.wait(lock, [&] { return task.posted; });
}

void SendWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    queued_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (stop_) return;  // queued sends are dropped with the executor
    std::shared_ptr<SendTask> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::exception_ptr error;
    try {
      for (auto& part : task->parts) {
        std::vector<at::Tensor> bufs{part};
        works.push_back(pg_->send(bufs, task->peer, task->tag));
      }
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    task->works = std::move(works);
    task->error = error;
    task->posted = true;
    posted_.notify_all();
  }
}

}  // namespace pipecore
