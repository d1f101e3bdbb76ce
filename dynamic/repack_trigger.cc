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
                                                     int num_microbatches, double memory_budget) {
  if (loads.empty()) return absl::InvalidArgumentError("repack: no stage loads");
  if (num_microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack: num_microbatches = ", num_microbatches, " must be ≥ 1"));
  }
  RepackProblem problem;
  problem.schedule = schedule;
  problem.num_microbatches = num_microbatches;
  problem.memory_budget = memory_budget;
  const double m = num_microbatches;
  auto sum = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); };
  int64_t next = 0;
  for (size_t s = 0; s < loads.size(); ++s) {
    const pipeline::StageLoad& load = loads[s];
    const int64_t n = load.layer_end - load.layer_begin;
    if (load.layer_begin != next || n < 1 ||
        static_cast<int64_t>(load.layer_forward_ms.size()) != n ||
        static_cast<int64_t>(load.layer_backward_ms.size()) != n ||
        static_cast<int64_t>(load.layer_weight_ms.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "repack: stage ", s, "'s load covers layers [", load.layer_begin, ",", load.layer_end,
          ") with ", load.layer_forward_ms.size(), " timings; expected layers from ", next));
    }
    next = load.layer_end;
    for (int64_t i = 0; i < n; ++i) {
      problem.layer_forward.push_back(load.layer_forward_ms[i] / m);
      problem.layer_backward.push_back(load.layer_backward_ms[i] / m);
      problem.layer_weight.push_back(load.layer_weight_ms[i] / m);
      problem.layer_state_bytes.push_back(
          i < static_cast<int64_t>(load.layer_state_bytes.size())
              ? static_cast<double>(load.layer_state_bytes[i]) : 0.0);
      problem.layer_activation_bytes.push_back(
          i < static_cast<int64_t>(load.layer_activation_bytes.size())
              ? static_cast<double>(load.layer_activation_bytes[i]) : 0.0);
    }
    // What the stage ran besides its layers: the embedding on the first, head and loss on
    // the last (the middle stages' remainder is transfer overhead, not counted).
    pipeline::ActionCosts pinned;
    pinned.forward = std::max(0.0, (load.forward_ms - sum(load.layer_forward_ms)) / m);
    pinned.backward_input = std::max(0.0, (load.backward_ms - sum(load.layer_backward_ms)) / m);
    pinned.backward_weight = std::max(0.0, (load.weight_ms - sum(load.layer_weight_ms)) / m);
    double layer_state = 0;
    for (int64_t b : load.layer_state_bytes) layer_state += static_cast<double>(b);
    const double pinned_state = std::max(0.0, static_cast<double>(load.state_bytes()) - layer_state);
    if (s == 0) {
      problem.first_stage = pinned;
      problem.first_stage_pinned_bytes = pinned_state;
    }
    if (s + 1 == loads.size()) {
      problem.last_stage = pinned;
      problem.last_stage_pinned_bytes = pinned_state;
    }
  }
  return problem;
}

absl::StatusOr<std::optional<RepackPlan>> RepackTrigger::Check(
    int64_t iteration, const pipeline::LayerRanges& current,
    const std::vector<pipeline::StageLoad>& loads, int64_t frozen_prefix) {
  // NOTE [re-packing under chunks] in repack.h: refused before a script step or a decision.
  if (options_.automatic || !options_.script.empty()) {
    if (absl::Status s = CheckRepackSupported(options_.schedule, options_.num_chunks); !s.ok()) {
      return s;
    }
  }
  Placement placement;
  for (const auto& [begin, end] : current) placement.push_back({begin, end});
  const int p = static_cast<int>(placement.size());
  if (!options_.automatic) {
    // NOTE [overdue script step]: the latest step at or before `iteration`; stage counts
    // fall from step to step, so if it asks for no fewer stages than run now, none does.
    auto step = options_.script.upper_bound(iteration);
    if (step == options_.script.begin()) return std::nullopt;
    --step;
    if (step->second >= p) return std::nullopt;
    absl::StatusOr<Placement> packed = EvenCoarsening(placement, step->second);
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
  absl::StatusOr<RepackProblem> problem = RepackProblemFromLoads(
      loads, options_.schedule, options_.num_microbatches, options_.memory_budget);
  if (!problem.ok()) return problem.status();
  problem->frozen_prefix = frozen_prefix;
  absl::StatusOr<RepackPlan> plan = DecideRepack(*problem, placement, options_.decision);
  if (!plan.ok()) return plan.status();
  last_note_ = absl::StrCat("after iteration ", iteration, ": ", plan->note);
  if (!plan->repack) return std::nullopt;
  return std::optional<RepackPlan>(std::move(*plan));
}

}  // namespace fulcrum::dynamic
