#include "dynamic/repack_trigger.h"

#include <numeric>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fulcrum::dynamic {

absl::StatusOr<RepackScript> ParseRepackScript(const std::string& script) {
  RepackScript out;
  int64_t last_iteration = 0;
  int last_stages = 0;
  for (absl::string_view step : absl::StrSplit(script, ';', absl::SkipWhitespace())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(step, ':');
    int64_t iteration = 0;
    int stages = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &iteration) ||
        !absl::SimpleAtoi(parts[1], &stages)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--repack_script: step '", step, "' is not ITER:STAGES (e.g. 15:2: after iteration "
          "15, pack the pipeline onto 2 stages)"));
    }
    if (iteration < 1 || stages < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--repack_script: step '", step,
                                                     "': the iteration and the stage count "
                                                     "must be ≥ 1"));
    }
    if (iteration <= last_iteration || (last_stages > 0 && stages >= last_stages)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--repack_script: step '", step, "' must come after iteration ", last_iteration,
          " and pack onto fewer than ", last_stages, " stages"));
    }
    out[iteration] = stages;
    last_iteration = iteration;
    last_stages = stages;
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--repack_script='", script, "' has no step; expected ITER:STAGES"));
  }
  return out;
}

absl::StatusOr<RepackProblem> RepackProblemFromLoads(const std::vector<pipeline::StageLoad>& loads,
                                                     const std::string& schedule,
                                                     int num_microbatches, double memory_budget,
                                                     int num_chunks) {
  if (loads.empty()) return absl::InvalidArgumentError("repack: no stage loads");
  if (num_microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack: num_microbatches = ", num_microbatches, " must be ≥ 1"));
  }
  RepackProblem problem;
  problem.schedule = schedule;
  problem.num_microbatches = num_microbatches;
  problem.memory_budget = memory_budget;
  problem.num_chunks = num_chunks;
  const double m = num_microbatches;
  auto sum = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); };
  // One piece per (virtual) stage: a load, or with chunks each of its chunks (NOTE
  // [rebalancing under chunks] in pipeline/rebalancer.h: per-layer values in chunk order),
  // with the F, B and W it ran in all, so that the remainder is what is no layer's.
  struct Piece {
    const pipeline::StageLoad* load;
    int64_t begin, end;
    size_t offset;  // into the load's per-layer vectors
    double forward_ms, backward_ms, weight_ms;
  };
  std::vector<Piece> pieces;
  for (const pipeline::StageLoad& load : loads) {
    if (load.chunk_ranges.empty()) {
      pieces.push_back({&load, load.layer_begin, load.layer_end, 0, load.forward_ms,
                        load.backward_ms, load.weight_ms});
      continue;
    }
    size_t offset = 0;
    for (size_t c = 0; c < load.chunk_ranges.size(); ++c) {
      const auto [begin, end] = load.chunk_ranges[c];
      auto at = [&](const std::vector<double>& v) { return c < v.size() ? v[c] : 0.0; };
      pieces.push_back({&load, begin, end, offset, at(load.chunk_forward_ms),
                        at(load.chunk_backward_ms), at(load.chunk_weight_ms)});
      offset += static_cast<size_t>(std::max<int64_t>(end - begin, 0));
    }
  }
  for (size_t s = 0; s < loads.size(); ++s) {
    // Every per-layer value belongs to a layer the load holds (one range, or its chunks).
    const pipeline::StageLoad& load = loads[s];
    int64_t held = 0;
    if (load.chunk_ranges.empty()) {
      held = load.layer_end - load.layer_begin;
    } else {
      for (const auto& [begin, end] : load.chunk_ranges) held += end - begin;
    }
    for (const auto& [field, values] :
         {std::pair{"layer_forward_ms", &load.layer_forward_ms},
          std::pair{"layer_backward_ms", &load.layer_backward_ms},
          std::pair{"layer_weight_ms", &load.layer_weight_ms}}) {
      if (static_cast<int64_t>(values->size()) != held) {
        return absl::InvalidArgumentError(absl::StrCat(
            "repack: stage ", s, "'s load has ", values->size(), " ", field, " for the ", held,
            " layers it holds"));
      }
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  int64_t next = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const Piece& piece = pieces[k];
    const pipeline::StageLoad& load = *piece.load;
    const int64_t n = piece.end - piece.begin;
    const size_t held = piece.offset + static_cast<size_t>(std::max<int64_t>(n, 0));
    if (piece.begin != next || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "repack: the loads' ranges do not cover the layers in order: [", piece.begin, ",",
          piece.end, ") where layers from ", next, " were expected"));
    }
    next = piece.end;
    double layer_f = 0, layer_b = 0, layer_w = 0;
    for (size_t i = piece.offset; i < held; ++i) {
      problem.layer_forward.push_back(load.layer_forward_ms[i] / m);
      problem.layer_backward.push_back(load.layer_backward_ms[i] / m);
      problem.layer_weight.push_back(load.layer_weight_ms[i] / m);
      layer_f += load.layer_forward_ms[i];
      layer_b += load.layer_backward_ms[i];
      layer_w += load.layer_weight_ms[i];
      problem.layer_state_bytes.push_back(
          i < load.layer_state_bytes.size() ? static_cast<double>(load.layer_state_bytes[i]) : 0.0);
      problem.layer_activation_bytes.push_back(
          i < load.layer_activation_bytes.size()
              ? static_cast<double>(load.layer_activation_bytes[i]) : 0.0);
    }
    // What the piece ran besides its layers: the embedding on the first, head and loss on
    // the last (the middle ones' remainder is transfer overhead, not counted). One chunk
    // per stage: the sums as a whole (the same bits as before chunks existed).
    if (load.chunk_ranges.empty()) {
      layer_f = sum(load.layer_forward_ms);
      layer_b = sum(load.layer_backward_ms);
      layer_w = sum(load.layer_weight_ms);
    }
    pipeline::ActionCosts pinned;
    pinned.forward = std::max(0.0, (piece.forward_ms - layer_f) / m);
    pinned.backward_input = std::max(0.0, (piece.backward_ms - layer_b) / m);
    pinned.backward_weight = std::max(0.0, (piece.weight_ms - layer_w) / m);
    double layer_state = 0;
    for (int64_t b : load.layer_state_bytes) layer_state += static_cast<double>(b);
    const double pinned_state = std::max(0.0, static_cast<double>(load.state_bytes()) - layer_state);
    if (k == 0) {
      problem.first_stage = pinned;
      problem.first_stage_pinned_bytes = pinned_state;
    }
    if (k + 1 == pieces.size()) {
      problem.last_stage = pinned;
      // A rank holding both ends (ZB-V) counts its pinned state once.
      problem.last_stage_pinned_bytes = piece.load == pieces.front().load && k > 0 ? 0.0 : pinned_state;
    }
  }
  return problem;
}

absl::StatusOr<std::optional<RepackPlan>> RepackTrigger::Check(
    int64_t iteration, const pipeline::LayerRanges& current,
    const std::vector<pipeline::StageLoad>& loads, int64_t frozen_prefix) {
  Placement placement;
  for (const auto& [begin, end] : current) placement.push_back({begin, end});
  // NOTE [re-packing under chunks] in repack.h: with chunks, p·v ranges on p ranks.
  const int p = RanksOf(static_cast<int>(placement.size()),
                        ChunksPerRank(options_.schedule, options_.num_chunks));
  if (!options_.automatic) {
    // NOTE [overdue script step]: the latest step at or before `iteration`; stage counts
    // fall from step to step, so if it asks for no fewer stages than run now, none does.
    auto step = options_.script.upper_bound(iteration);
    if (step == options_.script.begin()) return std::nullopt;
    --step;
    if (step->second >= p) return std::nullopt;
    absl::StatusOr<Placement> packed =
        EvenCoarsening(placement, step->second, options_.schedule, options_.num_chunks);
    if (!packed.ok()) return packed.status();
    RepackPlan plan;
    plan.repack = true;
    plan.placement = *packed;
    const std::string overdue =
        step->first == iteration
            ? ""
            : absl::StrCat(" (the step ", step->first, ":", step->second, " was due after "
                           "iteration ", step->first, "; this run resumed from a checkpoint "
                           "past it on ", p, " stages, so it re-packs at its first chance)");
    plan.note = absl::StrCat("repack: --repack_script packs ", p, " stages onto ", step->second,
                             " after iteration ", iteration, overdue, ": ",
                             FormatPlacement(placement), " → ", FormatPlacement(plan.placement));
    last_note_ = plan.note;
    return std::optional<RepackPlan>(std::move(plan));
  }
  if (p <= options_.decision.min_stages || iteration % options_.interval != 0) return std::nullopt;
  bool measured = false;
  for (const pipeline::StageLoad& load : loads) measured = measured || load.total_ms > 0;
  if (!measured) return std::nullopt;
  absl::StatusOr<RepackProblem> problem =
      RepackProblemFromLoads(loads, options_.schedule, options_.num_microbatches,
                             options_.memory_budget, options_.num_chunks);
  if (!problem.ok()) return problem.status();
  problem->frozen_prefix = frozen_prefix;
  problem->measured_zbv_order = options_.measured_zbv_order;
  absl::StatusOr<RepackPlan> plan = DecideRepack(*problem, placement, options_.decision);
  if (!plan.ok()) return plan.status();
  last_note_ = absl::StrCat("after iteration ", iteration, ": ", plan->note);
  if (!plan->repack) return std::nullopt;
  return std::optional<RepackPlan>(std::move(*plan));
}

}  // namespace fulcrum::dynamic
