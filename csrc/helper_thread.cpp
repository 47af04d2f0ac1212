#include "helper_thread.h"

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace pipecore {

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

}  // namespace pipecore
