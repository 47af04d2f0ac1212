// What an operation of the CPU model of NCCL (nccl_model.h) tells its peer of itself, beside the
// transfer: a note, on tags of the model's own, so that the i-th note between two ranks is of the
// operation NCCL would match with the i-th of theirs; and how the model names operations in its reports.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../comm_task.h"

namespace pipecore {

// The task's rank in its communicator.
int rank_of(const CommTask& task);
// "send to rank 1 (2 parts: 4096 + 16 bytes, action 12)"
std::string describe(bool send, int peer, const std::vector<int64_t>& sizes, int64_t action);
std::vector<int64_t> part_bytes(const CommTask& task);

// A send's note goes with it on kSendNoteTag, a receive's on kReceiveNoteTag; the tags above them are
// the model's too (nccl_connections.cpp).
constexpr int kSendNoteTag = (1 << 30) + (1 << 29);
constexpr int kReceiveNoteTag = kSendNoteTag + 1;
constexpr int kNoteWords = 16;  // magic, send, rank, action, parts, then up to 11 sizes

at::Tensor note_of(const CommTask& task);
// Throws if the peer's `note` is not of the operation NCCL would match with `task` (another size:
// both ranks would wait forever), naming both.
void check_note(const CommTask& task, const at::Tensor& note);

}  // namespace pipecore
