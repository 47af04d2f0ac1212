// The flight record's own cost (csrc/flight_record.h), which bench/overhead.py's step times cannot
// resolve: the same loop run with the record's writes and without them, best of `reps` repetitions.
//   compute action: begin_action, the part set on entering and leaving its scope (SpentOn), end_action
//   message:        posted, a wait's begin and end, completed (a receive on the host path; a send is
//                   posted and completed without a wait)
// Prints "action <ns> message <ns>": nanoseconds per compute action and per message, the record's
// writes less the bare loop's (below zero: not measurable). bench/overhead.py builds it with the
// extension's -O2 and runs it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "flight_record.h"

namespace {

using pipecore::FlightRecord;

inline void barrier() { asm volatile("" ::: "memory"); }  // the bare loop is not folded away

template <typename Body>
double best_ns_per_iteration(long iterations, int reps, Body&& body) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iterations; ++i) body(i);
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / iterations);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 2000000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  static FlightRecord flight;  // (as the executor's: one per Pipeline, alive across steps)
  const double bare = best_ns_per_iteration(iterations, reps, [](long) { barrier(); });
  const double action = best_ns_per_iteration(iterations, reps, [&](long i) {
    flight.begin_action(i);
    flight.set_part(1);  // entering the forward's scope
    barrier();
    flight.set_part(0);  // leaving it
    flight.end_action();
  });
  const double message = best_ns_per_iteration(iterations, reps, [&](long i) {
    const int64_t ticket = flight.posted(i, 1, 4096, /*send=*/false, /*follow_up=*/false);
    const pipecore::WaitingOn waiting(flight, 1, i, "activations");
    barrier();
    flight.completed(ticket);
  });
  std::printf("action %.2f message %.2f\n", action - bare, message - bare);
  return 0;
}
