#include "dynamic/trace_replay.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/file_system.h"
#include "core/json_limits.h"
#include "dynamic/load_model.h"
#include "pipeline/load_trace.h"

namespace fulcrum::dynamic {
namespace {

absl::Status FiniteNonNegative(const char* field, double value) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("measured ", field, " = ", value, "; expected a finite time >= 0"));
  }
  return absl::OkStatus();
}

// The per-layer vectors the replay indexes (CostsFromTraceLine): one entry per layer of the
// stage's range; the optional ones may also be empty. ValidateLoads lets the times be empty
// (a load without a per-layer measurement), which a replay cannot use.
absl::Status CheckReplayable(const pipeline::StageLoad& load) {
  const size_t n = static_cast<size_t>(load.layer_end - load.layer_begin);
  for (const auto& [field, values] : {std::pair{"layer_forward_ms", &load.layer_forward_ms},
                                      std::pair{"layer_backward_ms", &load.layer_backward_ms},
                                      std::pair{"layer_weight_ms", &load.layer_weight_ms}}) {
    if (values->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", load.stage, "'s load has ", values->size(), " ", field,
          "; a replay needs one per layer of its range [", load.layer_begin, ",", load.layer_end,
          ")"));
    }
  }
  if (!load.layer_block_load.empty() && load.layer_block_load.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", load.stage, "'s load has ",
                                                   load.layer_block_load.size(),
                                                   " layer_block_load; expected ", n, " or none"));
  }
  for (double v : load.layer_block_load) {
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", load.stage, "'s load has a non-finite layer_block_load"));
    }
  }
  return absl::OkStatus();
}

// `what` ("ran_on", "decision") of `j`: a placement of the loads' layers over their stages.
absl::StatusOr<Placement> PlacementField(const nlohmann::json& j, const char* what,
                                         const std::vector<pipeline::StageLoad>& loads) {
  if (!j.contains(what)) return absl::InvalidArgumentError(absl::StrCat("no '", what, "'"));
  absl::StatusOr<pipeline::LayerRanges> ranges = pipeline::RangesFromJson(j.at(what));
  if (!ranges.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", what, "': ", ranges.status().message()));
  }
  if (absl::Status s = pipeline::ValidateRanges(*ranges, loads.back().layer_end,
                                                static_cast<int>(loads.size()));
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", what, "' is not a placement of the loads' ",
                                                   loads.back().layer_end, " layers over ",
                                                   loads.size(), " stages: ", s.message()));
  }
  return ToPlacement(*ranges);
}

absl::StatusOr<TraceLine> ParseLine(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  TraceLine line;
  try {
    // NOTE [JSON integers] (core/json_limits.h): a float here would be cast unchecked.
    absl::StatusOr<int64_t> iteration = JsonInteger<int64_t>(j.at("iteration"));
    if (!iteration.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'iteration': ", iteration.status().message()));
    }
    line.iteration = *iteration;
    line.schedule = j.at("schedule").get<std::string>();
    absl::StatusOr<int> microbatches = JsonInteger<int>(j.at("microbatches"));
    if (!microbatches.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'microbatches': ", microbatches.status().message()));
    }
    line.microbatches = *microbatches;
    line.rebalancer = j.value("rebalancer", std::string());
    const nlohmann::json& measured = j.at("measured");
    if (!measured.is_object()) return absl::InvalidArgumentError("'measured' is not an object");
    line.pipeline_ms = measured.value("pipeline_ms", 0.0);
    line.bubble_ratio = measured.value("bubble_ratio", 0.0);
    line.iteration_ms = measured.value("iteration_ms", 0.0);
    line.stage_ms = measured.value("stage_ms", std::vector<double>{});
    if (j.contains("model_changed")) {
      line.model_changed = j.at("model_changed").get<std::vector<std::string>>();
    }
    if (j.contains("frozen_prefix")) {
      absl::StatusOr<int64_t> frozen = JsonInteger<int64_t>(j.at("frozen_prefix"));
      if (!frozen.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'frozen_prefix': ", frozen.status().message()));
      }
      line.frozen_prefix = *frozen;
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
  if (line.iteration < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("iteration ", line.iteration, "; iterations count from 1"));
  }
  if (line.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatches = ", line.microbatches, "; expected >= 1"));
  }
  if (line.schedule.empty()) return absl::InvalidArgumentError("an empty schedule name");
  for (const auto& [field, value] : {std::pair{"pipeline_ms", line.pipeline_ms},
                                     std::pair{"iteration_ms", line.iteration_ms}}) {
    if (absl::Status s = FiniteNonNegative(field, value); !s.ok()) return s;
  }
  for (double ms : line.stage_ms) {
    if (absl::Status s = FiniteNonNegative("stage_ms", ms); !s.ok()) return s;
  }
  if (!(line.bubble_ratio >= 0 && line.bubble_ratio <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("measured bubble_ratio = ", line.bubble_ratio, "; expected a value in [0, 1]"));
  }
  if (!j.contains("loads") || !j.at("loads").is_array()) {
    return absl::InvalidArgumentError("'loads' is missing or not an array");
  }
  for (const nlohmann::json& stage : j.at("loads")) {
    absl::StatusOr<pipeline::StageLoad> load = pipeline::StageLoadFromJson(stage);
    if (!load.ok()) return load.status();
    line.loads.push_back(*std::move(load));
  }
  if (absl::Status s = ValidateLoads(line.loads); !s.ok()) return s;
  for (const pipeline::StageLoad& load : line.loads) {
    if (absl::Status s = CheckReplayable(load); !s.ok()) return s;
  }
  absl::StatusOr<Placement> ran_on = PlacementField(j, "ran_on", line.loads);
  if (!ran_on.ok()) return ran_on.status();
  absl::StatusOr<Placement> decision = PlacementField(j, "decision", line.loads);
  if (!decision.ok()) return decision.status();
  line.ran_on = *std::move(ran_on);
  line.decision = *std::move(decision);
  if (line.frozen_prefix < 0 || line.frozen_prefix > line.loads.back().layer_end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frozen_prefix = ", line.frozen_prefix, "; expected 0..", line.loads.back().layer_end,
        " (the model's layers)"));
  }
  return line;
}

}  // namespace

absl::StatusOr<LoadTrace> ParseLoadTrace(std::string_view text_view, std::string_view name_view) {
  // This abseil's string_view is its own type, not std::string_view.
  const absl::string_view text(text_view.data(), text_view.size());
  const absl::string_view name(name_view.data(), name_view.size());
  LoadTrace trace;
  int number = 0;
  for (absl::string_view row : absl::StrSplit(text, '\n')) {
    ++number;
    if (absl::StripAsciiWhitespace(row).empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(name, ":", number, ": ", why));
    };
    const nlohmann::json j = nlohmann::json::parse(row.begin(), row.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return bad("not JSON");
    absl::StatusOr<TraceLine> line = ParseLine(j);
    if (!line.ok()) return bad(line.status().message());
    if (!trace.lines.empty()) {
      const TraceLine& first = trace.lines.front();
      if (line->iteration - 1 != trace.lines.back().iteration) {
        return bad(absl::StrCat("iteration ", line->iteration, " after ",
                                trace.lines.back().iteration, " (one run, in order, expected)"));
      }
      if (line->loads.size() != first.loads.size() ||
          line->loads.back().layer_end != first.loads.back().layer_end ||
          line->schedule != first.schedule || line->microbatches != first.microbatches) {
        return bad("the stages, layers, schedule or micro-batches changed within the trace");
      }
    }
    trace.lines.push_back(*std::move(line));
  }
  if (trace.lines.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the load trace '", name, "' has no lines (a run writes one per iteration from its second)"));
  }
  return trace;
}

absl::StatusOr<LoadTrace> ReadLoadTrace(const std::string& path) {
  absl::StatusOr<std::string> text = DefaultFileSystem()->ReadFile(path);
  if (!text.ok()) return text.status();  // "cannot open PATH: No such file or directory".
  return ParseLoadTrace(*text, path);
}

IterationCosts CostsFromTraceLine(const TraceLine& line) {
  const double m = std::max(1, line.microbatches);
  const int64_t layers = line.loads.back().layer_end;
  IterationCosts c;
  c.forward.assign(layers, 0.0);
  c.backward.assign(layers, 0.0);
  c.weight.assign(layers, 0.0);
  c.parameters.assign(layers, 0.0);
  c.state_bytes.assign(layers, 0.0);
  c.block_load.assign(layers, 0.0);
  for (const pipeline::StageLoad& load : line.loads) {
    for (int64_t l = load.layer_begin; l < load.layer_end; ++l) {
      const size_t k = static_cast<size_t>(l - load.layer_begin);
      c.forward[l] = load.layer_forward_ms[k] / m;
      c.backward[l] = load.layer_backward_ms[k] / m;
      c.weight[l] = load.layer_weight_ms[k] / m;
      if (!load.layer_parameters.empty()) c.parameters[l] = load.layer_parameters[k];
      if (!load.layer_state_bytes.empty()) c.state_bytes[l] = static_cast<double>(load.layer_state_bytes[k]);
      if (!load.layer_block_load.empty()) c.block_load[l] = load.layer_block_load[k];
    }
  }
  // Pinned time: the stage totals (of the stage as it ran) minus its layers, per kind.
  auto pinned = [&](int s, double* f, double* b, double* w) {
    const pipeline::StageLoad& load = line.loads[s];
    double lf = 0, lb = 0, lw = 0;
    for (int64_t l = line.ran_on[s].begin; l < line.ran_on[s].end; ++l) {
      lf += c.forward[l] * m;
      lb += c.backward[l] * m;
      lw += c.weight[l] * m;
    }
    *f = std::max(0.0, load.forward_ms - lf) / m;
    *b = std::max(0.0, load.backward_ms - lb) / m;
    *w = std::max(0.0, load.weight_ms - lw) / m;
  };
  const int p = static_cast<int>(line.loads.size());
  pinned(0, &c.first_forward, &c.first_backward, &c.first_weight);
  if (p > 1) pinned(p - 1, &c.last_forward, &c.last_backward, &c.last_weight);
  c.first_parameters = line.loads.front().pinned_parameters;
  if (p > 1) c.last_parameters = line.loads.back().pinned_parameters;
  c.model_changed = !line.model_changed.empty();
  for (const std::string& reason : line.model_changed) {
    c.change_reason += (c.change_reason.empty() ? "" : "; ") + reason;
  }
  c.recorded_loads = line.loads;
  c.recorded_ran_on = line.ran_on;
  c.frozen_prefix = line.frozen_prefix;
  return c;
}

Scenario ScenarioFromTrace(const LoadTrace& trace, const std::string& name) {
  Scenario s;
  s.name = name;
  s.description = absl::StrCat("replay of ", trace.lines.size(), " measured iterations");
  s.num_stages = trace.num_stages();
  s.num_microbatches = trace.lines[0].microbatches;
  s.schedule = trace.lines[0].schedule;
  s.iterations = static_cast<int64_t>(trace.lines.size());
  s.initial_placement = trace.lines[0].ran_on;
  auto costs = std::make_shared<std::vector<IterationCosts>>();
  for (const TraceLine& line : trace.lines) costs->push_back(CostsFromTraceLine(line));
  s.costs = [costs](int64_t i) { return (*costs)[static_cast<size_t>(i - 1)]; };
  return s;
}

IterationCosts ScaleCosts(const IterationCosts& costs, int64_t hidden, int64_t new_layers,
                          int64_t new_hidden, int64_t seq_length) {
  const double h = static_cast<double>(hidden), h2 = static_cast<double>(new_hidden);
  const double s = static_cast<double>(seq_length);
  const double layer_ratio = (24 * h2 * h2 + 4 * s * h2) / (24 * h * h + 4 * s * h);
  const double pinned_ratio = h2 / h;
  const double param_ratio = (h2 / h) * (h2 / h);
  const int64_t layers = costs.num_layers();
  IterationCosts out;
  auto pick = [&](const std::vector<double>& v, double ratio) {
    std::vector<double> r;
    if (v.empty()) return r;
    for (int64_t l = 0; l < new_layers; ++l) r.push_back(v[l * layers / new_layers] * ratio);
    return r;
  };
  out.forward = pick(costs.forward, layer_ratio);
  out.backward = pick(costs.backward, layer_ratio);
  out.weight = pick(costs.weight, layer_ratio);
  out.parameters = pick(costs.parameters, param_ratio);
  out.state_bytes = pick(costs.state_bytes, param_ratio);
  out.block_load = pick(costs.block_load, 1.0);
  out.first_forward = costs.first_forward * pinned_ratio;
  out.first_backward = costs.first_backward * pinned_ratio;
  out.first_weight = costs.first_weight * pinned_ratio;
  out.last_forward = costs.last_forward * pinned_ratio;
  out.last_backward = costs.last_backward * pinned_ratio;
  out.last_weight = costs.last_weight * pinned_ratio;
  out.first_parameters = costs.first_parameters * pinned_ratio;
  out.last_parameters = costs.last_parameters * pinned_ratio;
  out.model_changed = costs.model_changed;
  out.change_reason = costs.change_reason;
  // New layer l takes old layer l·L/L' (pick): it is frozen when that one is, which holds
  // for l < ceil(k·L'/L).
  out.frozen_prefix = (costs.frozen_prefix * new_layers + layers - 1) / std::max<int64_t>(layers, 1);
  return out;  // The recorded loads do not carry over: they describe the recorded model.
}

}  // namespace fulcrum::dynamic
