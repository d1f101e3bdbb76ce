// The balancing rebalancer: the pipeline's rebalancer hook (pipeline/rebalancer.h) driven by
// the load model (load_model.h) and a balancer (partition.h or diffusion.h) — DESIGN.md
// "Dynamic load balancing", "Trigger".
//
// Every Plan feeds the measured loads to the load model; on a decision iteration (every
// --rebalance_interval iterations, and right after the start or a model change) the
// balancer proposes a placement from the smoothed costs, --rebalance_max_moves caps what it
// migrates (limit_moves.h), and the proposal is applied only if it lowers the predicted
// bottleneck by --rebalance_min_gain (NOTE [rebalance hysteresis]).
//
// NOTE [rebalance hysteresis]
// The balancers are exact about the costs they are given, and the costs are noisy: with
// equal layers, a measurement in which one layer looks 3% slower makes a different split
// "optimal" by a hair, and the next measurement makes the old one optimal again — layers
// would ping-pong between stages at a migration's cost each time. So a proposal is applied
// only when its predicted bottleneck is below the current placement's by at least min_gain
// of the current one, both judged under the same (smoothed) problem; otherwise the current
// placement is kept. With --rebalance_max_moves the gain is the whole proposal's, and the
// capped step towards it (limit_moves.h) is applied when it does not raise the bottleneck:
// judged on its own, a step that relieves one of two stages tied at the bottleneck gains
// nothing, and the placement would stall there for good. The one exception is memory: a
// current placement over the budget is left for one that fits, whatever the gain (the
// budget is what the user said a stage can hold).
// The gain is measured on what the algorithms even first: the bottleneck rank, except
// under chunks (ZB-V, interleaved), where both even the chunks (NOTE [partition under
// chunks] in partition.h, NOTE [diffusion under chunks] in diffusion.h); there the gain is
// the largest chunk's fall, or the bottleneck's when the largest chunk stays, and a step
// that raises the bottleneck rank is not applied. Judged on the bottleneck alone, its
// proposals could gain "−11%" while evening the chunks, and were applied only when the
// noise made the bottleneck fall too. Measured (fulcrum_sim --schedules --case=moe, ZB-V,
// 4 layers per stage, 100 iterations): judged on the bottleneck, 0.3% faster than the even
// split at 16 stages and 0.6% slower at 24; judged on what it optimises, 0.7% faster at 16
// and 0.04% at 24 (the migrations' 0.9 s of 147 s eat a 0.6% gain; the oracle's bound is
// 10%: these MoE loads change every iteration, so a placement fitted to the last ones
// predicts the next poorly).
//
// NOTE [rebalance events]
// Plan(i) gets the loads measured in iteration i-1 (NOTE [when the plan is made] in
// pipeline/rebalancer.h). OnModelChanged(i) says the model changed during iteration i, so
// the loads measured in iterations ≤ i are stale: the load model forgets its history, Plan
// ignores the loads it is given up to and including Plan(i+1), iteration i+1 profiles the
// changed model, and Plan(i+2) decides from that measurement whatever the interval
// (DynMo: "the first iteration after each dynamism operation is used for profiling"). The
// start of training counts as such an event: the first Plan whose model is ready decides
// (with --balance_by=time Plan(2), on iteration 1's times; with params Plan(1)). A forced
// decision that cannot be made yet (nothing measured) stays due until it can.
//
// NOTE [pinned time after a move]
// The loads at Plan(i) carry the ranges after iteration i-1's moves but stage totals of
// the placement iteration i-1 ran on (StageLoad). The rebalancer knows that placement — the
// ranges it was given at Plan(i-1) — and passes it to the load model (NOTE [pinned time] in
// load_model.h), so that a layer that just left a stage does not count as that stage's
// pinned time.
//
// Deterministic: no clock, no randomness; every rank given the same calls decides the same.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"
#include "dynamic/load_model.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

struct BalancerOptions {
  /// The balancer: "partition" (exact, fewest moves among the optimal placements) or
  /// "diffusion" (neighbour exchanges). Default: partition. --rebalancer.
  std::string algorithm = "partition";
  /// Cost measure, smoothing window, memory budget (--balance_by, --rebalance_window,
  /// --rebalance_memory_budget_mb).
  LoadModelOptions load;
  /// Decide every `interval` iterations (iterations divisible by it), and after events
  /// (NOTE [rebalance events]). Default: 1. Must be ≥ 1. --rebalance_interval.
  int interval = 1;
  /// Apply a proposal only if the predicted bottleneck falls by at least this fraction of
  /// the current one (NOTE [rebalance hysteresis]). Default: 0.05. Must be in [0, 1).
  /// --rebalance_min_gain.
  double min_gain = 0.05;
  /// At most this many layers migrate per decision (limit_moves.h). Default: 0 (no cap).
  /// Must be ≥ 0. --rebalance_max_moves.
  int64_t max_moves = 0;
  /// Diffusion's round limit (DiffusionOptions::max_rounds). Default: 32. Must be ≥ 1.
  /// --diffusion_max_rounds.
  int diffusion_max_rounds = 32;

  /// InvalidArgument naming the flag of the first bad field.
  absl::Status Validate() const;
};

/// OK when `num_layers` layers can be balanced over `num_stages` pipeline stages (each needs
/// at least one layer); InvalidArgument naming --pipeline_model_parallel_size otherwise. A
/// configuration error: main checks it before any work.
absl::Status CheckLayout(int64_t num_layers, int num_stages);
/// The same with `num_chunks` model chunks per stage (virtual pipeline stages): every one of
/// the num_stages · num_chunks chunks needs a layer; InvalidArgument naming
/// --virtual_pipeline_model_parallel_size when they cannot have one. num_chunks = 1 is
/// CheckLayout above.
absl::Status CheckLayout(int64_t num_layers, int num_stages, int num_chunks);

class BalancingRebalancer final : public pipeline::Rebalancer {
 public:
  /// `options` validated first (BalancerOptions::Validate).
  static absl::StatusOr<std::unique_ptr<BalancingRebalancer>> Create(BalancerOptions options);
  /// `options` must be valid.
  explicit BalancingRebalancer(BalancerOptions options);

  /// "partition" or "diffusion".
  const char* name() const override;
  /// See the file comment. A balancer error (no placement fits the memory budget, bad
  /// loads) keeps the current placement and says why in the note; it never fails training.
  pipeline::RebalanceDecision Plan(int64_t iteration,
                                   const std::vector<pipeline::StageLoad>& loads) override;
  /// NOTE [rebalance events].
  void OnModelChanged(int64_t iteration, const std::string& reason) override;
  /// Of the last Plan, when it considered a decision: "predicted_bottleneck" (of the
  /// placement chosen, in the decision's unit), "predicted_imbalance" (its ΔL) and
  /// "predicted_gain" (the proposal's fractional gain, applied or not); none otherwise.
  std::vector<std::pair<std::string, double>> Metrics() const override { return metrics_; }

  const BalancerOptions& options() const { return options_; }
  const LoadModel& load_model() const { return model_; }

 private:
  // The balancer's proposal for `problem` from `current`, capped by max_moves.
  absl::StatusOr<Placement> Propose(const BalanceProblem& problem, const Placement& current) const;
  // Whether gains are judged on the largest chunk first: under chunks (NOTE [rebalance
  // hysteresis]).
  bool JudgesLargestChunk(const BalanceProblem& problem) const;
  // The relative fall, from `from` to `to`, of what the algorithm minimises (> 0: better).
  double Gain(const BalanceProblem& problem, const Placement& from, const Placement& to) const;

  BalancerOptions options_;
  LoadModel model_;
  /// Loads measured in iterations ≤ this are stale (NOTE [rebalance events]).
  int64_t stale_through_ = std::numeric_limits<int64_t>::min();
  bool decision_due_ = true;  // A forced decision is pending (start, model change).
  std::string due_reason_;    // Why, for the note: "" at the start.
  int64_t last_plan_iteration_ = std::numeric_limits<int64_t>::min();
  Placement last_plan_ranges_;  // The ranges given to the last Plan.
  std::vector<std::pair<std::string, double>> metrics_;
};

}  // namespace fulcrum::dynamic
