#include "collectives.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "diagnostics.h"
#include "errors.h"

namespace pipecore {

namespace {
at::Tensor to_tensor(const std::vector<int64_t>& values, const std::string& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  if (!values.empty()) std::memcpy(t.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return t.to(c10::Device(device));
}

std::vector<int64_t> to_values(const at::Tensor& t) {
  at::Tensor host = t.cpu().contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

// Posts one operation (`post`: its Work) and waits for it: what either throws (gloo refuses to post on
// a pair a timed-out wait closed) is a CommError, the backend's text its cause.
template <typename Post>
void post_and_wait(Post&& post, const c10d::ProcessGroup& group, double timeout_s, const std::string& what) {
  const std::chrono::milliseconds timeout = timeout_of(timeout_s);
  try {
    post()->wait(timeout);
  } catch (const std::exception& e) {
    throw CommError(failed_waiting("rank " + std::to_string(group.getRank()) + ": " + what, timeout), error_text(e));
  }
}
}  // namespace

std::vector<int64_t> all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    const std::vector<int64_t>& values, const std::string& device, double timeout_s,
                                    const std::string& what) {
  std::vector<at::Tensor> tensors{to_tensor(values, device)};
  post_and_wait([&] { return group->allreduce(tensors); }, *group, timeout_s, what);
  return to_values(tensors[0]);
}

std::vector<std::vector<int64_t>> all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const std::vector<int64_t>& values, const std::string& device,
                                             double timeout_s, const std::string& what) {
  std::vector<at::Tensor> inputs{to_tensor(values, device)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group->getSize(); ++r) outputs[0].push_back(at::empty_like(inputs[0]));
  post_and_wait([&] { return group->allgather(outputs, inputs); }, *group, timeout_s, what);
  std::vector<std::vector<int64_t>> rows;
  for (const auto& t : outputs[0]) rows.push_back(to_values(t));
  return rows;
}

at::Tensor all_reduce_tensor(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor,
                             const std::string& op, double timeout_s, const std::string& what) {
  c10d::AllreduceOptions options;
  if (op == "sum") {
    options.reduceOp = c10d::ReduceOp::SUM;
  } else if (op == "max") {
    options.reduceOp = c10d::ReduceOp::MAX;
  } else {
    throw std::invalid_argument("all_reduce_tensor: op must be 'sum' or 'max', got '" + op + "'");
  }
  std::vector<at::Tensor> tensors{tensor.contiguous().clone()};
  post_and_wait([&] { return group->allreduce(tensors, options); }, *group, timeout_s, what);
  return tensors[0].clone();
}

at::Tensor exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor, int64_t peer,
                    double timeout_s, const std::string& what) {
  std::vector<at::Tensor> mine{tensor.clone()};
  std::vector<at::Tensor> theirs{at::empty_like(tensor)};
  const int dst = static_cast<int>(peer);
  const auto send = [&] { return group->send(mine, dst, 0); };
  const auto recv = [&] { return group->recv(theirs, dst, 0); };
  if (group->getRank() < peer) {
    post_and_wait(send, *group, timeout_s, what);
    post_and_wait(recv, *group, timeout_s, what);
  } else {
    post_and_wait(recv, *group, timeout_s, what);
    post_and_wait(send, *group, timeout_s, what);
  }
  return theirs[0].clone();
}

}  // namespace pipecore
