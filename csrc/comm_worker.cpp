#include "comm_worker.h"

#include <pthread.h>
#include <sched.h>

#include <stdexcept>

#include <c10/util/Exception.h>

namespace pipecore {

std::vector<at::Tensor> wire_parts(const CommTask& task) {
  std::vector<at::Tensor> wire;
  wire.reserve(task.parts.size());
  for (const auto& part : task.parts) {
    TORCH_CHECK(part.is_contiguous(), "pipecore: a message part is not contiguous (", part.sizes(), ")");
    wire.push_back(part.reshape({-1}).view(at::kByte));
  }
  return wire;
}

void post_parts(CommTask& task) {
  auto post = [&](auto& on, std::vector<at::Tensor>& bufs) {  // a ProcessGroup or a Backend
    return task.send ? on.send(bufs, task.peer, task.tag) : on.recv(bufs, task.peer, task.tag);
  };
  for (auto& part : wire_parts(task)) {
    std::vector<at::Tensor> bufs{part};
    task.works.push_back(task.channel ? post(*task.channel, bufs) : post(*task.group, bufs));
  }
}

std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

void CommTask::mark_posted(std::exception_ptr failure) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error = std::move(failure);
    posted_ = true;
  }
  cv_.notify_all();
}

bool CommTask::wait_posted(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return posted_; });
}

bool CommTask::posted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return posted_;
}

void become_helper_thread(const char* name) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), name);  // (at most 15 characters)
  sched_param param{};
  param.sched_priority = 0;
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);  // allowed unprivileged; on failure it stays as it was
#else
  (void)name;
#endif
}

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
