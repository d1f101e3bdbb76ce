// The pipeline runner's measurements per iteration (NOTE [bubble measurement] and NOTE
// [imbalance measurement] in pipeline/pipeline_runner.h): every stage's bubble ratio and
// compute time, the imbalance over the stages, the comparison of the iteration after a
// rebalancing with the one before it, and what the previous iteration measured for its
// load-trace line. Bookkeeping only: the runner gathers the stages' figures over the
// pipeline and hands them in, so this class is tested with hand-made figures.
//
// Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "pipeline/rebalancer.h"
#include "pipeline/stage_executor.h"

namespace fulcrum::pipeline {

/// (max − min) / mean of `loads`; 0 for none or a zero mean (DynMo's ΔL, §2, Eq. 2).
double Imbalance(const std::vector<double>& loads);

/// A stage's compute in a run: its actions without waits and migrations.
double ComputeMs(const StageRunResult& run);

class PipelineMetrics {
 public:
  /// Columns of a stage's row: bubble ratio over run and tail wait, bubble ratio within
  /// the run, compute ms.
  static constexpr int kRowWidth = 3;
  /// This stage's row of `run` (whose tail_wait_ms is set), a [kRowWidth] double tensor for
  /// the runner to gather over the pipeline.
  static at::Tensor StageRow(const StageRunResult& run);

  /// A Run on `microbatches` micro-batches starts: what the last one measured becomes the
  /// previous measurement, with `last_ran_on` (the placement it ran on), `microbatches` and
  /// `last_frozen_prefix` (the model's frozen prefix it ran with: NOTE [forward-only
  /// stages] in schedule.h).
  void StartRun(const LayerRanges& last_ran_on, int microbatches, int64_t last_frozen_prefix = 0);
  /// The Run of `iteration` ended: `run` is this stage's, `rows` every stage's StageRow in
  /// stage order ([stages, kRowWidth]), `moves` the layers its tail moved. Returns the log
  /// line of the first iteration on a new placement (the previous Run moved layers),
  /// comparing it with the iteration before the moves; empty otherwise.
  std::string EndRun(int64_t iteration, const StageRunResult& run, const at::Tensor& rows,
                     int64_t moves);

  /// bubble_ratio (mean over stages), bubble_ratio_max, bubble_ratio_in_run (mean),
  /// stage_bubble_ratio, pipeline_ms and activation_peak_mb (this stage), imbalance,
  /// stage_ms and layers_moved; on a GPU device_allocated_mb, device_reserved_mb and
  /// device_peak_allocated_mb (the caching allocator's, this stage; absent on the CPU,
  /// where the allocator is not tracked); appends " | bubble B | imbalance I" to `log_line`.
  void Write(nlohmann::json* record, std::string* log_line) const;
  /// The previous Run's part of a load-trace line: microbatches, ran_on, frozen_prefix (when
  /// not 0) and measured (pipeline_ms, bubble_ratio, stage_ms). Nothing before a second Run.
  void WritePrevious(nlohmann::json* record) const;
  /// Whether a Run before the last one was measured (the load trace has a line).
  bool has_previous() const { return !previous_ran_on_.empty(); }

 private:
  int64_t layers_moved_ = 0;
  // The last Run (NOTE [imbalance measurement]).
  double span_ms_ = 0;  // This stage: run + tail wait.
  double activation_peak_mb_ = 0;
  kernels::DeviceMemory device_memory_;  // untracked on the CPU
  std::vector<double> stage_ms_;
  double bubble_ratio_ = 0, bubble_ratio_max_ = 0, bubble_ratio_in_run_ = 0;
  std::vector<double> stage_bubble_ratio_;
  // The Run before it, for the load trace.
  LayerRanges previous_ran_on_;
  double previous_span_ms_ = 0, previous_bubble_ratio_ = 0;
  std::vector<double> previous_stage_ms_;
  int previous_microbatches_ = 0;
  int64_t previous_frozen_prefix_ = 0;
  // The iteration before the last moves: what the next one is compared with in the log.
  double bottleneck_before_moves_ms_ = 0;
  double bubble_before_moves_ = 0;
  bool report_after_moves_ = false;
};

}  // namespace fulcrum::pipeline
