// The executor's construction and settings; its jobs are in the files executor.h lists.
#include "executor.h"

#include <c10/util/Exception.h>

#include "device_comm.h"
#include "device_timer.h"
#include "diagnostics.h"

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
      split_fallbacks_(num_stages),
      path_(make_message_path(path_context(), /*device=*/nullptr, /*replacing=*/nullptr)) {}

PathContext Executor::path_context() {
  return PathContext{*this, pg_, rank_, who_, timeout_, program_, specs_, profile_, flight_};
}

Executor::~Executor() {
  overlap_.half_thread.reset();  // (a half's thread may use the path)
  path_.reset();
}

void Executor::join_threads() {
  path_->join_threads();
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
  path_->settings().comm_thread = on;
  path_->apply_settings();
}

void Executor::set_recv_window(int64_t n, bool past_sends, int64_t max_bytes) {
  TORCH_CHECK(n >= 0, "pipecore: the receive window must be >= 0, got ", n);
  PathSettings& settings = path_->settings();
  settings.window_receives = n;
  settings.window_past_sends = past_sends;
  settings.window_bytes = max_bytes;
  path_->apply_settings();
}

void Executor::check_no_step_ran(const char* what) const {
  TORCH_CHECK(!stepped_, "pipecore: ", what, " after the executor's first step: its message path is chosen before "
              "(the sends in flight and the follow-up numbering its peers share would be lost)");
}

bool Executor::set_device_comm(const std::string& device) {
  check_no_step_ran("set_device_comm");
  const c10::Device on(device);
  std::unique_ptr<MessagePath> path = make_message_path(path_context(), &on, path_.get());
  if (!path) return false;  // the path stays as it was
  path_ = std::move(path);
  return true;
}

bool Executor::device_comm() const { return path_->on_device(); }

#ifdef PIPECORE_TESTING
void Executor::emulate_device_comm(bool all_ranks_connected, int64_t eager_bytes) {
  // each rank on a device of its own other than 0, where a thread starts (the model refuses a launch with
  // another one current)
  check_no_step_ran("_emulate_device_comm");
  std::unique_ptr<DeviceComm> model = make_host_device_comm(timeout_, static_cast<int>(rank_) + 1,
                                                            all_ranks_connected, eager_bytes);  // first
  auto [format, settings] = path_->pass_on();
  path_ = make_device_path(path_context(), std::move(format), std::move(settings), std::move(model));
}
std::vector<std::string> Executor::stream_violations() const { return path_->stream_violations(); }
std::vector<int64_t> Executor::connection_counts() const {
  const ConnectionCounts counts = path_->connection_counts();
  return {counts.ahead, counts.in_steps, counts.store_ops};
}
#endif

void Executor::connect_communicators(const std::vector<c10::intrusive_ptr<c10d::Backend>>& pair_channels,
                                     const std::vector<int64_t>& peers, const std::vector<int64_t>& exchange_peers) {
  std::vector<c10d::Backend*> channels;
  for (const auto& channel : pair_channels) channels.push_back(channel.get());
  path_->connect(channels, std::vector<int>(peers.begin(), peers.end()),
                 std::vector<int>(exchange_peers.begin(), exchange_peers.end()));
}

std::string Executor::where(const Instr& in) const {
  return "pipecore " + who_ + ", action " + program_.label(in);
}

}  // namespace pipecore
