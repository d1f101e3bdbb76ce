#include "dynamic/simulation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"
#include "dynamic/balancers.h"
#include "dynamic/load_model.h"
#include "dynamic/partition.h"
#include "dynamic/stage_costs.h"
#include "pipeline/measured_order.h"
#include "pipeline/schedule.h"

namespace fulcrum::dynamic {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status CheckCosts(const IterationCosts& costs, int64_t layers, int64_t iteration) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("scenario costs of iteration ", iteration, ": ", what));
  };
  if (costs.num_layers() != layers || static_cast<int64_t>(costs.backward.size()) != layers ||
      static_cast<int64_t>(costs.weight.size()) != layers) {
    return bad(absl::StrCat("forward/backward/weight have ", costs.forward.size(), "/",
                            costs.backward.size(), "/", costs.weight.size(),
                            " entries; expected ", layers, " (one per layer)"));
  }
  for (const std::vector<double>* v : {&costs.parameters, &costs.state_bytes, &costs.block_load}) {
    if (!v->empty() && static_cast<int64_t>(v->size()) != layers) {
      return bad(absl::StrCat("a per-layer vector has ", v->size(), " entries; expected ", layers,
                              " or none"));
    }
  }
  auto finite = [](double x) { return std::isfinite(x) && x >= 0; };
  for (int64_t l = 0; l < layers; ++l) {
    if (!finite(costs.forward[l]) || !finite(costs.backward[l]) || !finite(costs.weight[l])) {
      return bad(absl::StrCat("layer ", l, " has a negative or non-finite time"));
    }
  }
  return absl::OkStatus();
}

double At(const std::vector<double>& v, int64_t l) { return v.empty() ? 0.0 : v[l]; }

}  // namespace

std::vector<int> ChunkRanksOf(const pipeline::Schedule& schedule) {
  if (schedule.num_chunks <= 1) return {};
  std::vector<int> ranks;
  for (const pipeline::ChunkId& chunk : pipeline::VirtualStages(schedule)) {
    ranks.push_back(chunk.stage);
  }
  return ranks;
}

double NetworkOptions::P2pMs() const {
  if (p2p_bytes <= 0) return 0;
  return p2p_latency_us * 1e-3 + p2p_bytes / (p2p_bandwidth_gbps * 1e9) * 1e3;
}

double NetworkOptions::MigrationMs(double bytes) const {
  return migration_latency_us * 1e-3 + bytes / (migration_bandwidth_gbps * 1e9) * 1e3;
}

std::vector<Strategy> StandardStrategies() {
  return {
      {"uniform (Megatron)", "none", BalanceBy::kTime, false},
      {"params (DeepSpeed)", "none", BalanceBy::kParams, true},
      {"partition by time", "partition", BalanceBy::kTime, false},
      {"diffusion by time", "diffusion", BalanceBy::kTime, false},
      {"partition by params", "partition", BalanceBy::kParams, false},
      {"diffusion by params", "diffusion", BalanceBy::kParams, false},
  };
}

RepackProblem RepackProblemOf(const Scenario& scenario, const IterationCosts& costs) {
  RepackProblem problem;
  problem.layer_forward = costs.forward;
  problem.layer_backward = costs.backward;
  problem.layer_weight = costs.weight;
  problem.first_stage.forward = costs.first_forward;
  problem.first_stage.backward_input = costs.first_backward;
  problem.first_stage.backward_weight = costs.first_weight;
  problem.last_stage.forward = costs.last_forward;
  problem.last_stage.backward_input = costs.last_backward;
  problem.last_stage.backward_weight = costs.last_weight;
  problem.p2p = scenario.network.P2pMs();
  problem.layer_state_bytes = costs.state_bytes;
  problem.schedule = scenario.schedule;
  problem.num_microbatches = scenario.num_microbatches;
  problem.num_chunks = scenario.num_chunks;
  problem.measured_zbv_order = scenario.measured_zbv_order;
  problem.frozen_prefix = costs.frozen_prefix;
  return problem;
}

absl::StatusOr<std::vector<int>> RepackedStages(const Scenario& scenario, const SimulatedRun& run,
                                                const RepackOptions& options) {
  std::vector<int> stages;
  stages.reserve(run.iterations.size());
  std::vector<double> last_key;
  for (const SimulatedIteration& it : run.iterations) {
    const IterationCosts costs = scenario.costs(it.iteration);
    std::vector<double> key = costs.forward;
    key.insert(key.end(), costs.backward.begin(), costs.backward.end());
    key.insert(key.end(), costs.weight.begin(), costs.weight.end());
    for (const StageRange& r : it.placement) key.push_back(static_cast<double>(r.end));
    if (stages.empty() || key != last_key) {
      absl::StatusOr<RepackPlan> plan =
          DecideRepack(RepackProblemOf(scenario, costs), it.placement, options);
      if (!plan.ok()) return plan.status();
      // With chunks a placement has a range per virtual stage (NOTE [re-packing under chunks]).
      stages.push_back(RanksOf(static_cast<int>(plan->placement.size()),
                               ChunksPerRank(scenario.schedule, scenario.num_chunks)));
    } else {
      stages.push_back(stages.back());
    }
    last_key = std::move(key);
  }
  return stages;
}

std::vector<pipeline::ActionCosts> StageActionCosts(const IterationCosts& costs,
                                                    const Placement& placement, double p2p_ms) {
  pipeline::ActionCosts first, last;
  first.forward = costs.first_forward;
  first.backward_input = costs.first_backward;
  first.backward_weight = costs.first_weight;
  last.forward = costs.last_forward;
  last.backward_input = costs.last_backward;
  last.backward_weight = costs.last_weight;
  return PlacementStageCosts(costs.forward, costs.backward, costs.weight, first, last,
                             placement, p2p_ms);
}

namespace {

// Appends the per-layer values of the layers in `range` to `load`, as the runner reports
// them (NOTE [simulated loads]): times summed over the m micro-batches (zero when there is
// no timeline: unmeasured), a fused BW counted as B; parameters, block loads and state bytes
// per layer. Shared by the one-chunk and the chunked form of SimulatedLoads.
void AppendLayerLoads(const IterationCosts& costs, const StageRange& range, double m, bool fused,
                      bool measured, pipeline::StageLoad& load) {
  for (int64_t l = range.begin; l < range.end; ++l) {
    const double b = costs.backward[l] + (fused ? costs.weight[l] : 0.0);
    const double w = fused ? 0.0 : costs.weight[l];
    load.layer_forward_ms.push_back(measured ? m * costs.forward[l] : 0.0);
    load.layer_backward_ms.push_back(measured ? m * b : 0.0);
    load.layer_weight_ms.push_back(measured ? m * w : 0.0);
    load.layer_parameters.push_back(At(costs.parameters, l));
    load.layer_block_load.push_back(At(costs.block_load, l));
    load.layer_state_bytes.push_back(static_cast<int64_t>(At(costs.state_bytes, l)));
    load.parameter_bytes += static_cast<int64_t>(At(costs.state_bytes, l));
  }
}

// SimulatedLoads with chunks (NOTE [simulation under chunks]): rank r's load lists its
// chunks' ranges in chunk order (ascending virtual stage) and their layers' values in that
// order; its totals are its chunks' virtual-stage action costs summed.
std::vector<pipeline::StageLoad> SimulatedChunkLoads(const IterationCosts& costs,
                                                     const pipeline::Schedule& schedule,
                                                     const std::vector<int>& chunk_rank,
                                                     const Placement& ran_on,
                                                     const Placement& now,
                                                     const pipeline::SimulationResult* timeline) {
  const int p = schedule.num_stages;
  const double m = schedule.num_microbatches;
  const bool fused = !pipeline::UsesSplitBackward(schedule);
  const std::vector<pipeline::ActionCosts> ran = StageActionCosts(costs, ran_on, 0.0);
  std::vector<pipeline::StageLoad> loads(p);
  for (int r = 0; r < p; ++r) {
    loads[r].stage = r;
    loads[r].peak_in_flight = pipeline::PeakInFlight(schedule, r);
  }
  const int last = static_cast<int>(now.size()) - 1;
  for (int k = 0; k <= last; ++k) {
    pipeline::StageLoad& load = loads[chunk_rank[k]];
    load.chunk_ranges.emplace_back(now[k].begin, now[k].end);
    AppendLayerLoads(costs, now[k], m, fused, timeline != nullptr, load);
    if (k == 0) load.pinned_parameters += costs.first_parameters;
    if (k == last) load.pinned_parameters += costs.last_parameters;
    if (timeline != nullptr) {
      const pipeline::ActionCosts& c = ran[k];
      load.forward_ms += m * c.forward;
      load.backward_ms += m * (c.backward_input + (fused ? c.backward_weight : 0.0));
      load.weight_ms += fused ? 0.0 : m * c.backward_weight;
      // The chunk's own totals, as GatherLoads reports them (chunk order = model order).
      load.chunk_forward_ms.push_back(m * c.forward);
      load.chunk_backward_ms.push_back(m * (c.backward_input + (fused ? c.backward_weight : 0.0)));
      load.chunk_weight_ms.push_back(fused ? 0.0 : m * c.backward_weight);
    }
  }
  if (timeline != nullptr) {
    for (int r = 0; r < p; ++r) {
      loads[r].wait_ms = timeline->stages[r].idle;
      loads[r].total_ms = timeline->stages[r].end();
    }
  }
  return loads;
}

}  // namespace

std::vector<pipeline::StageLoad> SimulatedLoads(const IterationCosts& costs,
                                                const pipeline::Schedule& schedule,
                                                const Placement& ran_on, const Placement& now,
                                                const pipeline::SimulationResult* timeline) {
  const std::vector<int> chunk_rank = ChunkRanksOf(schedule);
  if (!chunk_rank.empty()) {
    return SimulatedChunkLoads(costs, schedule, chunk_rank, ran_on, now, timeline);
  }
  const int p = static_cast<int>(now.size());
  const double m = schedule.num_microbatches;
  const bool fused = !pipeline::UsesSplitBackward(schedule);
  std::vector<pipeline::ActionCosts> ran = StageActionCosts(costs, ran_on, 0.0);
  std::vector<pipeline::StageLoad> loads(p);
  for (int s = 0; s < p; ++s) {
    pipeline::StageLoad& load = loads[s];
    load.stage = s;
    load.layer_begin = now[s].begin;
    load.layer_end = now[s].end;
    load.peak_in_flight = pipeline::PeakInFlight(schedule, s);
    AppendLayerLoads(costs, now[s], m, fused, timeline != nullptr, load);
    load.pinned_parameters = (s == 0 ? costs.first_parameters : 0.0) +
                             (s == p - 1 ? costs.last_parameters : 0.0);
    if (timeline != nullptr) {
      const pipeline::ActionCosts& c = ran[s];
      load.forward_ms = m * c.forward;
      load.backward_ms = m * (c.backward_input + (fused ? c.backward_weight : 0.0));
      load.weight_ms = fused ? 0.0 : m * c.backward_weight;
      load.wait_ms = timeline->stages[s].idle;
      load.total_ms = timeline->stages[s].end();
    }
  }
  return loads;
}

namespace {

// Partition of `layer_cost` over `num_stages` (chunk_rank: BalanceProblem's) with `first`
// and `last` pinned to the ends: the one-off placements below.
absl::StatusOr<Placement> PinnedPartition(std::vector<double> layer_cost, double first,
                                          double last, int num_stages,
                                          const std::vector<int>& chunk_rank) {
  BalanceProblem problem;
  problem.num_stages = num_stages;
  problem.chunk_rank = chunk_rank;
  problem.layer_cost = std::move(layer_cost);
  problem.first_stage_cost = first;
  problem.last_stage_cost = last;
  return PartitionBalance(problem);
}

}  // namespace

absl::StatusOr<Placement> ParameterPlacement(const IterationCosts& costs, int num_stages,
                                             const std::vector<int>& chunk_rank) {
  std::vector<double> parameters = costs.parameters;
  if (parameters.empty()) parameters.assign(costs.num_layers(), 1.0);
  return PinnedPartition(std::move(parameters), costs.first_parameters, costs.last_parameters,
                         num_stages, chunk_rank);
}

// NOTE [oracle placement]
// The upper bound of S_bal (issue 25: T(best static) / T(best balanced) on the same dynamic
// costs): iteration i runs on the placement that minimises its own bottleneck stage, found
// with that iteration's true costs, with no migration time and no decision time. A balancer
// plans iteration i from iteration i-1's measurements (NOTE [simulated loads]) and pays for
// its moves; where the loads do not persist from one iteration to the next (MoE loads with
// low autocorrelation), the gap between the two is what no balancer acting on the past can
// close. The objective is the balancers' own (the bottleneck of F + B + W per stage, the
// pinned units included), not the simulated makespan: a placement with a smaller
// bottleneck can, rarely, fill or drain the pipeline a little longer.
Strategy OracleStrategy() {
  Strategy oracle;
  oracle.name = "oracle";
  oracle.oracle = true;
  return oracle;
}

absl::StatusOr<Placement> OraclePlacement(const IterationCosts& costs, int num_stages,
                                          const std::vector<int>& chunk_rank) {
  std::vector<double> work(costs.num_layers());
  for (int64_t l = 0; l < costs.num_layers(); ++l) {
    work[l] = costs.forward[l] + costs.backward[l] + costs.weight[l];
  }
  return PinnedPartition(std::move(work),
                         costs.first_forward + costs.first_backward + costs.first_weight,
                         costs.last_forward + costs.last_backward + costs.last_weight, num_stages,
                         chunk_rank);
}

absl::StatusOr<SimulatedRun> SimulateRun(const Scenario& scenario, const Strategy& strategy,
                                         const BalancerOptions& options) {
  if (!scenario.costs) return absl::InvalidArgumentError("scenario '" + scenario.name + "' has no costs");
  if (scenario.iterations < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--iterations=", scenario.iterations, " must be ≥ 1"));
  }
  absl::StatusOr<pipeline::Schedule> made = pipeline::MakeSchedule(
      scenario.schedule, scenario.num_stages, scenario.num_microbatches, scenario.num_chunks);
  if (!made.ok()) return made.status();
  pipeline::Schedule schedule = *std::move(made);
  // NOTE [ZB-V at measured costs]: rebuilt from the loads Plan(i) is handed, as the runner
  // rebuilds it from the loads it gathers.
  const bool measured_order = scenario.schedule == "zbv" && scenario.measured_zbv_order;
  pipeline::MeasuredVOrder order;
  std::map<int, pipeline::Schedule> v_built;  // order.Build's, by forward-only count.
  // NOTE [forward-only stages]: iteration i runs `schedule` with the stages that lie in its
  // frozen prefix forward only, as the runner makes it from the same ranges; under the
  // measured V, the order built for that prefix.
  auto schedule_on = [&](const IterationCosts& costs, const Placement& placement) {
    const int forward_only =
        pipeline::ForwardOnlyVirtualStages(ToLayerRanges(placement), costs.frozen_prefix);
    if (!measured_order) return pipeline::WithForwardOnlyPrefix(schedule, forward_only);
    auto it = v_built.find(forward_only);
    if (it == v_built.end()) {
      it = v_built
               .emplace(forward_only, order.Build(scenario.num_stages, scenario.num_microbatches,
                                                  forward_only))
               .first;
    }
    return it->second;
  };
  // NOTE [simulation under chunks]: placements have one range per virtual stage.
  const std::vector<int> chunk_rank = ChunkRanksOf(schedule);
  const int num_virtual = scenario.num_stages * std::max(schedule.num_chunks, 1);

  IterationCosts first = scenario.costs(1);
  const int64_t layers = first.num_layers();
  if (absl::Status s = CheckLayout(layers, scenario.num_stages, std::max(schedule.num_chunks, 1));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckCosts(first, layers, 1); !s.ok()) return s;

  BalancerOptions named = options;
  named.load.by = strategy.by;
  absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> rebalancer =
      MakeRebalancer(strategy.rebalancer, named);
  if (!rebalancer.ok()) return rebalancer.status();

  Placement current = UniformPlacement(layers, num_virtual);
  if (!scenario.initial_placement.empty()) {
    BalanceProblem shape;
    shape.num_stages = scenario.num_stages;
    shape.chunk_rank = chunk_rank;
    shape.layer_cost = first.forward;
    if (absl::Status s = ValidatePlacement(shape, scenario.initial_placement);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("scenario '", scenario.name,
                                                     "': initial placement: ", s.message()));
    }
    current = scenario.initial_placement;
  }
  if (strategy.params_initial) {
    absl::StatusOr<Placement> by_params =
        ParameterPlacement(first, scenario.num_stages, chunk_rank);
    if (!by_params.ok()) return by_params.status();
    current = *std::move(by_params);
  }

  SimulatedRun run;
  run.strategy = strategy.name;
  const double p2p_ms = scenario.network.P2pMs();
  IterationCosts previous;                 // Iteration i-1's costs.
  Placement previous_ran_on;               // ...and the placement it ran on.
  pipeline::Schedule previous_schedule;    // ...the schedule it ran (forward-only stages).
  pipeline::SimulationResult previous_timeline;
  for (int64_t i = 1; i <= scenario.iterations; ++i) {
    IterationCosts costs = i == 1 ? first : scenario.costs(i);
    if (absl::Status s = CheckCosts(costs, layers, i); !s.ok()) return s;

    if (strategy.oracle) {  // NOTE [oracle placement]: placed on its own costs, for free.
      absl::StatusOr<Placement> best = OraclePlacement(costs, scenario.num_stages, chunk_rank);
      if (!best.ok()) return best.status();
      current = *std::move(best);
    }
    // Plan(i) with what iteration i-1 measured (NOTE [simulated loads]).
    std::vector<pipeline::StageLoad> loads;
    if (strategy.oracle) {
      // No balancer: nothing to hand over, but the V's order is rebuilt from what the last
      // iteration measured, as for every other strategy.
      if (measured_order && i > 1) {
        loads = SimulatedLoads(previous, previous_schedule, previous_ran_on, current,
                               &previous_timeline);
      }
    } else if (i > 1 && !previous.recorded_loads.empty() &&
               previous.recorded_ran_on == previous_ran_on &&
               PlacementOf(previous.recorded_loads) == current) {
      loads = previous.recorded_loads;
    } else if (i > 1) {
      loads = SimulatedLoads(previous, previous_schedule, previous_ran_on, current,
                             &previous_timeline);
    } else {
      loads = SimulatedLoads(costs, schedule_on(costs, current), current, current, nullptr);
    }
    if (measured_order && order.Observe(loads, scenario.num_microbatches)) v_built.clear();
    const auto decide_start = Clock::now();
    pipeline::RebalanceDecision decision;
    if (!strategy.oracle) decision = (*rebalancer)->Plan(i, loads);
    if (!decision.error.ok()) return decision.error;  // As training ends on it.
    const double decision_ms =
        strategy.oracle ? 0.0
                        : std::chrono::duration<double, std::milli>(Clock::now() - decide_start)
                              .count();
    Placement next = current;
    if (!decision.target.empty()) {
      if (absl::Status s = pipeline::ValidateRanges(decision.target, layers, num_virtual);
          !s.ok()) {
        return absl::InternalError(absl::StrCat("iteration ", i, ": rebalancer '",
                                                strategy.rebalancer, "' planned an invalid placement: ",
                                                s.message()));
      }
      next = ToPlacement(decision.target);
    }

    // Iteration i runs on `current`; the moves happen in its backward tail.
    pipeline::Schedule ran = schedule_on(costs, current);
    const pipeline::SimulationResult timeline =
        pipeline::Simulate(ran, StageActionCosts(costs, current, p2p_ms));
    SimulatedIteration it;
    it.iteration = i;
    it.placement = current;
    it.next_placement = next;
    it.makespan_ms = timeline.makespan;
    it.decision_ms = decision_ms;
    it.note = decision.note;
    double bubble = 0;
    for (int s = 0; s < scenario.num_stages; ++s) {
      bubble += timeline.BubbleRatio(s);
      it.stage_busy_ms.push_back(timeline.stages[s].busy);
    }
    it.bubble_ratio = bubble / scenario.num_stages;
    std::vector<double> into_stage(scenario.num_stages, 0.0);
    for (const pipeline::PlannedMove& move :
         pipeline::MovesBetween(ToLayerRanges(current), ToLayerRanges(next), chunk_rank)) {
      ++it.layers_moved;
      if (move.local()) continue;  // Between two chunks of one rank: nothing is sent.
      const double bytes = At(costs.state_bytes, move.layer);
      it.bytes_migrated += bytes;
      into_stage[move.to_rank] += scenario.network.MigrationMs(bytes);
    }
    it.migration_ms = *std::max_element(into_stage.begin(), into_stage.end());
    it.iteration_ms = it.makespan_ms + it.migration_ms + scenario.step_ms;

    run.total_ms += it.iteration_ms;
    run.mean_bubble_ratio += it.bubble_ratio;
    run.layers_moved += it.layers_moved;
    run.bytes_migrated += it.bytes_migrated;
    run.migration_ms += it.migration_ms;
    run.decision_ms += it.decision_ms;
    run.iterations.push_back(std::move(it));

    if (costs.model_changed && !strategy.oracle) (*rebalancer)->OnModelChanged(i, costs.change_reason);
    previous_ran_on = current;
    previous_schedule = std::move(ran);
    previous_timeline = timeline;
    previous = std::move(costs);
    current = std::move(next);
  }
  run.mean_bubble_ratio /= static_cast<double>(run.iterations.size());
  return run;
}

}  // namespace fulcrum::dynamic
