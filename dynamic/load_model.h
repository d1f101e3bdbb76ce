// The load model: turns what the pipeline measured (pipeline::StageLoad, one per stage, as
// the rebalancer hook receives them) into the BalanceProblem the balancers solve (DESIGN.md
// "Dynamic load balancing", "Load model").
//
// A layer's cost is its measured F+B+W time (--balance_by=time, the default) or its
// trainable parameter count (--balance_by=params, DeepSpeed's static measure; DynMo §5.1
// finds time better at all scales). What no layer owns is pinned: the embedding on the
// first stage, the final norm, LM head and loss on the last. Their time is the stage's
// measured F+B+W minus its layers' (NOTE [pinned time]); their parameters are reported.
// Memory is a constraint, not a load: per-layer state and activation bytes, and per stage
// what the pinned units and the schedule add (formula at BalanceProblem).
//
// NOTE [smoothed times]
// Times measured on a shared machine are noisy; a balancer fed raw times would chase the
// noise. So every per-layer time and every pinned time is the median of its last `window`
// observations (--rebalance_window; the mean of the two middle ones for an even count),
// which ignores a lone outlier (10, 100, 11 → 11) where a mean would not. Per-layer values
// are kept by global layer index, so a layer's history follows it from stage to stage. A
// StageLoad set whose times are all zero is not a measurement (the first iteration has
// run nothing yet) and adds no observation. Parameter counts are exact and change only with
// the model: params mode uses the latest ones, unsmoothed.
//
// NOTE [pinned time]
// The executor times each layer's F, B and W (NOTE [per-layer timing] in
// pipeline/stage_executor.h); the stage's totals also hold the embedding, the head and the
// loss. So stage 0's pinned time is its measured F+B+W minus the F+B+W of the layers it ran,
// and likewise the last stage's; with one stage both are that one residual, counted once
// (as first_stage_cost). A residual below zero (timer granularity) counts as 0. The totals
// are those of the stage *as it ran*, while the loads' ranges are where the layers are now
// (pipeline/rebalancer.h, StageLoad): after layers moved at the end of the measured
// iteration, the caller passes the placement the iteration ran on (`measured_on`), or the
// moved layers' times would be counted into the pinned cost of the stage they left. The same
// holds for the measured peak activation bytes.
//
// NOTE [load model under chunks]
// With chunks (StageLoad::chunk_ranges) the problem gets chunk_rank from the loads (the
// chunks sorted by where they begin), per-layer values follow each rank's chunks, a rank's
// pinned memory and pinned time subtract all its chunks' layers, and the pinned costs go to
// the rank holding the first virtual stage (embedding) and the one holding the last (head):
// with ZB-V both are rank 0, whose residual is counted once, as first_stage_cost — as with
// a single stage. A change of the chunk map forgets the history, like a change of p or L.
//
// Not thread-safe. Deterministic: equal inputs give bit-equal problems (every rank of a
// pipeline builds the same one).
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

/// What a layer's cost is (--balance_by).
enum class BalanceBy { kTime, kParams };

/// "time" / "params" → enum; InvalidArgument naming --balance_by otherwise.
absl::Status ParseBalanceBy(const std::string& text, BalanceBy* out);
/// "time" / "params".
const char* BalanceByName(BalanceBy by);
/// The unit of a cost under `by`: "ms" / "params" (RebalanceDecision::unit).
const char* BalanceUnit(BalanceBy by);

struct LoadModelOptions {
  BalanceBy by = BalanceBy::kTime;  // Default: time (F+B+W per layer). --balance_by.
  int window = 3;                   // Default: 3 iterations. Must be ≥ 1. --rebalance_window.
  /// Bytes a stage may hold (BalanceProblem::memory_budget). Default: +infinity (no limit).
  /// Must be > 0. --rebalance_memory_budget_mb, converted to bytes by the caller.
  double memory_budget_bytes = std::numeric_limits<double>::infinity();
  /// InvalidArgument naming the flag (--rebalance_window, --rebalance_memory_budget_mb).
  absl::Status Validate() const;
};

/// The placement of `ranges` (no check).
Placement ToPlacement(const pipeline::LayerRanges& ranges);
/// The ranges of `placement` (no check).
pipeline::LayerRanges ToLayerRanges(const Placement& placement);
/// The stages' current ranges in `loads`, in model order: one per virtual stage with
/// chunks (pipeline::CurrentRanges; no check).
Placement PlacementOf(const std::vector<pipeline::StageLoad>& loads);
/// The rank of each virtual stage of PlacementOf(loads) (BalanceProblem::chunk_rank);
/// empty with one chunk per rank.
std::vector<int> ChunkRanksOf(const std::vector<pipeline::StageLoad>& loads);

/// OK when `loads` can feed the load model: one per stage with `stage` == its index, ranges
/// forming a valid placement, every per-layer vector with one entry per layer of its range
/// or none (zeros: a simulator's loads may carry times only), every value finite and ≥ 0.
/// InvalidArgument naming the stage and the field otherwise.
absl::Status ValidateLoads(const std::vector<pipeline::StageLoad>& loads);

/// Per-layer and pinned costs smoothed over iterations (NOTE [smoothed times]).
class LoadModel {
 public:
  /// `options` must be valid (LoadModelOptions::Validate).
  explicit LoadModel(LoadModelOptions options = {});

  const LoadModelOptions& options() const { return options_; }

  /// Records one iteration's loads (a no-op for the times when they are all zero, NOTE
  /// [smoothed times]). `measured_on`: the placement the stage totals were measured on when
  /// it differs from the loads' ranges (NOTE [pinned time]); null: the loads' ranges.
  /// A change in the number of stages or layers forgets the history first (a different
  /// model). InvalidArgument (ValidateLoads, or a bad `measured_on`): nothing recorded.
  absl::Status Observe(const std::vector<pipeline::StageLoad>& loads,
                       const Placement* measured_on = nullptr);

  /// Forgets every observation (the model changed; its old times are stale).
  void Reset();

  /// Whether Problem() can be built: time — at least one measured iteration since the last
  /// Reset; params — always.
  bool ready() const;

  /// Measured iterations recorded since the last Reset.
  int64_t observations() const { return observations_; }

  /// The balance problem: num_stages from `latest`; layer costs and pinned costs (smoothed
  /// times, or `latest`'s parameter counts); memory from `latest`: layer_state_bytes and
  /// layer_activation_bytes per layer, activation_multiplier[s] = max(1, peak_in_flight),
  ///   pinned_memory[s] = (state_bytes() − Σ its layers' layer_state_bytes)
  ///                    + max(0, peak_activation_bytes − multiplier · Σ its layers'
  ///                                                      layer_activation_bytes)
  /// (each part at least 0; the activation part over the layers it ran, `measured_on`), and
  /// the options' memory budget. InvalidArgument for bad loads; FailedPrecondition when the
  /// model is not ready or `latest` has layers the history does not know.
  absl::StatusOr<BalanceProblem> Problem(const std::vector<pipeline::StageLoad>& latest,
                                         const Placement* measured_on = nullptr) const;

 private:
  // Appends `value` to `history`, keeping the last window_ values.
  void Push(std::deque<double>* history, double value) const;

  LoadModelOptions options_;
  int num_stages_ = 0;  // Of the last Observe; 0 before any.
  int64_t num_layers_ = 0;
  std::vector<int> chunk_rank_;  // Of the last Observe (ChunkRanksOf); empty: v = 1.
  std::vector<std::deque<double>> layer_time_;  // By global layer: F+B+W, last `window`.
  std::deque<double> first_stage_time_;         // Pinned on stage 0.
  std::deque<double> last_stage_time_;          // Pinned on stage p-1 (empty when p = 1).
  int64_t observations_ = 0;
};

}  // namespace fulcrum::dynamic
