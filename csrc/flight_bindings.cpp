// The flight record as Python reads it (flight_record.h; pipecore/runtime/doctor.py reads it when a step
// times out, from the watcher's thread, while the step's thread may be stuck).
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <functional>
#include <string>

#include "flight_record.h"
#include "step_profile.h"

namespace py = pybind11;

namespace pipecore {

namespace {

constexpr const char* kPhaseNames[] = {"idle",  "agreement", "run", "discovery", "abort", "finalise",
                                       "data-parallel reduction"};
static_assert(sizeof(kPhaseNames) / sizeof(kPhaseNames[0]) == FlightRecord::kPhases);

double seconds_since(int64_t then_ns, int64_t now_ns) { return then_ns ? (now_ns - then_ns) * 1e-9 : 0.0; }

py::dict wait_dict(const FlightRecord::Waiting& w, double seconds) {
  py::dict d;
  d["peer"] = w.peer;
  d["microbatch"] = w.mb;
  d["what"] = w.what ? w.what : "";
  d["send"] = w.send;
  d["seconds"] = seconds;
  return d;
}

}  // namespace

py::dict flight_record(const FlightRecord& f, const std::function<std::string(int64_t)>& label) {
  const int64_t now = FlightRecord::now_ns();
  py::dict out;
  out["step"] = f.step();
  const FlightRecord::Phase phase = f.phase();
  out["phase"] = phase >= 0 && phase < FlightRecord::kPhases ? kPhaseNames[phase] : "unknown";
  out["phase_seconds"] = seconds_since(f.phase_since_ns(), now);
  const int64_t action = f.action();
  if (action >= 0) {
    py::dict a;
    a["label"] = label(action);
    a["seconds"] = seconds_since(f.action_since_ns(), now);
    const int part = f.part();
    a["part"] = part >= 0 && part < static_cast<int>(Spent::kParts) ? kSpentNames[part].said : "unknown";
    // the threads other than this one that run its actions (an OVERLAP_F_B pair's other half)
    py::list halves;
    f.for_each_half([&](const FlightRecord::HalfState& h) {
      py::dict d;
      d["part"] = h.part < static_cast<int>(Spent::kParts) ? kSpentNames[h.part].said : "unknown";
      d["seconds"] = seconds_since(h.since_ns, now);
      d["thread"] = h.thread;
      halves.append(d);
    });
    a["halves"] = halves;
    out["action"] = a;
  } else {
    out["action"] = py::none();
  }
  const FlightRecord::Waiting w = f.waiting();
  // (a wait at the step's end, after its last action, runs with no action)
  out["waiting"] = w.since_ns != 0 ? py::object(wait_dict(w, seconds_since(w.since_ns, now))) : py::object(py::none());
  const auto [failed, failed_action] = f.failed_wait();
  if (failed.since_ns != 0) {
    py::dict d = wait_dict(failed, failed.since_ns * 1e-9);
    d["action"] = label(failed_action);
    out["failed_wait"] = d;
  } else {
    out["failed_wait"] = py::none();
  }
  py::list last;
  f.for_each_done([&](const FlightRecord::Done& d) {
    last.append(py::make_tuple(label(d.index), seconds_since(d.start_ns, now),
                               (d.end_ns - d.start_ns) * 1e-9));
  });
  out["last"] = last;
  py::list in_flight;
  const int64_t unlisted = f.for_each_in_flight([&](const FlightRecord::InFlight& m) {
    py::dict d;
    d["label"] = label(m.action);
    d["peer"] = m.peer;
    d["send"] = m.send;
    d["follow_up"] = m.follow_up;
    d["bytes"] = m.bytes;
    d["seconds"] = seconds_since(m.posted_ns, now);
    in_flight.append(d);
  });
  out["in_flight"] = in_flight;
  out["in_flight_unlisted"] = unlisted;
  return out;
}

void set_flight_phase(FlightRecord& flight, const std::string& phase, int64_t step) {
  for (int p = 0; p < FlightRecord::kPhases; ++p) {
    if (phase == kPhaseNames[p]) {
      if (step >= 0) flight.begin_step(step);
      return flight.set_phase(static_cast<FlightRecord::Phase>(p));
    }
  }
  TORCH_CHECK(false, "pipecore: no flight phase named ", phase);
}

}  // namespace pipecore
