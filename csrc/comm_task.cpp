#include "comm_task.h"

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

}  // namespace pipecore
