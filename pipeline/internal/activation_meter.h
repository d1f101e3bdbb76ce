// NOTE [activation memory] (pipeline/stage_executor.h), the counting side: a c10 memory
// reporter installed on the training thread for a run, and the per-micro-batch accounting
// of what the stage holds for micro-batches in flight.
//
// Not thread-safe; one per run, on the thread that runs it.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>

namespace fulcrum::pipeline::internal {

/// Bytes allocated minus bytes freed on the thread where it is installed, while enabled.
/// The CPU allocator (and CUDA's caching allocator) report every allocation and free to the
/// thread's c10 memory reporter.
class ActivationMeter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    live_.fetch_add(alloc_size, std::memory_order_relaxed);
  }
  // Disabled around migrations: they free tensors allocated before the meter was installed,
  // which c10 could not size (and would warn about).
  bool memoryProfilingEnabled() const override { return enabled_; }
  int64_t live() const { return live_.load(std::memory_order_relaxed); }
  void set_enabled(bool enabled) { enabled_ = enabled; }

 private:
  std::atomic<int64_t> live_{0};
  bool enabled_ = true;
};

/// Counts a training run's activation memory: installs an ActivationMeter on this thread
/// for its lifetime (when `enabled`; a forward-only run counts nothing) and keeps, per
/// micro-batch in flight, the bytes it holds, and their largest sum.
class RunMeter {
 public:
  explicit RunMeter(bool enabled);
  RunMeter(const RunMeter&) = delete;
  RunMeter& operator=(const RunMeter&) = delete;

  /// Bytes live on this thread since the meter was installed (0 when disabled).
  int64_t live() const { return meter_ ? meter_->live() : 0; }
  /// Micro-batch `mb` now holds `bytes`; updates the peak.
  void Hold(int mb, int64_t bytes);
  /// Micro-batch `mb` holds nothing any more.
  void Release(int mb);
  /// The largest sum of held bytes seen at a Hold.
  int64_t peak() const { return peak_; }

  /// Stops counting for its lifetime (a layer being packed for migration frees tensors
  /// allocated before the run).
  class Pause {
   public:
    explicit Pause(RunMeter* meter) : meter_(meter) { Set(false); }
    ~Pause() { Set(true); }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    void Set(bool on) {
      if (meter_ != nullptr && meter_->meter_) meter_->meter_->set_enabled(on);
    }
    RunMeter* meter_;
  };

 private:
  std::shared_ptr<ActivationMeter> meter_;
  // Installed before anything of the run is allocated, so that every tensor freed while it
  // counts was allocated while it counted.
  std::optional<c10::DebugInfoGuard> guard_;
  std::map<int, int64_t> held_;  // Per micro-batch in flight.
  int64_t held_total_ = 0;
  int64_t peak_ = 0;
};

}  // namespace fulcrum::pipeline::internal
