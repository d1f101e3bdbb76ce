// The metrics file: one JSON object per line, one line per training iteration, appended.
// It is what benchmarks, plots and checks read, so its field names are stable:
//   iteration, loss, lr, grad_norm, tokens_per_second, iteration_ms, consumed_samples,
//   and valid_loss on iterations that evaluated. Only one process of a job writes it.
//
// TensorBoardScalars turns the same record into TensorBoard scalars (--tensorboard_dir).
//
// Not thread-safe.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "core/tensorboard_writer.h"

namespace fulcrum {

class MetricsWriter {
 public:
  /// Opens `path` for appending (creating it). Errors name the path.
  static absl::StatusOr<std::unique_ptr<MetricsWriter>> Open(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  /// Appends `record` as one line and flushes it to the kernel, so a reader following the
  /// file (or a crash) sees whole lines.
  absl::Status Write(const nlohmann::json& record);

 private:
  MetricsWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  std::string path_;
  std::FILE* file_;
};

/// The scalars of one metrics record, for TensorBoard, the record's iteration being the
/// step. Megatron's tags where Megatron has the figure: "lm loss", "learning-rate",
/// "grad-norm", "iteration-time" (seconds), "lm loss validation" and "lm loss validation
/// ppl"; "tokens-per-second", "consumed-samples". The pipeline runner's figures under
/// "pipeline/": "bubble-ratio", "bubble-ratio-max", "bubble-ratio-in-run", "imbalance",
/// "pipeline-ms", "activation-peak-mb", "layers-moved", and each stage's
/// "stage<i>-load-ms" (stage_ms) and "stage<i>-bubble-ratio" (stage_bubble_ratio). Every
/// other number keeps its field name (a plugin's "moe_aux_loss"), a list of numbers gives
/// "<field>/<i>" and an object of numbers "<field>/<key>" (layer_loads/layers.3);
/// anything else (stage_ranges) is left out.
Scalars TensorBoardScalars(const nlohmann::json& record);

}  // namespace fulcrum
