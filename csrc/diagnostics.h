// The texts of the executor's errors that more than one place raises, written once.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace pipecore {

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

// "<where>: waiting for <what> of microbatch <mb> from rank <peer> failed (timeout <t> s): <why>".
std::string wait_failure(const std::string& where, const char* what, int64_t mb, int64_t peer,
                         std::chrono::milliseconds timeout, const char* why);

// What a step status other than ok (message_status.h) means, in the error message of `who` ("rank 5").
std::string step_status_text(const std::string& who, int64_t status);

}  // namespace pipecore
