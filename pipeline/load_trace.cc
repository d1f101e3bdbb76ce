#include "pipeline/load_trace.h"

#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/json_limits.h"

namespace fulcrum::pipeline {
namespace {

// One field of a stage load. Integers (and lists of them) must be JSON integers that fit
// (NOTE [JSON integers]); the rest go through nlohmann_json, which throws on a wrong type.
template <typename T>
absl::Status ReadValue(const nlohmann::json& value, T* out) {
  if constexpr (std::is_integral_v<T>) {
    absl::StatusOr<T> v = JsonInteger<T>(value);
    if (!v.ok()) return v.status();
    *out = *v;
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!value.is_array()) return absl::InvalidArgumentError("not an array");
    out->clear();
    for (const nlohmann::json& item : value) {
      absl::StatusOr<int64_t> v = JsonInteger<int64_t>(item);
      if (!v.ok()) return v.status();
      out->push_back(*v);
    }
  } else {
    try {
      *out = value.get<T>();
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(e.what());
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Read(const nlohmann::json& object, const char* name, T* out) {
  auto it = object.find(name);
  if (it == object.end()) {
    return absl::InvalidArgumentError(absl::StrCat("load trace: a stage load lacks '", name, "'"));
  }
  if (absl::Status s = ReadValue(*it, out); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("load trace: stage load field '", name, "': ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

nlohmann::json StageLoadToJson(const StageLoad& load) {
  nlohmann::json out = {{"stage", load.stage},
          {"layer_begin", load.layer_begin},
          {"layer_end", load.layer_end},
          {"layer_forward_ms", load.layer_forward_ms},
          {"layer_backward_ms", load.layer_backward_ms},
          {"layer_weight_ms", load.layer_weight_ms},
          {"layer_block_load", load.layer_block_load},
          {"layer_parameters", load.layer_parameters},
          {"pinned_parameters", load.pinned_parameters},
          {"forward_ms", load.forward_ms},
          {"backward_ms", load.backward_ms},
          {"weight_ms", load.weight_ms},
          {"wait_ms", load.wait_ms},
          {"total_ms", load.total_ms},
          {"parameter_bytes", load.parameter_bytes},
          {"gradient_bytes", load.gradient_bytes},
          {"optimizer_bytes", load.optimizer_bytes},
          {"layer_state_bytes", load.layer_state_bytes},
          {"peak_activation_bytes", load.peak_activation_bytes},
          {"layer_activation_bytes", load.layer_activation_bytes},
          {"peak_in_flight", load.peak_in_flight}};
  if (!load.chunk_ranges.empty()) {  // Only with chunks (older readers see no new field).
    out["chunk_ranges"] = RangesToJson(load.chunk_ranges);
    out["chunk_forward_ms"] = load.chunk_forward_ms;
    out["chunk_backward_ms"] = load.chunk_backward_ms;
    out["chunk_weight_ms"] = load.chunk_weight_ms;
  }
  return out;
}

absl::StatusOr<StageLoad> StageLoadFromJson(const nlohmann::json& o) {
  if (!o.is_object()) return absl::InvalidArgumentError("load trace: a stage load is not an object");
  StageLoad l;
  for (absl::Status s : {Read(o, "stage", &l.stage), Read(o, "layer_begin", &l.layer_begin),
                         Read(o, "layer_end", &l.layer_end),
                         Read(o, "layer_forward_ms", &l.layer_forward_ms),
                         Read(o, "layer_backward_ms", &l.layer_backward_ms),
                         Read(o, "layer_weight_ms", &l.layer_weight_ms),
                         Read(o, "layer_block_load", &l.layer_block_load),
                         Read(o, "layer_parameters", &l.layer_parameters),
                         Read(o, "pinned_parameters", &l.pinned_parameters),
                         Read(o, "forward_ms", &l.forward_ms), Read(o, "backward_ms", &l.backward_ms),
                         Read(o, "weight_ms", &l.weight_ms), Read(o, "wait_ms", &l.wait_ms),
                         Read(o, "total_ms", &l.total_ms),
                         Read(o, "parameter_bytes", &l.parameter_bytes),
                         Read(o, "gradient_bytes", &l.gradient_bytes),
                         Read(o, "optimizer_bytes", &l.optimizer_bytes),
                         Read(o, "layer_state_bytes", &l.layer_state_bytes),
                         Read(o, "peak_activation_bytes", &l.peak_activation_bytes),
                         Read(o, "layer_activation_bytes", &l.layer_activation_bytes),
                         Read(o, "peak_in_flight", &l.peak_in_flight)}) {
    if (!s.ok()) return s;
  }
  // With chunks only: the rank's chunks and their action totals (all four or none).
  if (o.contains("chunk_ranges")) {
    absl::StatusOr<LayerRanges> chunks = RangesFromJson(o.at("chunk_ranges"));
    if (!chunks.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load trace: stage load field 'chunk_ranges': ", chunks.status().message()));
    }
    l.chunk_ranges = *std::move(chunks);
    for (absl::Status s : {Read(o, "chunk_forward_ms", &l.chunk_forward_ms),
                           Read(o, "chunk_backward_ms", &l.chunk_backward_ms),
                           Read(o, "chunk_weight_ms", &l.chunk_weight_ms)}) {
      if (!s.ok()) return s;
    }
  }
  return l;
}

nlohmann::json RangesToJson(const LayerRanges& ranges) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [begin, end] : ranges) out.push_back({begin, end});
  return out;
}

absl::StatusOr<LayerRanges> RangesFromJson(const nlohmann::json& array) {
  LayerRanges out;
  if (!array.is_array()) return absl::InvalidArgumentError("load trace: ranges are not an array");
  for (const nlohmann::json& pair : array) {
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() ||
        !pair[1].is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load trace: a range is not [begin, end]: ", pair.dump()));
    }
    out.emplace_back(pair[0].get<int64_t>(), pair[1].get<int64_t>());
  }
  return out;
}

}  // namespace fulcrum::pipeline
