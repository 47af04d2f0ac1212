#include "program.h"

#include <c10/util/Exception.h>

#include <unordered_map>
#include <unordered_set>

namespace pipecore {

namespace {

// Which RECV actions a send is the last before, per peer; and which actions receive at all.
void derive_receives(Program& p) {
  p.recv_instrs.clear();
  p.send_before_recv.clear();
  p.recvs_through.assign(p.size(), 0);
  std::unordered_map<int64_t, int64_t> last_send;  // peer -> program index
  for (size_t i = 0; i < p.size(); ++i) {
    const Instr& in = p[i];
    if (is_send(in.op)) last_send[in.peer] = static_cast<int64_t>(i);
    if (is_recv(in.op)) {
      p.recv_instrs.push_back(i);
      auto it = last_send.find(in.peer);
      p.send_before_recv.push_back(it == last_send.end() ? -1 : it->second);
    }
    p.recvs_through[i] = p.recv_instrs.size();
  }
}

// Whether the compute action after each SEND takes a received message (the thread will wait next).
void derive_waits_next(Program& p, const SlotGrid& grid) {
  std::unordered_set<size_t> received;  // (op, slot) of each RECV
  auto key_of = [&](int64_t op, const Instr& in) { return static_cast<size_t>(op) * grid.size() + grid.key(in); };
  for (const Instr& in : p.instrs) {
    if (is_recv(in.op)) received.insert(key_of(in.op, in));
  }
  p.waits_next.assign(p.size(), 0);
  bool next_waits = false;
  for (size_t i = p.size(); i-- > 0;) {
    const Instr& in = p[i];
    if (in.op == kF) {
      next_waits = received.count(key_of(kRecvF, in)) > 0;
    } else if (in.op == kB || in.op == kI) {
      next_waits = received.count(key_of(kRecvB, in)) > 0;
    } else if (!is_comm(in.op)) {
      next_waits = false;
    }
    p.waits_next[i] = next_waits;
  }
}

void derive_pairs(Program& p) {
  p.pair_end.assign(p.size(), 0);
  constexpr size_t kNone = static_cast<size_t>(-1);
  size_t open = kNone;  // the OVERLAP_F_B bracket open at i
  for (size_t i = 0; i < p.size(); ++i) {
    const int64_t op = p[i].op;
    if (op == kOverlapBegin) {
      TORCH_CHECK(open == kNone, "pipecore: instruction ", i, " opens an OVERLAP_F_B pair inside another");
      open = i;
    } else if (op == kOverlapEnd) {
      TORCH_CHECK(open != kNone, "pipecore: instruction ", i, " closes an OVERLAP_F_B pair that is not open");
      p.pair_end[open] = i;
      open = kNone;
    } else {
      TORCH_CHECK(open == kNone || op <= kB, "pipecore: instruction ", i,
                  " inside an OVERLAP_F_B pair is not F, I, W or B");
    }
  }
  TORCH_CHECK(open == kNone, "pipecore: the OVERLAP_F_B pair opened at instruction ", open, " is never closed");
}

// A batch: a run of consecutive SEND/RECV actions; in a discovery run, also cut before each receive
// of activations from another rank (p2p_order.py, rules 1 and 5; a receive from `rank` itself stays
// with its send: NCCL refuses a send to self without its receive in the same group).
void derive_batches(Program& p, int64_t rank) {
  p.batch_end.assign(p.size(), 0);
  p.learning_end.assign(p.size(), 0);
  for (size_t i = p.size(); i-- > 0;) {
    if (!is_comm(p[i].op)) continue;
    const bool next_comm = i + 1 < p.size() && p.batch_end[i + 1] != 0;
    p.batch_end[i] = next_comm ? p.batch_end[i + 1] : i + 1;
    const bool cut = next_comm && p[i + 1].op == kRecvF && p[i + 1].peer != rank;
    p.learning_end[i] = next_comm && !cut ? p.learning_end[i + 1] : i + 1;
  }
}

}  // namespace

void Program::load(const std::vector<int64_t>& flat, std::vector<std::string> names, const SlotGrid& grid,
                   int64_t rank, const std::function<bool(int64_t)>& runs_whole) {
  constexpr size_t n = kInstructionFields;
  TORCH_CHECK(flat.size() % n == 0, "pipecore: program must hold ", n, " integers per instruction");
  std::vector<Instr> loaded;
  loaded.reserve(flat.size() / n);
  for (size_t i = 0; i < flat.size(); i += n) {
    Instr in{flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4]};
    TORCH_CHECK(in.op >= 0 && in.op <= kOverlapEnd, "pipecore: bad opcode ", in.op);
    if (in.op <= kRecvB) {  // (brackets and the stage events of a wrapped stage name no slot)
      TORCH_CHECK(in.stage >= 0 && in.stage < grid.stages && in.mb >= 0 && in.mb < grid.microbatches,
                  "pipecore: instruction ", i / n, " names stage ", in.stage, " microbatch ", in.mb,
                  " outside this executor's ", grid.stages, " stages x ", grid.microbatches, " microbatches");
    }
    TORCH_CHECK(in.label >= 0 && in.label < static_cast<int64_t>(names.size()), "pipecore: bad label index");
    loaded.push_back(in);
  }
  Program p;  // derived aside: a refused program leaves this one as it was
  p.instrs = std::move(loaded);
  p.labels = std::move(names);
  derive_receives(p);
  derive_waits_next(p, grid);
  derive_pairs(p);
  p.mark_last_backwards(runs_whole);
  derive_batches(p, rank);
  *this = std::move(p);
}

void Program::mark_last_backwards(const std::function<bool(int64_t)>& runs_whole) {
  // Each stage's last action that accumulates weight gradients before its REDUCE_GRAD (lowering puts
  // REDUCE_GRAD after it): its last B or W, or, for a stage whose backward runs whole at I, its last
  // B or I.
  last_backward_of.assign(size(), -1);
  for (size_t j = 0; j < size(); ++j) {
    if (instrs[j].op != kReduceGrad) continue;
    const int64_t stage = instrs[j].stage;
    const int64_t last = runs_whole(stage) ? kI : kW;
    for (size_t i = j; i-- > 0;) {
      const int64_t op = instrs[i].op;
      if ((op == kB || op == last) && instrs[i].stage == stage) {
        last_backward_of[i] = stage;
        break;
      }
    }
  }
}

}  // namespace pipecore
