// The metrics file: one JSON object per line, one line per training iteration, appended.
// It is what benchmarks, plots and checks read, so its field names are stable:
//   iteration, loss, lr, grad_norm, tokens_per_second, iteration_ms, consumed_samples,
//   and valid_loss on iterations that evaluated. Only one process of a job writes it.
//
// Not thread-safe.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"

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

}  // namespace fulcrum
