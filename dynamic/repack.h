// Re-packing: when the work of a pipeline shrinks (pruning, freezing, early exit), put its
// layers on fewer stages and release the ranks that held the others (DESIGN.md
// "Re-packing"; DynMo (Wahib et al., SC'25) §3.4, Alg. 2).
//
// DynMo's Alg. 2 merges any pair of workers whose memory fits one GPU, first fit, which can
// break the pipeline's layer order. Here only *adjacent* stages merge, so a re-packed
// pipeline is a coarsening of the current one: each new stage is a run of consecutive old
// stages, its layers the union of theirs, and no layer changes order.
//
// NOTE [re-packing decision]
// A coarsening with q < p stages is admissible when
//   - q ≥ min_stages,
//   - every new stage fits the memory budget (its state, plus its per-micro-batch
//     activations times the micro-batches the q-stage schedule keeps in flight on it, plus
//     the embedding on the first and the head on the last stage), and
//   - its predicted iteration time is at most (1 + max_slowdown) × the predicted time of
//     the current placement. Both predictions come from the same model: the schedule
//     (pipeline/schedule.h) for q resp. p stages simulated (pipeline/schedule_simulator.h)
//     with each stage's F, B and W summed from the measured per-layer costs. With the
//     slowdown bounded, tokens/s per rank rises by about p/q.
// DecideRepack returns the admissible coarsening with the fewest stages, ties broken by the
// smaller predicted time, then by the lexicographically smaller stage ends; no repack when
// none is admissible. Up to kExhaustiveRepackStages current stages it tries every
// coarsening (2^(p-1)); above, for each stage count q (fewest first) it simulates the
// q-stage coarsening of least bottleneck (NOTE [re-packing by bottleneck] in repack.cc,
// a dynamic program), and also merges first fit: the leftmost adjacent pair whose merge is
// admissible, repeated until none is; the one with fewer stages (then the faster) wins.
// The result is admissible, not always the fewest stages.
//
// NOTE [re-packing under chunks]
// Re-packing refuses virtual pipeline stages (ZB-V, interleaved 1F1B: more than one model
// chunk per rank): a coarsening here is a run of consecutive one-chunk stages, while under
// chunks a rank's layers are several separate ranges and merging two ranks means merging
// chunk by chunk (for the V: ranks r and r+1 merge virtual r with r+1 and 2p−2−r with
// 2p−1−r, which is again a V; interleaved likewise per chunk) — not built yet. So
// CheckRepackSupported refuses the configuration up front, naming the flags, and
// DecideRepack / PredictIterationTime return FailedPrecondition for such a schedule.
//
// Pure functions; thread-safe.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::dynamic {

/// Current stage counts up to which DecideRepack searches every coarsening.
inline constexpr int kExhaustiveRepackStages = 12;

/// What the re-packing decision needs to know about the model, per layer and pinned.
struct RepackProblem {
  /// Per layer, milliseconds per micro-batch (any one time unit): F, B and W. For a fused
  /// schedule (1F1B) B holds the fused BW and W may be 0: the simulator adds them.
  std::vector<double> layer_forward;
  std::vector<double> layer_backward;
  std::vector<double> layer_weight;  ///< L entries or none (zeros).
  /// What the first stage runs besides its layers (the embedding), per micro-batch.
  pipeline::ActionCosts first_stage;
  /// What the last stage runs besides its layers (final norm, head, loss), per micro-batch.
  pipeline::ActionCosts last_stage;
  /// One activation or gradient transfer between neighbour stages. Default: 0.
  double p2p = 0;

  // Memory, in bytes; empty vectors mean zeros.
  std::vector<double> layer_state_bytes;       ///< L entries or none: weights, grads, Adam.
  std::vector<double> layer_activation_bytes;  ///< L entries or none: one micro-batch's.
  double first_stage_pinned_bytes = 0;         ///< Embedding state.
  double last_stage_pinned_bytes = 0;          ///< Head state (untied) and loss buffers.
  /// Default: unlimited (--rebalance_memory_budget_mb).
  double memory_budget = std::numeric_limits<double>::infinity();

  std::string schedule = "1f1b";  ///< --pipeline_schedule, regenerated for each stage count.
  int num_microbatches = 1;       ///< Per iteration and replica. Must be ≥ 1.
  /// --virtual_pipeline_model_parallel_size; anything but 1, or a schedule that sets its
  /// own chunks (zbv), is refused (NOTE [re-packing under chunks]).
  int num_chunks = 1;
  /// Layers [0, frozen_prefix) are frozen: each placement's stages that lie wholly inside
  /// run forward only (NOTE [forward-only stages] in pipeline/schedule.h), as training
  /// would run them — their time and memory predicted that way. Default: none.
  int64_t frozen_prefix = 0;

  int64_t num_layers() const { return static_cast<int64_t>(layer_forward.size()); }
};

/// --repack_min_stages and --repack_max_slowdown.
struct RepackOptions {
  /// Never pack onto fewer stages. Default: 1. Must be ≥ 1.
  int min_stages = 1;
  /// The largest allowed rise of the predicted iteration time, as a fraction of the
  /// current one. Default: 0.05. Must be ≥ 0 and finite.
  double max_slowdown = 0.05;
  /// Current stage counts up to which every coarsening is simulated; above, the
  /// least-bottleneck and first-fit candidates (NOTE [re-packing decision]). Default:
  /// kExhaustiveRepackStages (2^11 coarsenings at most). Tests lower it to compare the two.
  int exhaustive_up_to = kExhaustiveRepackStages;

  /// InvalidArgument naming the flag.
  absl::Status Validate() const;
};

/// What DecideRepack decided.
struct RepackPlan {
  bool repack = false;  ///< A coarsening was admissible; `placement` is it.
  Placement placement;  ///< The new stages (the current ones when !repack).
  double predicted_before = 0;  ///< Predicted iteration time of the current placement.
  double predicted_after = 0;   ///< Of `placement`.
  double peak_memory = 0;       ///< The largest stage memory of `placement`.
  int candidates = 0;           ///< Coarsenings evaluated.
  std::string note;             ///< One line for the log: what was decided and why.
};

/// OK when re-packing can run under --pipeline_schedule=`schedule` with `num_chunks` model
/// chunks per stage; InvalidArgument naming both flags when the schedule has more than one
/// chunk per rank (NOTE [re-packing under chunks]). An unknown schedule is not this
/// function's to report: OK.
absl::Status CheckRepackSupported(const std::string& schedule, int num_chunks);

/// OK, or InvalidArgument naming the field: per-layer vectors of different lengths, a
/// negative or non-finite cost or size, num_microbatches < 1.
absl::Status ValidateRepackProblem(const RepackProblem& problem);

/// The schedule's predicted iteration time (makespan) for `placement`, each stage's
/// action costs summed from its layers plus what is pinned to the first and last stage.
/// Errors: an invalid problem or placement, an unknown schedule.
absl::StatusOr<double> PredictIterationTime(const RepackProblem& problem,
                                            const Placement& placement);

/// Every stage's memory under `placement` (formula at NOTE [re-packing decision]).
absl::StatusOr<std::vector<double>> RepackStageMemory(const RepackProblem& problem,
                                                      const Placement& placement);

/// The re-packing decision for `current` (NOTE [re-packing decision]). Errors:
/// InvalidArgument for an invalid problem, placement or options.
absl::StatusOr<RepackPlan> DecideRepack(const RepackProblem& problem, const Placement& current,
                                        const RepackOptions& options);

/// `current` coarsened onto `num_stages` stages for --repack_script: consecutive old stages
/// grouped as evenly as possible (the first groups one stage more), e.g. 4 → 2: {0,1},{2,3}.
/// InvalidArgument unless 1 ≤ num_stages ≤ current.size().
absl::StatusOr<Placement> EvenCoarsening(const Placement& current, int num_stages);

}  // namespace fulcrum::dynamic
