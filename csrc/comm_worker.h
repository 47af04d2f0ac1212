// Sends and receives posted from a thread of their own (CPU groups). Posting a gloo operation takes
// locks shared with gloo's event-loop thread, and a send whose receiver is already waiting writes
// the whole message into the socket in the posting thread. Posted from here, compute goes on
// meanwhile, as a communication stream lets it on a GPU.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "comm_task.h"

namespace pipecore {

class CommWorker {
 public:
  CommWorker();
  ~CommWorker();
  // Posts `task` after every task queued before it (operations with a peer keep their order), then
  // marks it posted.
  void queue(std::shared_ptr<CommTask> task);
  // Posts `task` on the calling thread if nothing queued waits or is being posted (so the order with a
  // peer is kept) and returns true; false, doing nothing, otherwise. Throws what posting throws.
  bool post_if_idle(CommTask& task);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable queued_;
  std::deque<std::shared_ptr<CommTask>> tasks_;
  bool stop_ = false;
  bool posting_ = false;  // the worker is posting a task it took
  std::thread thread_;
};

}  // namespace pipecore
