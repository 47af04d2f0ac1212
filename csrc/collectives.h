// Small collectives of int64 values for the Pipeline's agreements between ranks.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace pipecore {

// Their tensors are made and dropped here, never seen by Python: a gloo worker thread that drops its
// Work after waking the waiter would otherwise release a Python tensor, which needs the GIL, while
// holding the group's lock (a deadlock with a thread that holds the GIL and waits for that lock, as
// destroying the group does). Both wait at most `timeout_s`; a failure or a timeout throws CommError
// naming `what`.
std::vector<int64_t> all_reduce_sum(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    const std::vector<int64_t>& values, const std::string& device, double timeout_s,
                                    const std::string& what);
// Every rank's values, in group rank order (each rank gives as many).
std::vector<std::vector<int64_t>> all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const std::vector<int64_t>& values, const std::string& device,
                                             double timeout_s, const std::string& what);

// The elementwise sum (op "sum") or maximum ("max") of every rank's `tensor` (same shape on all
// ranks), returned as a new tensor: identical on every rank.
at::Tensor all_reduce_tensor(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor,
                             const std::string& op, double timeout_s, const std::string& what);

// `tensor` to group rank `peer` and the same-sized tensor `peer` gives, returned (copies made here,
// for the reason above): the host path's MessagePath::exchange (the device path sends both in one group,
// DeviceComm::exchange). The lower rank sends first: also safe on backends whose send waits for its
// receive.
at::Tensor exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& tensor, int64_t peer,
                    double timeout_s, const std::string& what);

}  // namespace pipecore
