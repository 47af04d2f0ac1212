"""A test-only CPU allocator (built once, tests/jit_extension.py) that counts live tensor bytes exactly,
keeps their peak, and can refuse allocations the way a full GPU does (c10::OutOfMemoryError):
above a cap of live bytes, or the k-th allocation of at least a watched size.

It wraps the allocator CPU tensors were made with until then; tensors made before install() are not
counted. Installed once per process, it stays (with no cap and nothing armed it only counts)."""

from __future__ import annotations

_SOURCE = r"""
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {
std::atomic<int64_t> live{0}, peak{0}, cap{-1}, watch_min{-1}, watched{0}, fail_at{-1}, refused{0};
c10::Allocator* base = nullptr;

struct Block {
  c10::DataPtr inner;
  int64_t bytes;
};
// data pointer -> its block: the DataPtr's context is its data, so that raw_deallocate works too
std::mutex blocks_mu;
std::unordered_map<void*, Block> blocks;

void release(void* data) {
  Block b;
  {
    std::lock_guard<std::mutex> lock(blocks_mu);
    auto it = blocks.find(data);
    b = std::move(it->second);
    blocks.erase(it);
  }
  live -= b.bytes;
}  // b.inner frees the memory here

struct ProbeAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const auto bytes = static_cast<int64_t>(n);
    if (watch_min >= 0 && bytes >= watch_min) {
      const int64_t k = watched++;
      if (k == fail_at) {
        ++refused;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "memory_probe: out of memory (refused watched allocation ", k,
                         " of ", bytes, " bytes)");
      }
    }
    const int64_t now = live += bytes;
    const int64_t limit = cap;
    if (limit >= 0 && now > limit) {
      live -= bytes;
      ++refused;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "memory_probe: out of memory (", bytes, " bytes above the cap of ",
                       limit, ", ", now - bytes, " live)");
    }
    int64_t p = peak;
    while (now > p && !peak.compare_exchange_weak(p, now)) {
    }
    c10::DataPtr inner = base->allocate(std::max<size_t>(n, 1));  // distinct pointers, also for 0 bytes
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(blocks_mu);
      blocks[data] = Block{std::move(inner), bytes};
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

ProbeAllocator probe;
}  // namespace

void install() {
  if (base != nullptr) return;
  base = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&probe, /*priority=*/100);
}
int64_t live_bytes() { return live; }
int64_t peak_bytes() { return peak; }
void reset_peak() { peak = live.load(); }
void set_cap(int64_t bytes) { cap = bytes; }
// Counts allocations of at least `min_bytes` (-1: off) from now; fails the `fail`-th (0-based; -1: none).
void watch(int64_t min_bytes, int64_t fail) {
  watch_min = min_bytes;
  watched = 0;
  fail_at = fail;
}
int64_t watched_count() { return watched; }
int64_t refused_count() { return refused; }
"""

_FUNCTIONS = ["install", "live_bytes", "peak_bytes", "reset_peak", "set_cap", "watch", "watched_count",
              "refused_count"]
_module = None


def probe():
    """The allocator's controls, installed in this process."""
    global _module
    if _module is None:
        from jit_extension import load_extension

        _module = load_extension("pipecore_test_memory_probe", _SOURCE, _FUNCTIONS)
        _module.install()
    return _module
