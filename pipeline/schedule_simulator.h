// Cost simulation of a pipeline schedule: when every action of every stage would start and
// end, given what F, B and W cost, and how much of each stage's time is bubble. Used to
// compare schedules, by tests to pin the bubble of each generator to its closed form, and
// by the rebalancer to predict an iteration from measured per-stage costs.
//
// Model: each stage runs its list strictly in order, one action at a time; an action starts
// when its stage is free and its dependencies (NOTE [pipeline dependencies] in schedule.h)
// have finished, plus one transfer time for a dependency on another stage. Transfers do
// not occupy either stage. Pure functions; thread-safe.
#pragma once

#include <vector>

#include "pipeline/schedule.h"

namespace fulcrum::pipeline {

/// What one action costs on a stage, in any time unit (seconds, or 1 per F).
struct ActionCosts {
  double forward = 0;          ///< F.
  double backward_input = 0;   ///< B; a fused BW costs backward_input + backward_weight.
  double backward_weight = 0;  ///< W.
  double p2p = 0;  ///< Sending an activation or gradient to a neighbour stage. Default: 0.
};

/// One simulated action.
struct TimedAction {
  double start = 0;
  double end = 0;
  Action action;
};

/// What one stage does over the iteration.
struct StageTimeline {
  std::vector<TimedAction> actions;  ///< In list order.
  double busy = 0;                   ///< Sum of the action durations.
  /// Time spent waiting before and between actions, up to the stage's own last action:
  /// end() - busy.
  double idle = 0;

  /// Start of the first action (0 for an empty stage).
  double start() const { return actions.empty() ? 0 : actions.front().start; }
  /// End of the last action (0 for an empty stage).
  double end() const { return actions.empty() ? 0 : actions.back().end; }
};

/// The simulated iteration.
struct SimulationResult {
  double makespan = 0;  ///< End of the last action on any stage.
  std::vector<StageTimeline> stages;

  /// Idle time of `stage` until the whole pipeline finishes: makespan - busy. The
  /// iteration's bubble when the optimizer step waits for every stage, as Megatron's does.
  double bubble(int stage) const { return makespan - stages.at(stage).busy; }

  /// bubble(stage) / makespan: the fraction of the iteration `stage` is idle (0 for an
  /// empty schedule). For 1F1B with equal stages this is (p-1)/(m+p-1); the (p-1)/m often
  /// quoted (Narayanan et al. 2021) divides by the busy time instead.
  double BubbleRatio(int stage) const { return makespan > 0 ? bubble(stage) / makespan : 0; }

  /// Idle time between the first start and the last end of `stage`: what remains of the
  /// bubble when the optimizer step is not synchronised across stages (Qi et al. 2024, §4)
  /// and the next iteration's forwards start on a stage as soon as it is done.
  double InternalBubble(int stage) const {
    const StageTimeline& timeline = stages.at(stage);
    return timeline.end() - timeline.start() - timeline.busy;
  }
};

/// `stage` split into `num_chunks` equal chunks: F, B and W divided by num_chunks, p2p
/// unchanged (a chunk sends the same activation). Throws std::invalid_argument for
/// num_chunks < 1.
ActionCosts ChunkCosts(const ActionCosts& stage, int num_chunks);

/// Simulates `schedule` with the same costs on every stage (with v > 1: for one action of
/// every chunk — a chunk of a v-chunk schedule of the same model costs 1/v of a stage's
/// action; see ChunkCosts). Throws std::invalid_argument
/// when ValidateSchedule rejects the schedule or a cost is negative or not finite.
SimulationResult Simulate(const Schedule& schedule, const ActionCosts& costs);

/// Simulates `schedule` with costs per stage or per virtual stage, e.g. measured ones of
/// unequal stages. With p = num_stages entries, stage_costs[s] is what one action of any
/// chunk of stage s costs (with v = 1: of stage s). With v > 1 and p·v entries,
/// stage_costs[k] is virtual stage k's (model order, VirtualStages): a chunk's F/B/W
/// cost follows its own layer range. A transfer costs the sending chunk's p2p; a
/// dependency between two chunks of one stage (ZB-V's turn) costs none. Throws
/// std::invalid_argument as above, or for any other number of entries.
SimulationResult Simulate(const Schedule& schedule, const std::vector<ActionCosts>& stage_costs);

}  // namespace fulcrum::pipeline
