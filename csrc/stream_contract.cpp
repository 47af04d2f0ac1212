#include "stream_contract.h"

#include <c10/util/Exception.h>

namespace pipecore {

void before_batch(StreamSync& sync, const std::vector<std::shared_ptr<CommTask>>& tasks) {
  for (const auto& task : tasks) {
    for (const auto& part : task->parts) {
      sync.allocated(part, Lane::kCompute);
      if (task->send) sync.used(part, Lane::kCompute, /*writes=*/true);  // framed there
    }
  }
  // rule 1: every batch, whatever it holds
  sync.wait(Lane::kComm, *sync.record(Lane::kCompute));
  for (const auto& task : tasks) {
    for (const auto& part : task->parts) sync.used(part, Lane::kComm, /*writes=*/!task->send);
  }
}

void after_batch(const std::shared_ptr<StreamSync>& sync, const std::vector<std::shared_ptr<CommTask>>& tasks) {
  std::shared_ptr<StreamMarker> ready;
  for (const auto& task : tasks) {
    if (task->send) continue;
    if (!ready) ready = sync->record(Lane::kComm);
    task->ready = ready;
    // rule 3; a task is dropped once, on the thread that lets go of it last
    task->release = [sync](CommTask& t) {
      if (!t.consumed) sync->wait(Lane::kCompute, *t.ready);
      for (const auto& part : t.parts) sync->freed(part);
    };
  }
}

void header_to_host(StreamSync& sync, const CommTask& task) {
  TORCH_CHECK(!task.send && task.header_bytes > 0 && !task.ready,
              "pipecore: a header goes to the host from a shaped receive, before its batch's ready event");
  sync.used(task.parts[0], Lane::kComm, /*writes=*/false);
}

void before_read(StreamSync& sync, CommTask& task) {
  TORCH_CHECK(task.ready, "pipecore: a device receive without its ready event");
  sync.wait(Lane::kCompute, *task.ready);  // rule 2
  task.consumed = true;
  for (const auto& part : task.parts) sync.used(part, Lane::kCompute, /*writes=*/false);
}

}  // namespace pipecore
