// The scale simulator's core (fulcrum_sim, DESIGN.md "Scale"): runs a scenario — per-layer
// F/B/W costs per iteration, a pipeline size, a schedule — through the balancers training
// uses and the schedule simulator, iteration by iteration, and reports what each iteration
// would cost.
//
// It drives the real code paths, not copies: the placement of every iteration comes from a
// pipeline::Rebalancer made by MakeRebalancer (dynamic/balancers.h) — the same
// BalancingRebalancer, load model, hysteresis and trigger policy that fulcrum_train's
// pipeline runner calls — and the iteration's time from pipeline::Simulate on the
// registered schedule (pipeline/schedule_simulator.h). What the simulator adds is only what
// the runner gets from a real run: the StageLoads it hands the rebalancer (built here from
// the scenario's costs, NOTE [simulated loads]) and the cost of migrating layers.
//
// NOTE [simulated loads]
// The runner asks Plan(i) at the start of iteration i with what iteration i-1 measured
// (pipeline/rebalancer.h, NOTE [when the plan is made]); the moves happen in iteration i's
// backward tail, so iteration i still runs on the placement it started with. The simulator
// does the same: Plan(1) gets ranges and parameter counts with zero times, Plan(i) gets
// iteration i-1's per-layer times (summed over the micro-batches, as the executor reports
// them) on the ranges after i-1's moves, with the stage totals of the placement i-1 ran on
// (layers plus the pinned embedding / head). When the scenario carries the loads a live run
// recorded for that plan (a replayed trace) and the simulated placements are the ones the
// live run had, those recorded loads are handed over verbatim, so the replay reaches the
// live run's decisions bit for bit.
//
// NOTE [migration cost]
// A move sends the layer's state bytes (weights, gradients, optimizer state) from its old to
// its new stage in the backward tail. Transfers to different stages run concurrently, those
// into one stage one after another: migration time = max over receiving stages of
// Σ (latency + bytes / bandwidth). It is added to the iteration's time in full (the real
// executor overlaps part of it with the last W's), so the simulated overhead is an upper
// bound. Decision time is the wall-clock time of the real Plan() call, measured here.
//
// NOTE [simulation under chunks]
// With a schedule of v > 1 chunks per rank (interleaved 1F1B, ZB-V; Scenario::num_chunks, or
// the schedule's own, as ZB-V's 2) placements have one range per VIRTUAL stage in model
// order (start: the even split over p·v), each virtual stage's action costs follow its own
// range (StageActionCosts on the virtual placement, embedding on virtual 0, head on the
// last) and go to pipeline::Simulate per virtual stage; the loads handed to Plan() are per
// rank with the rank's chunk_ranges (pipeline/rebalancer.h), so the balancers balance
// ranks; a layer moving between two chunks of one rank is counted as moved but sends
// nothing. With v = 1 all of this is the one-chunk simulation, unchanged.
//
// Not thread-safe (a run owns its rebalancer); separate runs may go on in separate threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"
#include "dynamic/balancing_rebalancer.h"
#include "dynamic/repack.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::dynamic {

/// What every layer and the pinned units cost in one iteration. Times are ms per
/// micro-batch; a 1F1B schedule runs B + W as its fused BW.
struct IterationCosts {
  std::vector<double> forward;   ///< L entries: F of each layer.
  std::vector<double> backward;  ///< L entries: B (input gradient).
  std::vector<double> weight;    ///< L entries: W (weight gradient).
  /// The embedding and layers [0, frozen_prefix) are frozen front to back (NOTE [frozen
  /// prefix] in core/gpt_model.h): the virtual stages that lie wholly in them run forward
  /// only (NOTE [forward-only stages] in pipeline/schedule.h), as the runner has them.
  int64_t frozen_prefix = 0;
  double first_forward = 0, first_backward = 0, first_weight = 0;  ///< Embedding, stage 0.
  double last_forward = 0, last_backward = 0, last_weight = 0;     ///< Head + loss, stage p-1.
  std::vector<double> parameters;   ///< L entries or none: trainable parameters per layer.
  double first_parameters = 0;      ///< Embedding's.
  double last_parameters = 0;       ///< Final norm's and LM head's (0 when tied).
  std::vector<double> state_bytes;  ///< L entries or none: what a move sends.
  std::vector<double> block_load;   ///< L entries or none: plugin loads (reported only).
  /// A dynamism changed the model during this iteration (Rebalancer::OnModelChanged).
  bool model_changed = false;
  std::string change_reason;
  /// Replay (NOTE [simulated loads]): the loads a live run handed to Plan(i+1), and the
  /// placement iteration i ran on. Empty for synthetic scenarios.
  std::vector<pipeline::StageLoad> recorded_loads;
  Placement recorded_ran_on;

  int64_t num_layers() const { return static_cast<int64_t>(forward.size()); }
};

/// Point-to-point and migration links. Bandwidths in GB/s (1e9 bytes/s), latencies in µs.
struct NetworkOptions {
  double p2p_bytes = 0;              ///< One activation (or its gradient) between stages.
  double p2p_bandwidth_gbps = 25;    ///< Default: 25 GB/s.
  double p2p_latency_us = 10;        ///< Default: 10 µs.
  double migration_bandwidth_gbps = 25;
  double migration_latency_us = 10;

  /// ms of one activation transfer.
  double P2pMs() const;
  /// ms of migrating `bytes` in one transfer.
  double MigrationMs(double bytes) const;
};

/// A pipeline run to simulate.
struct Scenario {
  std::string name;
  std::string description;      ///< One line: where the costs come from.
  int num_stages = 2;           ///< p. Must be ≥ 1 and ≤ num_layers.
  int num_microbatches = 4;     ///< m per iteration.
  std::string schedule = "zbh1";
  /// Model chunks per stage (--virtual_pipeline_model_parallel_size): 1, or v > 1 for an
  /// interleaved schedule; ZB-V sets its own 2 (MakeSchedule). NOTE [simulation under chunks].
  int num_chunks = 1;
  /// Under zbv, the V's order from the measured chunk costs, rebuilt from each iteration's
  /// loads by the rule fulcrum_train follows (pipeline::MeasuredVOrder; NOTE [ZB-V at
  /// measured costs]); false: the unit-cost order throughout (--zbv_order=unit).
  bool measured_zbv_order = true;
  int64_t iterations = 10;      ///< Iterations 1..iterations.
  double tokens_per_iteration = 0;  ///< For tokens/s; 0: iterations/s only.
  /// The costs of iteration i (1-based). Must give the same layer count every iteration.
  std::function<IterationCosts(int64_t iteration)> costs;
  NetworkOptions network;
  /// Time outside the pipeline per iteration (optimizer step; ms). Default: 0.
  double step_ms = 0;
  /// Where iteration 1 starts; empty: Megatron's even split. A replayed trace starts where
  /// the live run started. Strategies that start parameter-balanced ignore it.
  Placement initial_placement;
};

/// A way of placing layers: a static baseline or a balancer.
struct Strategy {
  std::string name;            ///< "uniform", "params", "partition-time", ...
  std::string rebalancer = "none";  ///< A BalancerRegistry name.
  BalanceBy by = BalanceBy::kTime;
  bool params_initial = false;  ///< Start from DeepSpeed's parameter-balanced placement.
  /// NOTE [oracle placement]: every iteration on the placement Partition finds for that
  /// iteration's own costs, moved there for free. No balancer can do this (it knows an
  /// iteration's costs only after it ran, and moving costs time): the upper bound of what
  /// placing layers can give. `rebalancer` and `by` are not used.
  bool oracle = false;
  bool is_static() const { return rebalancer == "none" && !oracle; }
};

/// Megatron (uniform), DeepSpeed (params), then Partition and Diffusion by time and by
/// parameters: the six strategies the issue compares.
std::vector<Strategy> StandardStrategies();

/// NOTE [oracle placement]: the same-iteration optimum ("oracle").
Strategy OracleStrategy();

/// The placement minimising the bottleneck (virtual) stage of `costs` alone: Partition on
/// each layer's F + B + W, the embedding's and the head's pinned to the ends (NOTE [oracle
/// placement]). `chunk_rank` as ParameterPlacement's.
absl::StatusOr<Placement> OraclePlacement(const IterationCosts& costs, int num_stages,
                                          const std::vector<int>& chunk_rank = {});

/// One simulated iteration.
struct SimulatedIteration {
  int64_t iteration = 0;
  Placement placement;           ///< What the iteration ran on.
  Placement next_placement;      ///< After its moves (the next iteration's).
  double makespan_ms = 0;        ///< The pipeline's part (schedule simulator).
  double iteration_ms = 0;       ///< makespan + migration + step_ms.
  double bubble_ratio = 0;       ///< Mean over stages of SimulationResult::BubbleRatio.
  std::vector<double> stage_busy_ms;
  int64_t layers_moved = 0;
  double bytes_migrated = 0;
  double migration_ms = 0;       ///< NOTE [migration cost].
  double decision_ms = 0;        ///< Wall-clock time of the Plan() call.
  std::string note;              ///< The rebalancer's.
};

/// A whole simulated run of one strategy.
struct SimulatedRun {
  std::string strategy;
  std::vector<SimulatedIteration> iterations;
  double total_ms = 0;
  double mean_bubble_ratio = 0;
  int64_t layers_moved = 0;
  double bytes_migrated = 0;
  double migration_ms = 0;
  double decision_ms = 0;
  double iterations_per_second() const { return total_ms > 0 ? 1e3 * iterations.size() / total_ms : 0; }
};

/// Simulates `scenario` under `strategy`, with the balancer options `options` (interval,
/// min_gain, window...; `algorithm` and `load.by` come from the strategy). InvalidArgument
/// for a bad scenario (naming the field) or bad options.
absl::StatusOr<SimulatedRun> SimulateRun(const Scenario& scenario, const Strategy& strategy,
                                         const BalancerOptions& options);

/// The per-stage action costs of `costs` on `placement` (one per stage, or per virtual
/// stage: embedding on the first range, head on the last), with `p2p_ms` per transfer:
/// what pipeline::Simulate is given for one iteration.
std::vector<pipeline::ActionCosts> StageActionCosts(const IterationCosts& costs,
                                                    const Placement& placement, double p2p_ms);

/// The re-packing problem (dynamic/repack.h) of `costs` under `scenario`'s schedule,
/// micro-batches and links: per-layer F/B/W, the embedding and head pinned to the ends,
/// state bytes per layer; no activation bytes and no memory budget (a scenario has
/// neither), so only the predicted time limits a coarsening.
RepackProblem RepackProblemOf(const Scenario& scenario, const IterationCosts& costs);

/// The stages re-packing keeps in each iteration of `run`: fulcrum_train's --repack=auto
/// decision (DecideRepack) on RepackProblemOf(scenario, that iteration's costs) from the
/// placement the iteration ran on. One count per iteration; decided again only when the
/// costs or the placement changed. Errors: DecideRepack's.
absl::StatusOr<std::vector<int>> RepackedStages(const Scenario& scenario,
                                                const SimulatedRun& run,
                                                const RepackOptions& options);

/// The StageLoads the runner would hand Plan(): iteration costs `costs` measured on
/// `ran_on`, the layers now on `now` (NOTE [simulated loads]); `timeline` the simulated
/// iteration on `ran_on` (wait and total times), or null for unmeasured (zero) times.
std::vector<pipeline::StageLoad> SimulatedLoads(const IterationCosts& costs,
                                                const pipeline::Schedule& schedule,
                                                const Placement& ran_on, const Placement& now,
                                                const pipeline::SimulationResult* timeline);

/// DeepSpeed's parameter-balanced initial placement (Partition on parameter counts, the
/// embedding and head pinned): what fulcrum_train's --pipeline_initial_partition=params does.
/// `chunk_rank`: BalanceProblem::chunk_rank (empty: one chunk per stage).
absl::StatusOr<Placement> ParameterPlacement(const IterationCosts& costs, int num_stages,
                                             const std::vector<int>& chunk_rank = {});

/// The rank of each virtual stage of `schedule` (VirtualStages' stages): BalanceProblem's
/// chunk_rank; empty with one chunk per stage.
std::vector<int> ChunkRanksOf(const pipeline::Schedule& schedule);

}  // namespace fulcrum::dynamic
