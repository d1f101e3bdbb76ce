#include "pipeline/internal/activation_meter.h"

#include <algorithm>

namespace fulcrum::pipeline::internal {

RunMeter::RunMeter(bool enabled) {
  if (!enabled) return;
  meter_ = std::make_shared<ActivationMeter>();
  guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, meter_);
}

void RunMeter::Hold(int mb, int64_t bytes) {
  int64_t& held = held_[mb];
  held_total_ += bytes - held;
  held = bytes;
  peak_ = std::max(peak_, held_total_);
}

void RunMeter::Release(int mb) {
  auto it = held_.find(mb);
  if (it == held_.end()) return;
  held_total_ -= it->second;
  held_.erase(it);
}

}  // namespace fulcrum::pipeline::internal
