// Threads that help a rank's compute thread (the comm worker, the send tracker's threads).
#pragma once

namespace pipecore {

// Names the calling thread (as profilers show it) and, on Linux, makes it SCHED_BATCH: woken, it does
// not preempt the thread running on its core (a rank's compute thread) but runs on an idle core, when
// that thread waits, or at the scheduler's next tick. Its weight is a normal thread's, so it is not
// starved as at a lower priority (nice 19 was tried: the worker starved). Measured on 2 gloo ranks
// sharing 2 cores: waking the comm worker had cost the compute thread up to 4 ms (docs/performance.md).
void become_helper_thread(const char* name);

}  // namespace pipecore
