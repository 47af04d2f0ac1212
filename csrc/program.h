// The program one rank runs (pipecore/executor/program.py encodes it) and the tables derived from it
// once, when it is set: which actions receive, where device batches end, which backward is a stage's
// last, where OVERLAP_F_B pairs close.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pipecore {

// Instruction opcodes: the schedule's action kinds, plus the bracket of an OVERLAP_F_B container.
enum Op : int64_t {
  kF = 0, kI = 1, kW = 2, kB = 3,
  kSendF = 4, kRecvF = 5, kSendB = 6, kRecvB = 7,
  kUnshard = 8, kReshard = 9, kReduceGrad = 10,
  kOverlapBegin = 11, kOverlapEnd = 12,
};
inline bool is_send(int64_t op) { return op == kSendF || op == kSendB; }
inline bool is_recv(int64_t op) { return op == kRecvF || op == kRecvB; }
inline bool is_comm(int64_t op) { return op >= kSendF && op <= kRecvB; }
// Does action `op` send, receive or consume activations (F, SEND_F, RECV_F), rather than output
// gradients (B, I, SEND_B, RECV_B)?
inline bool carries_activations(int64_t op) { return op == kF || op == kSendF || op == kRecvF; }
// What that message is called in errors.
inline const char* message_name(int64_t op) { return carries_activations(op) ? "activations" : "output gradients"; }

// Stage events told to Python for stages whose module reduces its own gradients (torch DDP,
// FSDP2): the schedule's UNSHARD, RESHARD, REDUCE_GRAD, and this one, before the stage's last
// backward of the step (its last B, or I: such a stage's backward runs whole at I).
constexpr int64_t kLastBackwardEvent = 13;

// Integers per instruction (Python reads it as _C.INSTRUCTION_FIELDS).
constexpr int64_t kInstructionFields = 5;
struct Instr {
  int64_t op;
  int64_t stage;  // index into this rank's stages
  int64_t mb;     // microbatch (global index)
  int64_t peer;   // group rank for SEND/RECV, else -1
  int64_t label;  // index into labels ("PP:1F0")
};

// This rank's (stage, microbatch) pairs, numbered: the one key of every per-slot table.
struct SlotGrid {
  int64_t stages = 0;
  int64_t microbatches = 0;
  size_t size() const { return static_cast<size_t>(stages * microbatches); }
  size_t key(int64_t stage, int64_t mb) const { return static_cast<size_t>(stage * microbatches + mb); }
  size_t key(const Instr& in) const { return key(in.stage, in.mb); }
};

// The instructions and their tables: load() writes them all (and changes nothing if the program is
// refused), mark_last_backwards() re-derives the last backwards.
struct Program {
  std::vector<Instr> instrs;
  std::vector<std::string> labels;
  std::vector<size_t> recv_instrs;       // program indices of the RECV actions, in order
  std::vector<size_t> recvs_through;     // [i]: RECV actions among instrs[0..i]
  std::vector<char> waits_next;          // [i]: the compute action after SEND i takes a received message
  std::vector<int64_t> send_before_recv;  // [k]: last SEND to RECV k's peer before it (-1: none)
  std::vector<size_t> pair_end;          // [i] for an OVERLAP_F_B opening bracket: its closing bracket's index
  std::vector<size_t> batch_end;         // [i] for a SEND/RECV: one past the last action of its device batch
  std::vector<size_t> learning_end;      // the same in a discovery run (cut before each later RECV_F from a peer)
  std::vector<int64_t> last_backward_of;  // [i]: the stage whose last backward before its REDUCE_GRAD it is, or -1

  // Checks `flat` (kInstructionFields integers per instruction) against `grid` and derives the tables
  // of group rank `rank`'s program; `runs_whole(stage)`: that stage's backward runs whole at I (its
  // last backward may be an I).
  void load(const std::vector<int64_t>& flat, std::vector<std::string> names, const SlotGrid& grid, int64_t rank,
            const std::function<bool(int64_t)>& runs_whole);
  // Re-derives last_backward_of when which stages run whole changed.
  void mark_last_backwards(const std::function<bool(int64_t)>& runs_whole);
  size_t size() const { return instrs.size(); }
  const Instr& operator[](size_t i) const { return instrs[i]; }
  const std::string& label(const Instr& in) const { return labels[in.label]; }
};

}  // namespace pipecore
