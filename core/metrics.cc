#include "core/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace fulcrum {

absl::StatusOr<std::unique_ptr<MetricsWriter>> MetricsWriter::Open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "a");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open ", path, " for appending: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsWriter>(new MetricsWriter(path, file));
}

MetricsWriter::~MetricsWriter() { std::fclose(file_); }

absl::Status MetricsWriter::Write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    return absl::InternalError(absl::StrCat("writing ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

Scalars TensorBoardScalars(const nlohmann::json& record) {
  // (tag, factor) of the fields that get another name.
  static const std::map<std::string, std::pair<std::string, double>> kRenamed = {
      {"loss", {"lm loss", 1.0}},
      {"lr", {"learning-rate", 1.0}},
      {"grad_norm", {"grad-norm", 1.0}},
      {"iteration_ms", {"iteration-time", 1e-3}},
      {"valid_loss", {"lm loss validation", 1.0}},
      {"tokens_per_second", {"tokens-per-second", 1.0}},
      {"consumed_samples", {"consumed-samples", 1.0}},
      {"bubble_ratio", {"pipeline/bubble-ratio", 1.0}},
      {"bubble_ratio_max", {"pipeline/bubble-ratio-max", 1.0}},
      {"bubble_ratio_in_run", {"pipeline/bubble-ratio-in-run", 1.0}},
      {"imbalance", {"pipeline/imbalance", 1.0}},
      {"pipeline_ms", {"pipeline/pipeline-ms", 1.0}},
      {"activation_peak_mb", {"pipeline/activation-peak-mb", 1.0}},
      {"layers_moved", {"pipeline/layers-moved", 1.0}},
  };
  // Per-stage lists: stage i's value is tagged prefix + i + suffix.
  static const std::map<std::string, std::pair<std::string, std::string>> kPerStage = {
      {"stage_ms", {"pipeline/stage", "-load-ms"}},
      {"stage_bubble_ratio", {"pipeline/stage", "-bubble-ratio"}},
  };
  Scalars out;
  for (const auto& [field, value] : record.items()) {
    if (field == "iteration") continue;  // the step
    if (value.is_number()) {
      const auto renamed = kRenamed.find(field);
      if (renamed == kRenamed.end()) {
        out.emplace_back(field, value.get<double>());
      } else {
        out.emplace_back(renamed->second.first, value.get<double>() * renamed->second.second);
      }
      if (field == "valid_loss") {
        out.emplace_back("lm loss validation ppl", std::exp(value.get<double>()));
      }
    } else if (value.is_array()) {
      const auto per_stage = kPerStage.find(field);
      for (size_t i = 0; i < value.size(); ++i) {
        if (!value[i].is_number()) continue;
        out.emplace_back(per_stage == kPerStage.end()
                             ? absl::StrCat(field, "/", i)
                             : absl::StrCat(per_stage->second.first, i, per_stage->second.second),
                         value[i].get<double>());
      }
    } else if (value.is_object()) {
      for (const auto& [key, item] : value.items()) {
        if (item.is_number()) out.emplace_back(absl::StrCat(field, "/", key), item.get<double>());
      }
    }
  }
  return out;
}

}  // namespace fulcrum
