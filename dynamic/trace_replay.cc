#include "dynamic/trace_replay.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "dynamic/load_model.h"
#include "pipeline/load_trace.h"

namespace fulcrum::dynamic {
namespace {

absl::StatusOr<TraceLine> ParseLine(const nlohmann::json& j) {
  TraceLine line;
  try {
    line.iteration = j.at("iteration").get<int64_t>();
    line.schedule = j.at("schedule").get<std::string>();
    line.microbatches = j.at("microbatches").get<int>();
    line.rebalancer = j.value("rebalancer", std::string());
    const nlohmann::json& measured = j.at("measured");
    line.pipeline_ms = measured.value("pipeline_ms", 0.0);
    line.bubble_ratio = measured.value("bubble_ratio", 0.0);
    line.iteration_ms = measured.value("iteration_ms", 0.0);
    line.stage_ms = measured.value("stage_ms", std::vector<double>{});
    if (j.contains("model_changed")) {
      line.model_changed = j.at("model_changed").get<std::vector<std::string>>();
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
  absl::StatusOr<pipeline::LayerRanges> ran_on = pipeline::RangesFromJson(j.at("ran_on"));
  if (!ran_on.ok()) return ran_on.status();
  absl::StatusOr<pipeline::LayerRanges> decision = pipeline::RangesFromJson(j.at("decision"));
  if (!decision.ok()) return decision.status();
  line.ran_on = ToPlacement(*ran_on);
  line.decision = ToPlacement(*decision);
  if (!j.at("loads").is_array()) return absl::InvalidArgumentError("'loads' is not an array");
  for (const nlohmann::json& stage : j.at("loads")) {
    absl::StatusOr<pipeline::StageLoad> load = pipeline::StageLoadFromJson(stage);
    if (!load.ok()) return load.status();
    line.loads.push_back(*std::move(load));
  }
  if (absl::Status s = ValidateLoads(line.loads); !s.ok()) return s;
  return line;
}

}  // namespace

absl::StatusOr<LoadTrace> ReadLoadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open the load trace '", path, "'"));
  LoadTrace trace;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    if (text.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", why));
    };
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return bad("not JSON");
    absl::StatusOr<TraceLine> line = ParseLine(j);
    if (!line.ok()) return bad(line.status().message());
    if (!trace.lines.empty()) {
      const TraceLine& first = trace.lines.front();
      if (line->iteration != trace.lines.back().iteration + 1) {
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
        "the load trace '", path, "' has no lines (a run writes one per iteration from its second)"));
  }
  return trace;
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
  return out;  // The recorded loads do not carry over: they describe the recorded model.
}

}  // namespace fulcrum::dynamic
