// Discrete-event simulation of a validated schedule (schedule_simulator.h has the model).
#include "pipeline/schedule_simulator.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "absl/strings/str_cat.h"

namespace fulcrum::pipeline {
namespace {

double Duration(const ActionCosts& costs, ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return costs.forward;
    case ActionKind::kBackward:
      return costs.backward_input + costs.backward_weight;
    case ActionKind::kBackwardInput:
      return costs.backward_input;
    case ActionKind::kBackwardWeight:
      return costs.backward_weight;
  }
  return 0;
}

void CheckCosts(const ActionCosts& costs, const std::string& what) {
  for (double cost : {costs.forward, costs.backward_input, costs.backward_weight, costs.p2p}) {
    if (!std::isfinite(cost) || cost < 0) {
      throw std::invalid_argument(absl::StrCat("Simulate: ", what, " has a cost of ", cost,
                                               "; costs must be finite and ≥ 0"));
    }
  }
}

}  // namespace

ActionCosts ChunkCosts(const ActionCosts& stage, int num_chunks) {
  if (num_chunks < 1) {
    throw std::invalid_argument(
        absl::StrCat("ChunkCosts: needs at least 1 chunk, got ", num_chunks));
  }
  const double v = num_chunks;
  return {stage.forward / v, stage.backward_input / v, stage.backward_weight / v, stage.p2p};
}

SimulationResult Simulate(const Schedule& schedule, const ActionCosts& costs) {
  return Simulate(schedule, std::vector<ActionCosts>(std::max(schedule.num_stages, 0), costs));
}

SimulationResult Simulate(const Schedule& schedule, const std::vector<ActionCosts>& stage_costs) {
  if (absl::Status status = ValidateSchedule(schedule); !status.ok()) {
    throw std::invalid_argument(absl::StrCat("Simulate: ", status.message()));
  }
  const int p = schedule.num_stages;
  const int m = schedule.num_microbatches;
  const int v = schedule.num_chunks;
  const int num_costs = static_cast<int>(stage_costs.size());
  // costs[stage][chunk]: what one action of that chunk costs.
  std::vector<std::vector<ActionCosts>> costs(p, std::vector<ActionCosts>(v));
  if (num_costs == p) {
    for (int s = 0; s < p; ++s) {
      CheckCosts(stage_costs[s], absl::StrCat("stage ", s));
      for (int c = 0; c < v; ++c) costs[s][c] = stage_costs[s];
    }
  } else if (v > 1 && num_costs == p * v) {
    const std::vector<ChunkId> layout = VirtualStages(schedule);
    for (int k = 0; k < p * v; ++k) {
      CheckCosts(stage_costs[k], absl::StrCat("virtual stage ", k));
      costs[layout[k].stage][layout[k].chunk] = stage_costs[k];
    }
  } else if (v == 1) {
    throw std::invalid_argument(
        absl::StrCat("Simulate: ", num_costs, " stage costs for ", p, " stages"));
  } else {
    throw std::invalid_argument(absl::StrCat(
        "Simulate: ", num_costs, " costs for ", p, " stages × ", v, " chunks; give ", p,
        " (one per stage) or ", p * v, " (one per virtual stage, in model order)"));
  }

  // end_time[stage][kind][chunk · m + mb]; negative until the action ran.
  std::vector<std::vector<std::vector<double>>> end_time(
      p, std::vector<std::vector<double>>(kNumActionKinds, std::vector<double>(v * m, -1.0)));
  auto end_of = [&](const StageAction& node) -> double& {
    return end_time[node.stage][KindIndex(node.action.kind)]
                   [node.action.chunk * m + node.action.microbatch];
  };

  SimulationResult result;
  result.stages.resize(p);
  std::vector<double> free_at(p, 0.0);
  // An action starts when its stage is free and its dependencies' outputs arrived: the
  // shared walk (WalkInListOrder) then gives a time-ordered event queue's times.
  const std::vector<size_t> next = WalkInListOrder(schedule, [&](int s, const Action& action) {
    double start = free_at[s];
    for (const StageAction& dep : Dependencies(schedule, s, action)) {
      const double dep_end = end_of(dep);
      if (dep_end < 0) return false;
      // The sender pays the transfer; none between two chunks of one stage.
      const double transfer = dep.stage == s ? 0 : costs[dep.stage][dep.action.chunk].p2p;
      start = std::max(start, dep_end + transfer);
    }
    const double duration = Duration(costs[s][action.chunk], action.kind);
    const double end = start + duration;
    end_of({s, action}) = end;
    free_at[s] = end;
    StageTimeline& timeline = result.stages[s];
    timeline.actions.push_back({start, end, action});
    timeline.busy += duration;
    return true;
  });
  for (int s = 0; s < p; ++s) {
    StageTimeline& timeline = result.stages[s];
    // ValidateSchedule proved that every list runs to completion.
    if (next[s] != schedule.stages[s].size()) {
      throw std::logic_error(
          absl::StrCat("Simulate: stage ", s, " stalled on a validated schedule"));
    }
    timeline.idle = timeline.end() - timeline.busy;
    result.makespan = std::max(result.makespan, timeline.end());
  }
  return result;
}

}  // namespace fulcrum::pipeline
