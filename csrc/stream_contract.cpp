#include "stream_contract.h"

#include <c10/util/Exception.h>

namespace pipecore {

void before_batch(StreamSync& sync, const ComputeStream& compute, const std::vector<std::shared_ptr<CommTask>>& tasks) {
  for (const auto& task : tasks) {
    for (const auto& part : task->parts) {
      sync.allocated(part, compute);
      if (task->send) sync.used(part, Lane::kCompute, compute, /*writes=*/true, *task);  // framed there
    }
  }
  // rule 1: every batch, whatever it holds
  sync.wait(Lane::kComm, *sync.record(Lane::kCompute, compute), compute);
  for (const auto& task : tasks) {
    for (const auto& part : task->parts) sync.used(part, Lane::kComm, compute, /*writes=*/!task->send, *task);
  }
}

std::shared_ptr<StreamMarker> after_batch(StreamSync& sync, const ComputeStream& compute,
                                          const std::vector<std::shared_ptr<CommTask>>& tasks) {
  for (const auto& task : tasks) {
    if (task->send) continue;
    std::shared_ptr<StreamMarker> ready = sync.record(Lane::kComm, compute);
    ready->owner = compute;  // where a receive dropped unread waits (rule 3)
    return ready;
  }
  return nullptr;
}

void header_to_host(StreamSync& sync, const ComputeStream& compute, const CommTask& task) {
  TORCH_CHECK(!task.send && task.header_bytes > 0, "pipecore: a header goes to the host from a shaped receive");
  sync.used(task.parts[0], Lane::kComm, compute, /*writes=*/false, task);
}

void before_read(StreamSync& sync, const ComputeStream& compute, const CommTask& task, const StreamMarker& ready) {
  sync.wait(Lane::kCompute, ready, compute);  // rule 2
  for (const auto& part : task.parts) sync.used(part, Lane::kCompute, compute, /*writes=*/false, task);
}

void on_release(StreamSync& sync, const ComputeStream& compute, const CommTask& task, const StreamMarker& ready,
                bool consumed) {
  if (!consumed) sync.wait(Lane::kOwner, ready, compute);  // rule 3
  for (const auto& part : task.parts) sync.freed(part, task);
}

}  // namespace pipecore
