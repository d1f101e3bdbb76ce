#include "core/training_manifest.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fulcrum {
namespace {

// Typed reads of manifest fields; errors name the field by its JSON pointer.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& root, std::string source)
      : root_(root), source_(std::move(source)) {}

  absl::Status Error(const std::string& pointer, const std::string& what) const {
    return absl::DataLossError(absl::StrCat(source_, ": field '", pointer, "' ", what));
  }

  absl::StatusOr<const nlohmann::json*> Find(const std::string& pointer) const {
    const nlohmann::json::json_pointer p(pointer);
    if (!root_.contains(p)) return Error(pointer, "is missing");
    return &root_.at(p);
  }

  absl::StatusOr<int64_t> Int(const std::string& pointer, int64_t min,
                              int64_t max = std::numeric_limits<int64_t>::max()) const {
    FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(pointer));
    if (!v->is_number_integer()) {
      return Error(pointer, absl::StrCat("must be an integer, found ", v->dump()));
    }
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Error(pointer, absl::StrCat("is out of range: ", v->dump()));
    }
    const int64_t value = v->get<int64_t>();
    if (value < min || value > max) {
      return Error(pointer, absl::StrCat("must be in [", min, ", ", max, "], found ", value));
    }
    return value;
  }

  absl::StatusOr<uint64_t> Unsigned(const std::string& pointer) const {
    FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(pointer));
    if (!v->is_number_unsigned()) {
      return Error(pointer, absl::StrCat("must be a non-negative integer, found ", v->dump()));
    }
    return v->get<uint64_t>();
  }

  absl::StatusOr<double> Number(const std::string& pointer, double min) const {
    FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(pointer));
    if (!v->is_number()) return Error(pointer, absl::StrCat("must be a number, found ", v->dump()));
    const double value = v->get<double>();
    if (!(value >= min) || !std::isfinite(value)) {
      return Error(pointer, absl::StrCat("must be a finite number ≥ ", min, ", found ", v->dump()));
    }
    return value;
  }

  absl::StatusOr<std::string> String(const std::string& pointer) const {
    FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(pointer));
    if (!v->is_string()) return Error(pointer, absl::StrCat("must be a string, found ", v->dump()));
    return v->get<std::string>();
  }

  absl::StatusOr<const nlohmann::json*> Object(const std::string& pointer) const {
    FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(pointer));
    if (!v->is_object()) return Error(pointer, absl::StrCat("must be an object, found ", v->type_name()));
    return v;
  }

 private:
  const nlohmann::json& root_;
  std::string source_;
};

}  // namespace

nlohmann::json TrainingManifestToJson(const TrainingManifest& m) {
  nlohmann::json j;
  j["iteration"] = m.iteration;
  j["consumed_samples"] = m.consumed_samples;
  j["optimizer_step"] = m.iteration;
  j["lr_schedule"] = {{"step", m.iteration}, {"lr", m.lr}};
  // The data position is consumed_samples alone (NOTE [Stateless data position]); the rest
  // is recorded so a resume can check it trains on the same data in the same order.
  j["sampler"] = {{"seed", m.data_seed},
                  {"split", m.split},
                  {"seq_length", m.seq_length},
                  {"consumed_samples", m.consumed_samples},
                  {"samples_per_epoch", m.samples_per_epoch},
                  {"epoch", m.samples_per_epoch > 0 ? m.consumed_samples / m.samples_per_epoch : 0},
                  {"data_path", m.data.path},
                  {"documents", m.data.documents},
                  {"tokens", m.data.tokens}};
  j["rng"] = {{"torch_cpu", "rng.torch_cpu"},
              {"note", "dropout and initialisation are keyed by (seed, name, counters)"}};
  j["config"] = m.config;
  j["parallel"] = {{"tp", m.tp}, {"pp", m.pp}, {"dp", m.dp}, {"ep", m.ep}};
  nlohmann::json placement = nlohmann::json::array();
  for (size_t stage = 0; stage < m.layer_placement.size(); ++stage) {
    placement.push_back({{"stage", stage},
                         {"layer_begin", m.layer_placement[stage].first},
                         {"layer_end", m.layer_placement[stage].second}});
  }
  j["layer_placement"] = placement;
  return j;
}

absl::StatusOr<TrainingManifest> ParseTrainingManifest(const nlohmann::json& manifest,
                                                       const std::string& source) {
  if (!manifest.is_object() || !manifest.contains("config") ||
      !manifest.contains("consumed_samples")) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": manifest lacks config/consumed_samples; not a Fulcrum training "
                             "checkpoint"));
  }
  const FieldReader f(manifest, source);
  TrainingManifest m;
  FULCRUM_ASSIGN_OR_RETURN(m.iteration, f.Int("/iteration", 0));
  FULCRUM_ASSIGN_OR_RETURN(m.consumed_samples, f.Int("/consumed_samples", 0));
  FULCRUM_ASSIGN_OR_RETURN(const int64_t optimizer_step, f.Int("/optimizer_step", 0));
  FULCRUM_ASSIGN_OR_RETURN(const int64_t schedule_step, f.Int("/lr_schedule/step", 0));
  FULCRUM_ASSIGN_OR_RETURN(m.lr, f.Number("/lr_schedule/lr", 0.0));
  if (optimizer_step != m.iteration || schedule_step != m.iteration) {
    return f.Error("/optimizer_step", absl::StrCat("(", optimizer_step, ") and '/lr_schedule/step' (",
                                                   schedule_step, ") must equal the iteration (",
                                                   m.iteration, ")"));
  }
  if (m.iteration > 0 && m.consumed_samples < m.iteration) {
    return f.Error("/consumed_samples",
                   absl::StrCat("is ", m.consumed_samples, ", fewer than one sample per iteration (",
                                m.iteration, " iterations)"));
  }
  FULCRUM_ASSIGN_OR_RETURN(m.data_seed, f.Unsigned("/sampler/seed"));
  FULCRUM_ASSIGN_OR_RETURN(m.split, f.String("/sampler/split"));
  FULCRUM_ASSIGN_OR_RETURN(m.seq_length, f.Int("/sampler/seq_length", 1));
  FULCRUM_ASSIGN_OR_RETURN(m.samples_per_epoch, f.Int("/sampler/samples_per_epoch", 1));
  FULCRUM_ASSIGN_OR_RETURN(const int64_t sampler_position, f.Int("/sampler/consumed_samples", 0));
  if (sampler_position != m.consumed_samples) {
    return f.Error("/sampler/consumed_samples",
                   absl::StrCat("(", sampler_position, ") differs from '/consumed_samples' (",
                                m.consumed_samples, ")"));
  }
  if (manifest["sampler"].contains("documents")) {
    FULCRUM_ASSIGN_OR_RETURN(m.data.path, f.String("/sampler/data_path"));
    FULCRUM_ASSIGN_OR_RETURN(m.data.documents, f.Int("/sampler/documents", 1));
    FULCRUM_ASSIGN_OR_RETURN(m.data.tokens, f.Int("/sampler/tokens", 1));
  }
  FULCRUM_ASSIGN_OR_RETURN(const nlohmann::json* config, f.Object("/config"));
  FULCRUM_RETURN_IF_ERROR(f.Object("/config/model").status());
  m.config = *config;
  FULCRUM_ASSIGN_OR_RETURN(const int64_t model_seq, f.Int("/config/model/seq_length", 1));
  if (model_seq != m.seq_length) {
    return f.Error("/sampler/seq_length", absl::StrCat("(", m.seq_length, ") differs from the model's (",
                                                       model_seq, ")"));
  }
  FULCRUM_ASSIGN_OR_RETURN(const int64_t layers, f.Int("/config/model/num_layers", 1));
  if (manifest.contains("parallel")) {
    FULCRUM_ASSIGN_OR_RETURN(m.tp, f.Int("/parallel/tp", 1, 1 << 20));
    FULCRUM_ASSIGN_OR_RETURN(m.pp, f.Int("/parallel/pp", 1, 1 << 20));
    FULCRUM_ASSIGN_OR_RETURN(m.dp, f.Int("/parallel/dp", 1, 1 << 20));
    FULCRUM_ASSIGN_OR_RETURN(m.ep, f.Int("/parallel/ep", 1, 1 << 20));
  }
  if (manifest.contains("layer_placement")) {
    const nlohmann::json& placement = manifest["layer_placement"];
    if (!placement.is_array()) return f.Error("/layer_placement", "must be an array");
    int64_t next = 0;
    for (size_t s = 0; s < placement.size(); ++s) {
      const std::string at = absl::StrCat("/layer_placement/", s);
      FULCRUM_ASSIGN_OR_RETURN(const int64_t begin, f.Int(at + "/layer_begin", 0, layers));
      FULCRUM_ASSIGN_OR_RETURN(const int64_t end, f.Int(at + "/layer_end", 0, layers));
      if (begin != next || end <= begin) {
        return f.Error(at, absl::StrCat("is [", begin, ", ", end, "): stages must hold contiguous, "
                                        "non-empty ranges in order from layer 0"));
      }
      next = end;
      m.layer_placement.emplace_back(begin, end);
    }
    if (!placement.empty() && next != layers) {
      return f.Error("/layer_placement", absl::StrCat("ends at layer ", next, " of ", layers));
    }
  }
  return m;
}

}  // namespace fulcrum
