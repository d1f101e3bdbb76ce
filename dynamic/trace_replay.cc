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
// (a load without a per-layer measurement), which a replay cannot use; with chunks the
// replay needs each chunk's action totals too.
absl::Status CheckReplayable(const pipeline::StageLoad& load) {
  size_t n = 0;
  for (const auto& [begin, end] : pipeline::HeldRanges(load)) {
    n += static_cast<size_t>(end - begin);
  }
  if (!load.chunk_ranges.empty() &&
      (load.chunk_forward_ms.empty() || load.chunk_backward_ms.empty() ||
       load.chunk_weight_ms.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage ", load.stage, "'s load has chunks but no chunk_forward_ms/chunk_backward_ms/"
        "chunk_weight_ms; a replay needs each chunk's action times"));
  }
  for (const auto& [field, values] : {std::pair{"layer_forward_ms", &load.layer_forward_ms},
                                      std::pair{"layer_backward_ms", &load.layer_backward_ms},
                                      std::pair{"layer_weight_ms", &load.layer_weight_ms}}) {
    if (values->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", load.stage, "'s load has ", values->size(), " ", field,
          "; a replay needs one per layer of its ranges (", n, ")"));
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

// `what` ("ran_on", "decision") of `j`: a placement of the line's layers over its (virtual)
// stages.
absl::StatusOr<Placement> PlacementField(const nlohmann::json& j, const char* what,
                                         const TraceLine& line) {
  if (!j.contains(what)) return absl::InvalidArgumentError(absl::StrCat("no '", what, "'"));
  absl::StatusOr<pipeline::LayerRanges> ranges = pipeline::RangesFromJson(j.at(what));
  if (!ranges.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", what, "': ", ranges.status().message()));
  }
  const int stages = static_cast<int>(line.loads.size()) * line.num_chunks;
  if (absl::Status s = pipeline::ValidateRanges(*ranges, line.num_layers, stages); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", what, "' is not a placement of the loads' ", line.num_layers,
                     " layers over ", stages, line.num_chunks > 1 ? " virtual" : "", " stages: ",
                     s.message()));
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
    if (j.contains("zbv_order")) {
      const std::string order = j.at("zbv_order").get<std::string>();
      if (order != "measured" && order != "unit") {
        return absl::InvalidArgumentError(
            absl::StrCat("'zbv_order' is '", order, "'; expected measured or unit"));
      }
      line.measured_zbv_order = order == "measured";
    }
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
  // ValidateLoads checked that every load has chunks or none, and that they form a placement.
  line.num_chunks = std::max<int>(1, static_cast<int>(line.loads[0].chunk_ranges.size()));
  for (const pipeline::StageLoad& load : line.loads) {
    if (!load.chunk_ranges.empty() && static_cast<int>(load.chunk_ranges.size()) != line.num_chunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stage ", load.stage, " has ", load.chunk_ranges.size(), " chunks and stage 0 ",
          line.num_chunks, "; every rank holds the same number of chunks"));
    }
  }
  line.num_layers = pipeline::NumLayersHeld(line.loads);
  absl::StatusOr<Placement> ran_on = PlacementField(j, "ran_on", line);
  if (!ran_on.ok()) return ran_on.status();
  absl::StatusOr<Placement> decision = PlacementField(j, "decision", line);
  if (!decision.ok()) return decision.status();
  line.ran_on = *std::move(ran_on);
  line.decision = *std::move(decision);
  if (line.frozen_prefix < 0 || line.frozen_prefix > line.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("frozen_prefix = ", line.frozen_prefix,
                                                   "; expected 0..", line.num_layers,
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
      if (line->loads.size() != first.loads.size() || line->num_layers != first.num_layers ||
          line->num_chunks != first.num_chunks || line->schedule != first.schedule ||
          line->measured_zbv_order != first.measured_zbv_order ||
          line->microbatches != first.microbatches) {
        return bad(
            "the stages, chunks, layers, schedule or micro-batches changed within the trace");
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
  const int64_t layers = line.num_layers;
  IterationCosts c;
  c.forward.assign(layers, 0.0);
  c.backward.assign(layers, 0.0);
  c.weight.assign(layers, 0.0);
  c.parameters.assign(layers, 0.0);
  c.state_bytes.assign(layers, 0.0);
  c.block_load.assign(layers, 0.0);
  for (const pipeline::StageLoad& load : line.loads) {
    size_t k = 0;  // Index into the load's per-layer vectors (its ranges' layers in order).
    for (const auto& [begin, end] : pipeline::HeldRanges(load)) {
      for (int64_t l = begin; l < end; ++l, ++k) {
        c.forward[l] = load.layer_forward_ms[k] / m;
        c.backward[l] = load.layer_backward_ms[k] / m;
        c.weight[l] = load.layer_weight_ms[k] / m;
        if (!load.layer_parameters.empty()) c.parameters[l] = load.layer_parameters[k];
        if (!load.layer_state_bytes.empty()) {
          c.state_bytes[l] = static_cast<double>(load.layer_state_bytes[k]);
        }
        if (!load.layer_block_load.empty()) c.block_load[l] = load.layer_block_load[k];
      }
    }
  }
  // Pinned time of virtual stage v (a stage with one chunk per rank): the totals of the
  // stage or chunk as it ran minus its layers, per kind.
  const std::vector<int> chunk_rank = pipeline::ChunkRanks(line.loads);
  auto pinned = [&](int v, double* f, double* b, double* w) {
    double total_f = 0, total_b = 0, total_w = 0;
    if (chunk_rank.empty()) {
      const pipeline::StageLoad& load = line.loads[v];
      total_f = load.forward_ms;
      total_b = load.backward_ms;
      total_w = load.weight_ms;
    } else {
      // Virtual stage v is its rank's chunk `chunk`: the rank's chunks run in model order.
      const int rank = chunk_rank[v];
      const int chunk = static_cast<int>(std::count(chunk_rank.begin(), chunk_rank.begin() + v, rank));
      const pipeline::StageLoad& load = line.loads[rank];
      total_f = load.chunk_forward_ms[chunk];
      total_b = load.chunk_backward_ms[chunk];
      total_w = load.chunk_weight_ms[chunk];
    }
    double lf = 0, lb = 0, lw = 0;
    for (int64_t l = line.ran_on[v].begin; l < line.ran_on[v].end; ++l) {
      lf += c.forward[l] * m;
      lb += c.backward[l] * m;
      lw += c.weight[l] * m;
    }
    *f = std::max(0.0, total_f - lf) / m;
    *b = std::max(0.0, total_b - lb) / m;
    *w = std::max(0.0, total_w - lw) / m;
  };
  const int last = static_cast<int>(line.ran_on.size()) - 1;
  pinned(0, &c.first_forward, &c.first_backward, &c.first_weight);
  if (last > 0) pinned(last, &c.last_forward, &c.last_backward, &c.last_weight);
  const int first_rank = chunk_rank.empty() ? 0 : chunk_rank.front();
  const int last_rank = chunk_rank.empty() ? static_cast<int>(line.loads.size()) - 1 : chunk_rank.back();
  if (first_rank == last_rank) {
    // One rank holds the embedding and the head (ZB-V, or one stage): its pinned parameters
    // are both; the simulator adds first and last, so they go to the first.
    c.first_parameters = line.loads[first_rank].pinned_parameters;
  } else {
    c.first_parameters = line.loads[first_rank].pinned_parameters;
    c.last_parameters = line.loads[last_rank].pinned_parameters;
  }
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
  s.num_chunks = trace.num_chunks();
  s.measured_zbv_order = trace.lines[0].measured_zbv_order;
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
