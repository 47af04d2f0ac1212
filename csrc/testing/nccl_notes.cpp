// The model's notes and names (nccl_notes.h).
#include "nccl_notes.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace pipecore {

int rank_of(const CommTask& task) { return task.channel ? task.channel->getRank() : task.group->getRank(); }

std::string describe(bool send, int peer, const std::vector<int64_t>& sizes, int64_t action) {
  std::ostringstream os;
  os << (send ? "send to rank " : "receive from rank ") << peer << " (";
  if (sizes.size() != 1) os << sizes.size() << " parts: ";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? " + " : "") << sizes[i];
  os << " bytes" << (action >= 0 ? ", action " + std::to_string(action) : std::string()) << ")";
  return os.str();
}

std::vector<int64_t> part_bytes(const CommTask& task) {
  std::vector<int64_t> sizes;
  for (const auto& part : task.parts) sizes.push_back(static_cast<int64_t>(part.nbytes()));
  return sizes;
}

// What an operation tells its peer of itself (the model's own messages, beside NCCL's): a send's note
// goes with it on kSendNoteTag, a receive's on kReceiveNoteTag, so the i-th note of a pair and tag is
// the i-th send (or receive) between them, the operation NCCL would match with it.
namespace {
constexpr int64_t kNoteMagic = 0x6e6363'6c6e6f74;  // "ncclnot"
constexpr int kNoteSizes = kNoteWords - 5;
}  // namespace

at::Tensor note_of(const CommTask& task) {
  at::Tensor note = at::zeros({kNoteWords}, at::kLong);
  auto* w = note.data_ptr<int64_t>();
  const auto sizes = part_bytes(task);
  w[0] = kNoteMagic;
  w[1] = task.send;
  w[2] = rank_of(task);
  w[3] = task.action;
  w[4] = static_cast<int64_t>(sizes.size());
  for (size_t i = 0; i < sizes.size() && i < kNoteSizes; ++i) w[5 + i] = sizes[i];
  return note;
}

void check_note(const CommTask& task, const at::Tensor& note) {
  const auto* w = note.data_ptr<int64_t>();
  TORCH_CHECK(w[0] == kNoteMagic, "pipecore (model of NCCL): rank ", task.peer, " sent bytes that are no note");
  std::vector<int64_t> theirs(w + 5, w + 5 + std::min<int64_t>(w[4], kNoteSizes));
  auto mine = part_bytes(task);
  if (mine.size() > static_cast<size_t>(kNoteSizes)) mine.resize(kNoteSizes);
  if (theirs == mine && w[4] == static_cast<int64_t>(task.parts.size())) return;
  throw std::runtime_error(
      "pipecore (model of NCCL): this would hang: rank " + std::to_string(rank_of(task)) + "'s " +
      describe(task.send, task.peer, part_bytes(task), task.action) + " is matched, in the pair's posting order, by rank " +
      std::to_string(w[2]) + "'s " + describe(w[1] != 0, static_cast<int>(rank_of(task)), theirs, w[3]) +
      "; NCCL waits forever on a receive of another size than its send");
}

}  // namespace pipecore
