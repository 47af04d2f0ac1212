// One profiler event (torch.profiler / RecordFunction) and, where NVTX is built in, one NVTX range
// per action, named "PP:<action>". Balanced even when the action throws.
#pragma once

#include <ATen/record_function.h>

#include <optional>
#include <string>

#ifdef PIPECORE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace pipecore {

class ActionScope {
 public:
  explicit ActionScope(const std::string& name) {
#ifdef PIPECORE_NVTX
    nvtxRangePushA(name.c_str());
#endif
    if (at::hasCallbacks()) {
      record_.emplace(at::RecordScope::USER_SCOPE);
      if (record_->isActive()) record_->before(name.c_str());
    }
  }
  ~ActionScope() {
    record_.reset();
#ifdef PIPECORE_NVTX
    nvtxRangePop();
#endif
  }
  ActionScope(const ActionScope&) = delete;
  ActionScope& operator=(const ActionScope&) = delete;

 private:
  std::optional<at::RecordFunction> record_;
};

}  // namespace pipecore
