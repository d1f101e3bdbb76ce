#include "core/optimizer/lr_schedule.h"

#include <cmath>

namespace fulcrum {

LrSchedule::LrSchedule(const LrScheduleOptions& options, int64_t train_iters)
    : options_(options), decay_iters_(options.decay_iters > 0 ? options.decay_iters : train_iters) {}

double LrSchedule::At(int64_t step) const {
  const double max_lr = options_.lr;
  const double min_lr = options_.min_lr;
  const int64_t warmup = options_.warmup_iters;
  if (warmup > 0 && step <= warmup) {
    return max_lr * static_cast<double>(step) / static_cast<double>(warmup);
  }
  if (options_.decay_style == LrDecayStyle::kConstant) return max_lr;
  if (step >= decay_iters_) return min_lr;
  const double ratio = static_cast<double>(step - warmup) / static_cast<double>(decay_iters_ - warmup);
  double coeff = 0.0;
  switch (options_.decay_style) {
    case LrDecayStyle::kLinear: coeff = 1.0 - ratio; break;
    case LrDecayStyle::kCosine: coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0); break;
    case LrDecayStyle::kConstant: coeff = 1.0; break;
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace fulcrum
