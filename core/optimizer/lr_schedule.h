// The learning rate of each optimizer step: linear warmup, then constant, linear or
// half-cosine decay to a floor (Megatron's schedules).
//
// Thread-safety: immutable after construction.
#pragma once

#include <cstdint>

#include "core/config.h"

namespace fulcrum {

/// Learning rate at optimizer step `step` (1-based: the first update is step 1).
/// Warmup: lr·step/warmup for step ≤ warmup. Then decay from lr to min_lr over
/// (warmup, decay_iters] — constant, linear or half-cosine — and min_lr afterwards.
class LrSchedule {
 public:
  /// `train_iters` is used when options.decay_iters is 0.
  LrSchedule(const LrScheduleOptions& options, int64_t train_iters);
  double At(int64_t step) const;

 private:
  LrScheduleOptions options_;
  int64_t decay_iters_;
};

}  // namespace fulcrum
