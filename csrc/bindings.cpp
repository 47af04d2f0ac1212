// pipecore._C: Python bindings of the executor.
#include <torch/csrc/utils/pybind.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <sstream>

#if defined(__has_include)
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif
#endif

#include "collectives.h"
#include "executor.h"
#include "grad_reduce.h"
#include "message_status.h"
#include "weight_store.h"

#ifndef TORCH_EXTENSION_NAME
#error "TORCH_EXTENSION_NAME must be defined (set by torch.utils.cpp_extension or CMakeLists.txt)"
#endif

namespace py = pybind11;

namespace pipecore {
// flight_bindings.cpp: a flight record as Python reads it (`label`: an action's label), and its phases set
py::dict flight_record(const FlightRecord& flight, const std::function<std::string(int64_t)>& label);
void set_flight_phase(FlightRecord& flight, const std::string& phase, int64_t step);
}  // namespace pipecore

#ifdef PIPECORE_TESTING
namespace pipecore {
void bind_nccl_model(py::module& m);  // testing/nccl_model_harness.cpp
}
#endif

#ifdef PIPECORE_COVERAGE
extern "C" void __gcov_dump(void);
extern "C" void __gcov_reset(void);
#endif

namespace {

py::dict build_info() {
  py::dict info;
#ifdef PIPECORE_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef PIPECORE_NVTX
  info["nvtx"] = true;
#else
  info["nvtx"] = false;
#endif
#ifdef TORCH_VERSION
  info["torch_version"] = py::str(TORCH_VERSION);
#else
  info["torch_version"] = py::str("");
#endif
  info["testing"] = pipecore::kTesting;  // a test build (PIPECORE_TESTING): its hooks are bound
  info["compiler"] = py::str(__VERSION__);
#ifdef __GLIBCXX__
  info["libstdcxx_headers"] = py::int_(__GLIBCXX__);  // the date of the libstdc++ it was compiled against
#else
  info["libstdcxx_headers"] = py::int_(0);
#endif
  return info;
}

// What breaks first when the extension's C++ runtime differs from the one loaded with torch (seen:
// a g++ newer than the system's, its extension crashing in std::ostringstream): text formatted by
// a stream, an exception thrown with it and translated at the module's boundary.
void self_check(int64_t n) {
  std::ostringstream os;
  os << "pipecore self-check " << n << ' ' << 0.5 * n;
  throw pipecore::CommError(os.str());
}

// Specs arrive as meta tensors (shape, dtype, requires_grad) from Python.
std::vector<pipecore::TensorSpec> to_specs(const std::vector<at::Tensor>& metas) {
  std::vector<pipecore::TensorSpec> specs;
  specs.reserve(metas.size());
  for (const auto& t : metas) {
    specs.push_back({t.sizes().vec(), t.scalar_type(), t.requires_grad()});
  }
  return specs;
}

pipecore::OverlapMode overlap_mode(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "pipecore: overlap mode 0 (sequential), 1 (concurrent) or 2 (lockstep)");
  return static_cast<pipecore::OverlapMode>(mode);
}

void run(pipecore::Executor& self, py::function forward, py::function on_abort, py::object discover) {
  // The loop runs without the GIL; only a stage's forward (user Python) takes it.
  pipecore::ForwardFn fn = [&forward](int64_t stage, int64_t mb, std::vector<at::Tensor>& inputs,
                                      std::vector<at::Tensor>& outputs, at::Tensor& loss, double& seed) {
    py::gil_scoped_acquire gil;
    py::object result = forward(stage, mb, inputs);
    auto tup = result.cast<py::tuple>();
    outputs = tup[0].cast<std::vector<at::Tensor>>();
    if (!tup[1].is_none()) loss = tup[1].cast<at::Tensor>();
    seed = tup[2].cast<double>();
  };
  pipecore::AbortFn abort_fn = [&on_abort](const std::string& error, const std::string& action) {
    py::gil_scoped_acquire gil;
    py::error_scope keep;  // a pending Python error (the failure itself) is set aside meanwhile
    try {
      on_abort(py::reinterpret_steal<py::str>(
                   PyUnicode_DecodeUTF8(error.data(), static_cast<Py_ssize_t>(error.size()), "replace")),
               action);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("pipecore: reporting a failure to the other ranks");
    }
  };
  pipecore::SpecFn spec_fn;
  if (!discover.is_none()) {
    spec_fn = [&discover](int64_t stage, int64_t mb, int64_t op, bool may_wait) -> int64_t {
      py::gil_scoped_acquire gil;
      py::error_scope keep;  // asked while a failed step releases its peers: its Python error waits
      return discover(stage, mb, op, may_wait).cast<int64_t>();
    };
  }
  py::gil_scoped_release nogil;
  self.run(fn, abort_fn, spec_fn ? &spec_fn : nullptr);
}


// Python's deleter of an Executor: its threads are joined with the GIL released (a tensor they free
// may need the GIL, which the thread deleting the executor holds), then the rest, which may hold
// Python callbacks, is destroyed with the GIL held.
struct ExecutorDeleter {
  void operator()(pipecore::Executor* executor) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      executor->join_threads();
    } else {
      executor->join_threads();
    }
    delete executor;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pipecore native extension: the pipeline executor";
  m.def("build_info", &build_info,
        "Compile-time configuration of pipecore._C: {'cuda': bool, 'nvtx': bool, 'testing': bool, 'torch_version': "
        "str, 'compiler': str, 'libstdcxx_headers': int}.");
  m.def("_self_check", &self_check, py::arg("n"),
        "raises CommError('pipecore self-check N N/2'); pipecore.tools.build_check runs it in a fresh process");

  pipecore::bind_weight_store(m);

  // The executor's constants, read by Python instead of copied (pipecore/executor/native.py)
  py::dict opcodes;
  opcodes["F"] = int64_t{pipecore::kF};
  opcodes["I"] = int64_t{pipecore::kI};
  opcodes["W"] = int64_t{pipecore::kW};
  opcodes["B"] = int64_t{pipecore::kB};
  opcodes["SEND_F"] = int64_t{pipecore::kSendF};
  opcodes["RECV_F"] = int64_t{pipecore::kRecvF};
  opcodes["SEND_B"] = int64_t{pipecore::kSendB};
  opcodes["RECV_B"] = int64_t{pipecore::kRecvB};
  opcodes["UNSHARD"] = int64_t{pipecore::kUnshard};
  opcodes["RESHARD"] = int64_t{pipecore::kReshard};
  opcodes["REDUCE_GRAD"] = int64_t{pipecore::kReduceGrad};
  opcodes["OVERLAP_BEGIN"] = int64_t{pipecore::kOverlapBegin};
  opcodes["OVERLAP_END"] = int64_t{pipecore::kOverlapEnd};
  m.attr("OPCODES") = opcodes;
  py::dict stage_events;
  stage_events["UNSHARD"] = int64_t{pipecore::kUnshard};
  stage_events["RESHARD"] = int64_t{pipecore::kReshard};
  stage_events["REDUCE_GRAD"] = int64_t{pipecore::kReduceGrad};
  stage_events["LAST_BACKWARD"] = pipecore::kLastBackwardEvent;
  m.attr("STAGE_EVENTS") = stage_events;
  py::dict message_status;  // what a step's messages say instead of data (message_status.h)
  message_status["OK"] = int64_t{pipecore::kMessageOk};
  message_status["ABORTED"] = int64_t{pipecore::kMessageAborted};
  message_status["REPLAN"] = int64_t{pipecore::kMessageReplan};
  m.attr("MESSAGE_STATUS") = message_status;
  py::dict spec_answers;  // what Python's discovery answers the executor (SpecFn)
  spec_answers["SET"] = int64_t{pipecore::kSpecsSet};
  spec_answers["ABSENT"] = int64_t{pipecore::kSpecsAbsent};
  spec_answers["TIMED_OUT"] = int64_t{pipecore::kSpecsTimedOut};
  m.attr("SPEC_ANSWERS") = spec_answers;
  py::dict overlap_modes;
  overlap_modes["sequential"] = static_cast<int64_t>(pipecore::OverlapMode::kSequential);
  overlap_modes["concurrent"] = static_cast<int64_t>(pipecore::OverlapMode::kConcurrent);
  overlap_modes["lockstep"] = static_cast<int64_t>(pipecore::OverlapMode::kLockstep);
  m.attr("OVERLAP_MODES") = overlap_modes;
  m.attr("INSTRUCTION_FIELDS") = pipecore::kInstructionFields;
  m.attr("DEFAULT_RECV_WINDOW") = pipecore::kDefaultRecvWindow;
  m.attr("DEFAULT_SEND_BUDGET") = pipecore::kDefaultSendBudget;
  m.attr("DESCRIPTION_TAG") = pipecore::kDescriptionTag;
#ifdef PIPECORE_COVERAGE
  // a coverage build: processes that end without exit's handlers (os._exit, a kill) write their counts first
  m.def("_write_coverage", [] {
    __gcov_dump();
    __gcov_reset();
  });
#endif

  m.def("overlap_hand_over", &pipecore::overlap_hand_over, py::call_guard<py::gil_scoped_release>(),
        "lock-step OVERLAP_F_B pair: the running half lets the other compute; returns which half it is (-1: "
        "no lock-step pair runs)");
  m.def("overlap_take_back", &pipecore::overlap_take_back, py::arg("half"), py::call_guard<py::gil_scoped_release>(),
        "waits until `half` (from overlap_hand_over) may compute again");
  py::register_exception<pipecore::PeerAbort>(m, "PeerAbort", PyExc_RuntimeError);
  // the type lives as long as the module (a raw pointer: nothing to release after Python finalised)
  static PyObject* comm_error = py::register_exception<pipecore::CommError>(m, "CommError", PyExc_RuntimeError).ptr();
  // (registered after register_exception's own translator, so tried first) the backend's text as __cause__
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const pipecore::CommError& e) {
      py::object error = py::reinterpret_borrow<py::object>(comm_error)(e.what());
      if (!e.cause.empty()) {
        py::object cause = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.cause);
        PyException_SetCause(error.ptr(), cause.release().ptr());  // (steals the reference)
      }
      PyErr_SetObject(comm_error, error.ptr());
    }
  });
  py::register_exception<pipecore::PeerReplan>(m, "PeerReplan", PyExc_RuntimeError);

  m.def("all_reduce_sum", &pipecore::all_reduce_sum, py::arg("group"), py::arg("values"), py::arg("device"),
        py::arg("timeout"), py::arg("what"), py::call_guard<py::gil_scoped_release>(),
        "the sums of every rank's int64 `values` (tensors on `device` never seen by Python); CommError on failure");
  m.def("all_gather", &pipecore::all_gather, py::arg("group"), py::arg("values"), py::arg("device"),
        py::arg("timeout"), py::arg("what"), py::call_guard<py::gil_scoped_release>(),
        "every rank's int64 `values`, in group rank order; CommError on failure");
  m.def("all_reduce_tensor", &pipecore::all_reduce_tensor, py::arg("group"), py::arg("tensor"), py::arg("op"),
        py::arg("timeout"), py::arg("what"), py::call_guard<py::gil_scoped_release>(),
        "every rank's `tensor` reduced elementwise (op 'sum' or 'max'), a new tensor equal on every rank; CommError "
        "on failure");

  py::class_<pipecore::GradReducer, std::shared_ptr<pipecore::GradReducer>>(
      m, "GradReducer", "data-parallel gradient buckets of plain stages (csrc/grad_reduce.h)")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, double>(), py::arg("group"), py::arg("timeout"))
      .def("add_bucket", &pipecore::GradReducer::add_bucket, py::arg("stage"), py::arg("params"), py::arg("like"))
      .def("begin_step", &pipecore::GradReducer::begin_step)
      .def("finish", &pipecore::GradReducer::finish, py::arg("failed"), py::arg("scale"),
           py::call_guard<py::gil_scoped_release>(),
           "sends what is left, waits for every bucket; True if every replica's step succeeded (then the "
           "gradients hold the reduced sums times `scale`)")
      .def("restore", &pipecore::GradReducer::restore, py::arg("keep"))
      .def_property_readonly("num_buckets", &pipecore::GradReducer::num_buckets)
      .def_property_readonly("early_buckets", &pipecore::GradReducer::early_buckets,
                             "buckets of the last step sent from the backward's hooks, before REDUCE_GRAD")
      .def("trace", [](const pipecore::GradReducer& self) {
        py::list out;
        for (const auto& e : self.trace()) out.append(py::make_tuple(e.stage, e.bucket, e.bytes, e.start_us, e.end_us));
        return out;
      }, "(local stage, bucket, bytes, sent_us, completed_us) per bucket sent in the last step");

  auto executor = py::class_<pipecore::Executor, std::unique_ptr<pipecore::Executor, ExecutorDeleter>>(m, "Executor");
  executor
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, int64_t, int64_t, double, std::string>(), py::arg("group"),
           py::arg("num_stages"), py::arg("num_microbatches"), py::arg("timeout"), py::arg("who") = "")
      .def("set_program", &pipecore::Executor::set_program, py::arg("instructions"), py::arg("labels"))
      .def(
          "set_specs",
          [](pipecore::Executor& self, int64_t stage, int64_t mb, const std::vector<at::Tensor>& recv_f,
             const std::vector<at::Tensor>& send_f, const at::Tensor& like) {
            self.set_specs(stage, mb, to_specs(recv_f), to_specs(send_f), like.options());
          },
          py::arg("stage"), py::arg("mb"), py::arg("recv_f"), py::arg("send_f"), py::arg("like"))
      .def("run_aborted", &pipecore::Executor::run_aborted, py::arg("status"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_links", &pipecore::Executor::set_links, py::arg("stage"), py::arg("next_local"),
           py::arg("prev_local"))
      .def("set_free_outputs", &pipecore::Executor::set_free_outputs, py::arg("free"))
      .def("set_grad_reducer", &pipecore::Executor::set_grad_reducer, py::arg("reducer"))
      .def(
          "set_stage_events",
          [](pipecore::Executor& self, std::vector<int64_t> stages, py::object fn) {
            if (fn.is_none()) {
              self.set_stage_events({}, {});
              return;
            }
            auto callback = std::make_shared<py::object>(std::move(fn));  // freed with the GIL: by Python
            self.set_stage_events(std::move(stages), [callback](int64_t event, int64_t stage) {
              py::gil_scoped_acquire gil;
              (*callback)(event, stage);
            });
          },
          py::arg("stages"), py::arg("fn"),
          "fn(event, local stage) for UNSHARD (8), RESHARD (9), REDUCE_GRAD (10) and before the last backward "
          "(13) of these stages, whose backward runs whole (no I/W split)")
      .def(
          "set_weight_builders",
          [](pipecore::Executor& self, std::vector<int64_t> stages, py::object fn) {
            if (fn.is_none()) {
              self.set_weight_builders({}, {});
              return;
            }
            auto callback = std::make_shared<py::object>(std::move(fn));  // freed with the GIL: by Python
            self.set_weight_builders(std::move(stages), [callback](int64_t stage) {
              py::gil_scoped_acquire gil;
              py::object runner = (*callback)(stage);
              if (!PyCallable_Check(runner.ptr())) {
                throw py::type_error("dw_builder() of local stage " + std::to_string(stage) +
                                     " must return a callable (the runner of that microbatch's weight gradients), "
                                     "got " + std::string(py::str(py::type::handle_of(runner).attr("__name__"))));
              }
              return pipecore::python_closure(runner);
            });
          },
          py::arg("stages"), py::arg("fn"),
          "fn(local stage) -> runner: these stages' backward runs whole at I (or B) and their W calls runner() "
          "(B: at once), as torch's PipelineStage dw_builder")
      .def(
          "set_overlap",
          [](pipecore::Executor& self, int64_t mode, py::object hook, const std::string& device) {
            pipecore::Executor::OverlapHook fn;
            if (!hook.is_none()) {
              auto callback = std::make_shared<py::object>(std::move(hook));  // freed with the GIL: by Python
              fn = [callback](int64_t bracket) {
                py::gil_scoped_acquire gil;
                (*callback)(bracket);
              };
            }
            self.set_overlap(overlap_mode(mode), std::move(fn), c10::Device(device));
          },
          py::arg("mode"), py::arg("hook"), py::arg("device"),
          "how OVERLAP_F_B pairs run: 0 sequential, 1 concurrent, 2 lockstep; hook(bracket index) runs each pair "
          "instead, through run_pair_half / run_pair")
      .def(
          "run_pair_half",
          [](pipecore::Executor& self, int64_t bracket, int half) { self.run_pair_half(bracket, half); },
          py::arg("bracket"), py::arg("half"), py::call_guard<py::gil_scoped_release>())
      .def(
          "run_pair",
          [](pipecore::Executor& self, int64_t bracket, int64_t mode) {
            self.run_pair(bracket, overlap_mode(mode));
          },
          py::arg("bracket"), py::arg("mode"), py::call_guard<py::gil_scoped_release>())
      .def("pair_sequential_reason", &pipecore::Executor::pair_sequential_reason, py::arg("bracket"),
           py::call_guard<py::gil_scoped_release>(),
           "for an overlap hook: why its pair must run in sequence ('' if it may overlap)")
      .def_property_readonly("overlapped_pairs", &pipecore::Executor::overlapped_pairs,
                             "since construction: OVERLAP_F_B pairs run on two threads (concurrent or lockstep)")
      .def("overlap_fallbacks", &pipecore::Executor::overlap_fallbacks,
           "since construction: {why: pairs} that ran in sequence although the mode overlaps them")
      .def("set_send_budget", &pipecore::Executor::set_send_budget, py::arg("bytes"))
      .def("set_recv_window", &pipecore::Executor::set_recv_window, py::arg("receives"),
           py::arg("past_sends"), py::arg("max_bytes") = pipecore::kRecvWindowBytes)
      .def("set_comm_thread", &pipecore::Executor::set_comm_thread, py::arg("on"))
      .def("set_device_comm", &pipecore::Executor::set_device_comm, py::arg("device"),
           "NCCL groups: batches on a communication stream, events, statuses on the device; False where this "
           "build has no such path for `device`")
      .def_property_readonly("device_comm", &pipecore::Executor::device_comm)
      .def("set_reverse_channel", &pipecore::Executor::set_reverse_channel, py::arg("channel"))
      .def("set_follow_up_channels", &pipecore::Executor::set_follow_up_channels, py::arg("up"), py::arg("down"))
      .def("connect_communicators", &pipecore::Executor::connect_communicators, py::arg("pair_channels"),
           py::arg("peers"), py::arg("exchange_peers"), py::call_guard<py::gil_scoped_release>(),
           "before the first step, on every rank at once: connects every communicator the message path posts on")
      .def("exchange", &pipecore::Executor::exchange, py::arg("tensor"), py::arg("peer"), py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           "between steps: sends `tensor` to group rank `peer` and returns what `peer` sends (the same size), on the "
           "communicators the messages use; CommError on failure")
      .def("run", &run, py::arg("forward"), py::arg("on_abort"), py::arg("discover") = py::none(),
           "runs the program; `discover(stage, mb, op, may_wait) -> 0 set / 1 absent / 2 timed out` makes it a "
           "discovery run (see SpecFn in executor.h)")
      .def(
          "set_input_specs",
          [](pipecore::Executor& self, int64_t stage, int64_t mb, const std::vector<at::Tensor>& recv_f,
             const at::Tensor& like) { self.set_input_specs(stage, mb, to_specs(recv_f), like.options()); },
          py::arg("stage"), py::arg("mb"), py::arg("recv_f"), py::arg("like"))
      .def(
          "set_output_specs",
          [](pipecore::Executor& self, int64_t stage, int64_t mb, const std::vector<at::Tensor>& send_f,
             const at::Tensor& like) { self.set_output_specs(stage, mb, to_specs(send_f), like.options()); },
          py::arg("stage"), py::arg("mb"), py::arg("send_f"), py::arg("like"))
      .def("forget_specs", &pipecore::Executor::forget_specs)
      .def("set_shapes_travel", &pipecore::Executor::set_shapes_travel, py::arg("on"),
           "messages carry their shapes (the host and the device path), set shapes are capacities (csrc/executor.h)")
      .def_property_readonly("shapes_travel", &pipecore::Executor::shapes_travel)
      .def_property("batch_rows", &pipecore::Executor::batch_rows, &pipecore::Executor::set_batch_rows,
                    "shaped messages: the step's batch rows (set on first-stage ranks, learnt elsewhere; -1: not yet)")
      .def_property_readonly("message_counts", &pipecore::Executor::message_counts,
                             "(messages, point-to-point sends of their parts, grown messages sent again) of the "
                             "last run")
      .def(
          "flight_record",
          [](pipecore::Executor& self) {
            return pipecore::flight_record(self.flight(), [&](int64_t i) { return self.action_label(i); });
          },
          "what this rank does now and did last (flight_record.h): phase, action, part, wait, last actions")
      .def(
          "set_flight_phase",
          [](pipecore::Executor& self, const std::string& phase, int64_t step) {
            pipecore::set_flight_phase(self.flight(), phase, step);
          },
          py::arg("phase"), py::arg("step") = -1)
      .def("set_trace", &pipecore::Executor::set_trace, py::arg("on"), py::arg("device") = "cpu")
      .def("set_profile", &pipecore::Executor::set_profile, py::arg("on"))
      .def("profile",
           [](const pipecore::Executor& self) {  // microseconds of the last profiled run, by part
             using pipecore::Spent;
             const auto& p = self.profile();
             py::dict out;
             for (int part = 0; part < static_cast<int>(Spent::kParts); ++part) {
               out[pipecore::kSpentNames[part].key] = p.us(static_cast<Spent>(part));
             }
             out["run"] = p.total_us();
             return out;
           })
      .def("trace",
           [](pipecore::Executor& self) {
             py::list out;
             for (const auto& e : self.trace()) {
               out.append(py::make_tuple(self.label(e.label), e.start_us, e.end_us, e.lane));
             }
             return out;
           })
      .def("reset", &pipecore::Executor::reset, py::call_guard<py::gil_scoped_release>())
      .def("split_fallbacks",
           [](const pipecore::Executor& self) {
             py::list out;
             for (const auto& stage : self.split_fallbacks()) {
               py::dict d;
               for (const auto& [f, n] : stage) {
                 d[py::make_tuple(f.node, pipecore::reason_name(f.why), f.param)] = n;
               }
               out.append(d);
             }
             return out;
           },
           "per local stage: {(node name, why, parameter TensorImpl address or 0): microbatches} whose input "
           "backward (I) computed weight gradients because that node cannot be split")
      .def_property_readonly("rank", &pipecore::Executor::rank)
      .def_property_readonly("last_comm_failure", &pipecore::Executor::last_comm_failure,
                             "after a run that rethrew this rank's own error: how communication failed while "
                             "releasing the peers (empty if it did not)")
      .def_property_readonly("last_comm_failure_cause", &pipecore::Executor::last_comm_failure_cause,
                             "what the backend said of that failure (empty if nothing)");
#ifdef PIPECORE_TESTING
  // hooks and records of test builds only (`make test`; csrc/executor.h)
  executor.def("set_delays", &pipecore::Executor::set_delays, py::arg("max_us"), py::arg("seed"))
      .def_property_readonly("freed_outputs", &pipecore::Executor::freed_outputs)
      .def_property_readonly("held_failed_sends", &pipecore::Executor::held_failed_sends,
                             "sends that failed or timed out, whose buffers are held until this executor goes (a "
                             "transfer may read them until its communicator is aborted: send_tracker.h)")
      .def_property_readonly("peak_send_bytes", &pipecore::Executor::peak_send_bytes,
                             "largest sum of bytes not yet released to one peer during the last run (in flight, "
                             "or small packed sends not collected yet: send_tracker.h)")
      .def_property_readonly("threaded_posts", &pipecore::Executor::threaded_posts)
      .def_property_readonly("posted_here", &pipecore::Executor::posted_here)
      .def("batch_ends", &pipecore::Executor::batch_ends, py::arg("learning") = false,
           "per program index: for a SEND/RECV, one past the last action of its device batch, as a step that "
           "learns shapes posts them with learning=True (else 0)")
      .def("set_large_messages", &pipecore::Executor::set_large_messages, py::arg("min_bytes"))
      .def("_emulate_device_comm", &pipecore::Executor::emulate_device_comm, py::arg("all_ranks_connected") = false,
           py::arg("eager_bytes") = 0,
           "the device path's protocol run by the host on CPU tensors over gloo (testing/host_device_comm.cpp); "
           "all_ranks_connected: as a group made with a device id; eager_bytes: sends of at most that many bytes "
           "complete before their receiver posts (NCCL's eager protocol; 0: every send is a rendezvous)")
      .def("_connection_counts", &pipecore::Executor::connection_counts,
           "communicators the path connected so far: (ahead of every step, by a step's operation, store operations)")
      .def("_stream_violations", &pipecore::Executor::stream_violations,
           "what the emulated device path's stream-contract checker refused (testing/stream_ledger.h)")
      .def("recv_posted_at", &pipecore::Executor::recv_posted_at,
           "per RECV action of the last run, in program order: the program index before which it was posted")
      .def_property_readonly("reverse_posts", &pipecore::Executor::reverse_posts);
  pipecore::bind_nccl_model(m);
#endif
}
