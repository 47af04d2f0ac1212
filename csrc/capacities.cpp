// Shaped messages' capacities (comm.h, Executor::set_shapes_travel): per boundary and tensor, the most
// elements its messages were planned with or carried so far.
#include <algorithm>

#include "message_specs.h"

namespace pipecore {

namespace {
// Same count, dtypes and ranks: one layout of capacities (gradient flags do not matter to buffers).
bool same_structure(const std::vector<TensorSpec>& a, const std::vector<TensorSpec>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (a[k].dtype != b[k].dtype || a[k].shape.size() != b[k].shape.size()) return false;
  }
  return true;
}
// A capacity of `n` elements at rank `rank`: [n, 1, ...] (buffers need the count, the header the rank).
std::vector<int64_t> capacity_shape(int64_t n, size_t rank) {
  std::vector<int64_t> shape(rank, 1);
  if (rank > 0) shape[0] = n;
  return shape;
}
// `into` takes, per tensor, the larger element count of the two (same structure assumed).
void widen(std::vector<TensorSpec>& into, const std::vector<TensorSpec>& by) {
  for (size_t k = 0; k < into.size(); ++k) {
    into[k].shape = capacity_shape(std::max(elements(into[k].shape), elements(by[k].shape)), into[k].shape.size());
  }
}
// What crossed a boundary joins its record (a message of another structure starts it anew).
void record_crossing(std::vector<TensorSpec>& crossed, std::vector<TensorSpec> message) {
  if (same_structure(crossed, message)) {
    widen(crossed, message);
  } else {
    crossed = std::move(message);
  }
}
// The widest of one stage's capacities (over its microbatches and what crossed), then each of its
// microbatches' capacities widened to it (their gradient flags kept). Nothing where they differ in
// structure: each microbatch keeps its own then.
void widen_stage(std::vector<std::vector<TensorSpec>>& specs, const std::vector<uint8_t>& known, size_t first,
                 size_t count, const std::vector<TensorSpec>& crossed) {
  std::vector<TensorSpec> widest;
  for (size_t key = first; key < first + count; ++key) {
    if (!known[key] || specs[key].empty()) continue;
    if (widest.empty()) {
      widest = specs[key];
    } else if (!same_structure(widest, specs[key])) {
      return;
    }
    widen(widest, specs[key]);
  }
  if (widest.empty()) return;
  if (same_structure(widest, crossed)) widen(widest, crossed);
  for (size_t key = first; key < first + count; ++key) {
    if (known[key] && !specs[key].empty()) widen(specs[key], widest);
  }
}
}  // namespace

void MessageSpecs::widen_to_capacities() {
  for (int64_t stage = 0; stage < grid_.stages; ++stage) {
    const size_t first = grid_.key(stage, 0);
    const size_t m = static_cast<size_t>(grid_.microbatches);
    widen_stage(recv_f_, input_known_, first, m, crossed_in_[stage]);
    widen_stage(send_f_, output_known_, first, m, crossed_out_[stage]);
    for (size_t key = first; key < first + m; ++key) {
      if (output_known_[key]) recv_b_[key] = needing_grad(send_f_[key]);
    }
  }
}

void MessageSpecs::crossed_in(int64_t stage, std::vector<TensorSpec> message) {
  record_crossing(crossed_in_[stage], std::move(message));
}

void MessageSpecs::crossed_out(int64_t stage, std::vector<TensorSpec> message) {
  record_crossing(crossed_out_[stage], std::move(message));
}

}  // namespace pipecore
