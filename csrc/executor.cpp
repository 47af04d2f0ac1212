// The executor's construction and settings; its jobs are in the files executor.h lists.
#include "executor.h"

#include <c10/util/Exception.h>

#include "comm_worker.h"
#include "device_comm.h"
#include "device_timer.h"
#include "diagnostics.h"
#include "send_tracker.h"

namespace pipecore {

Executor::Executor(c10::intrusive_ptr<c10d::ProcessGroup> pg, int64_t num_stages, int64_t num_microbatches,
                   double timeout_s, std::string who)
    : pg_(std::move(pg)),
      rank_(pg_->getRank()),
      who_(who.empty() ? "rank " + std::to_string(rank_) : std::move(who)),
      timeout_(timeout_of(timeout_s)),
      grid_{num_stages, num_microbatches},
      slots_(grid_.size()),
      specs_(grid_),
      next_local_(num_stages, -1),
      prev_local_(num_stages, -1),
      sends_(std::make_unique<SendTracker>()),
      split_fallbacks_(num_stages) {}

Executor::~Executor() = default;

void Executor::join_threads() {
  worker_.reset();
  sends_.reset();
  overlap_.half_thread.reset();
}

void Executor::set_links(int64_t stage, int64_t next_local, int64_t prev_local) {
  TORCH_CHECK(stage >= 0 && stage < grid_.stages, "pipecore: bad stage index ", stage);
  next_local_[stage] = next_local;
  prev_local_[stage] = prev_local;
}

void Executor::set_program(std::vector<int64_t> flat, std::vector<std::string> labels) {
  program_.load(flat, std::move(labels), grid_, rank_, [this](int64_t stage) { return evented(stage); });
}

std::vector<uint8_t> Executor::stage_mask(const std::vector<int64_t>& stages) const {
  std::vector<uint8_t> mask(grid_.stages, 0);
  for (int64_t s : stages) {
    TORCH_CHECK(s >= 0 && s < grid_.stages, "pipecore: stage ", s, " outside this executor's ", grid_.stages,
                " stages");
    mask[s] = 1;
  }
  return mask;
}

void Executor::set_stage_events(std::vector<int64_t> stages, StageEventFn fn) {
  stages_.evented = stage_mask(stages);
  stages_.event = stages.empty() ? StageEventFn() : std::move(fn);
  program_.mark_last_backwards([this](int64_t stage) { return evented(stage); });
}

void Executor::set_weight_builders(std::vector<int64_t> stages, WeightBuilderFn builder) {
  stages_.builds_weight = stage_mask(stages);
  stages_.weight_builder = stages.empty() ? WeightBuilderFn() : std::move(builder);
}

void Executor::set_comm_thread(bool on) {
  if (!on) {
    worker_.reset();
  } else if (!worker_) {
    worker_ = std::make_unique<CommWorker>();
  }
}

bool Executor::set_device_comm(const std::string& device) {
  device_comm_ = make_device_comm(c10::Device(device));
  group_backend_.reset();
  if (device_comm_) shaped_.travel = false;  // (set_shapes_travel)
  return device_comm_ != nullptr;
}

#ifdef PIPECORE_TESTING
void Executor::emulate_device_comm() {
  // each rank on a device of its own other than 0, where a thread starts (the model refuses a launch with
  // another one current)
  device_comm_ = make_host_device_comm(timeout_, static_cast<int>(rank_) + 1);
  group_backend_.reset();
  shaped_.travel = false;
}
std::vector<std::string> Executor::stream_violations() const {
  return device_comm_ ? device_comm_->contract_violations() : std::vector<std::string>();
}
#endif

int64_t Executor::peak_send_bytes() const { return sends_->peak_bytes(); }
int64_t Executor::held_failed_sends() const { return sends_->held_failed(); }

std::string Executor::where(const Instr& in) const {
  return "pipecore " + who_ + ", action " + program_.label(in);
}

}  // namespace pipecore
