#include "pipeline/pipeline_metrics.h"

#include <ATen/ATen.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipeline/load_trace.h"

namespace fulcrum::pipeline {

double Imbalance(const std::vector<double>& loads) {
  if (loads.empty()) return 0;
  double lo = loads[0], hi = loads[0], sum = 0;
  for (double l : loads) {
    lo = std::min(lo, l);
    hi = std::max(hi, l);
    sum += l;
  }
  const double mean = sum / static_cast<double>(loads.size());
  return mean > 0 ? (hi - lo) / mean : 0;
}

double ComputeMs(const StageRunResult& run) {
  double ms = 0;
  for (const ActionTiming& t : run.timings) ms += t.end_ms - t.start_ms - t.wait_ms - t.migration_ms;
  return ms;
}

at::Tensor PipelineMetrics::StageRow(const StageRunResult& run) {
  const double span_ms = run.total_ms + run.tail_wait_ms;
  return at::tensor({span_ms > 0 ? (run.wait_ms + run.tail_wait_ms) / span_ms : 0.0,
                     run.total_ms > 0 ? run.wait_ms / run.total_ms : 0.0, ComputeMs(run)},
                    at::kDouble);
}

void PipelineMetrics::StartRun(const LayerRanges& last_ran_on, int microbatches,
                               int64_t last_frozen_prefix) {
  previous_ran_on_ = last_ran_on;
  previous_frozen_prefix_ = last_frozen_prefix;
  previous_span_ms_ = span_ms_;
  previous_bubble_ratio_ = bubble_ratio_;
  previous_stage_ms_ = stage_ms_;
  previous_microbatches_ = microbatches;
}

std::string PipelineMetrics::EndRun(int64_t iteration, const StageRunResult& run,
                                    const at::Tensor& rows, int64_t moves) {
  layers_moved_ += moves;
  span_ms_ = run.total_ms + run.tail_wait_ms;
  activation_peak_mb_ = static_cast<double>(run.peak_activation_bytes) / (1 << 20);
  device_memory_ = run.device_memory;
  bubble_ratio_ = rows.select(1, 0).mean().item<double>();
  bubble_ratio_max_ = rows.select(1, 0).max().item<double>();
  bubble_ratio_in_run_ = rows.select(1, 1).mean().item<double>();
  const at::Tensor bubbles = rows.select(1, 0).contiguous();
  stage_bubble_ratio_.assign(bubbles.data_ptr<double>(),
                             bubbles.data_ptr<double>() + bubbles.numel());
  const at::Tensor compute = rows.select(1, 2).contiguous();
  stage_ms_.assign(compute.data_ptr<double>(), compute.data_ptr<double>() + compute.numel());
  // NOTE [imbalance measurement]: the iteration after moves says what they achieved.
  const double bottleneck = *std::max_element(stage_ms_.begin(), stage_ms_.end());
  std::string line;
  if (report_after_moves_) {
    line = absl::StrFormat(
        "iteration %d, the first on the new placement: bottleneck %.1f ms (was %.1f), "
        "imbalance %.3f, bubble %.3f (was %.3f)",
        iteration, bottleneck, bottleneck_before_moves_ms_, Imbalance(stage_ms_), bubble_ratio_,
        bubble_before_moves_);
  }
  report_after_moves_ = moves > 0;
  if (report_after_moves_) {
    // Moves happen in this iteration's tail: it still ran on the old placement.
    bottleneck_before_moves_ms_ = bottleneck;
    bubble_before_moves_ = bubble_ratio_;
  }
  return line;
}

void PipelineMetrics::Write(nlohmann::json* record, std::string* log_line) const {
  nlohmann::json& r = *record;
  r["bubble_ratio"] = bubble_ratio_;
  r["bubble_ratio_max"] = bubble_ratio_max_;
  r["bubble_ratio_in_run"] = bubble_ratio_in_run_;
  r["stage_bubble_ratio"] = stage_bubble_ratio_;
  r["pipeline_ms"] = span_ms_;
  r["activation_peak_mb"] = activation_peak_mb_;
  r["imbalance"] = Imbalance(stage_ms_);
  r["stage_ms"] = stage_ms_;
  r["layers_moved"] = layers_moved_;
  // The allocator's figures exist only on a device with a caching allocator; on the CPU
  // the record keeps only the activation meter's estimate (activation_peak_mb), and
  // nothing that could read as a measured zero.
  if (device_memory_.tracked) {
    constexpr double kMb = 1 << 20;
    r["device_allocated_mb"] = static_cast<double>(device_memory_.allocated_bytes) / kMb;
    r["device_reserved_mb"] = static_cast<double>(device_memory_.reserved_bytes) / kMb;
    r["device_peak_allocated_mb"] =
        static_cast<double>(device_memory_.peak_allocated_bytes) / kMb;
  }
  absl::StrAppend(log_line, absl::StrFormat(" | bubble %.3f | imbalance %.3f", bubble_ratio_,
                                            Imbalance(stage_ms_)));
}

void PipelineMetrics::WritePrevious(nlohmann::json* record) const {
  if (!has_previous()) return;
  nlohmann::json& r = *record;
  r["microbatches"] = previous_microbatches_;
  r["ran_on"] = RangesToJson(previous_ran_on_);
  if (previous_frozen_prefix_ > 0) r["frozen_prefix"] = previous_frozen_prefix_;
  r["measured"] = {{"pipeline_ms", previous_span_ms_},
                   {"bubble_ratio", previous_bubble_ratio_},
                   {"stage_ms", previous_stage_ms_}};
}

}  // namespace fulcrum::pipeline
