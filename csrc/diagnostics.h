// The texts of the executor's errors that more than one place raises, written once.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

namespace pipecore {

// The message of an exception ("unknown error" if it is not a std::exception), without the Python
// traceback that pybind11 appends to a Python error that crossed C++ ("\n\nAt:\n  file(line): ..."): an
// error message says what happened; the traceback is Python's to show. Nor c10's C++ backtrace (as torch shows
// c10d's errors). A CommError's text is followed by its cause's.
std::string error_text(const std::exception_ptr& error);
std::string error_text(const std::exception& error);

// A timeout as Python gives it (seconds) and as the executor waits it.
std::chrono::milliseconds timeout_of(double seconds);
// A timeout as errors state it: "60 s".
std::string seconds(std::chrono::milliseconds timeout);

// Why a message that is not pipecore's arrived, after "the messages between ...".
constexpr const char* kOutOfStepCause =
    "are out of step (another send or receive on this process group with the same peer, or a schedule lowered "
    "differently there)";

// "<where>: the <what> of microbatch <mb> from rank <peer> <how>: the messages between the two ranks are out of
// step (...)": a received message that is not pipecore's (`how`: what was wrong with it).
std::string out_of_step(const std::string& where, const char* what, int64_t mb, int64_t peer, const char* how);

// "<subject> failed (timeout <t>): <why>": a wait that ended in an error or at its timeout (no `why`: the
// backend's error says it, as the CommError's cause).
std::string failed_waiting(const std::string& subject, std::chrono::milliseconds timeout, const char* why = nullptr);

// "<where>: waiting for <what> of microbatch <mb> from rank <peer> failed (timeout <t> s)", and why if given.
std::string wait_failure(const std::string& where, const char* what, int64_t mb, int64_t peer,
                         std::chrono::milliseconds timeout, const char* why = nullptr);

// "<what did not happen> within <t> (<why>)": a deadline passed (a wait that failed is failed_waiting's).
std::string not_within(const std::string& what, std::chrono::milliseconds timeout, const char* why);

// Why a message was not posted in time.
constexpr const char* kPostingStuck = "the group's posting is stuck";

// "<where>: a send to rank <peer> was not posted within <t> (the group's posting is stuck)" (`send` false: a receive
// from): a message the comm worker did not post in time.
std::string not_posted(const std::string& where, bool send, int64_t peer, std::chrono::milliseconds timeout);

// What a received message's status other than ok (message_status.h) says, for the consuming action at
// `where`: "<where>: the <what> of microbatch <mb> from rank <peer> say the sender's step was aborted" (or
// that a first stage's batch changed shape); a message that is not pipecore's is out_of_step's, with `how`.
std::string message_status_text(const std::string& where, const char* what, int64_t mb, int64_t peer, int64_t status,
                                const char* how);

// What a step status other than ok means, in the error message of `who` ("rank 5").
std::string step_status_text(const std::string& who, int64_t status);

}  // namespace pipecore
