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
//     the embedding on the first and the head on the last stage — under ZB-V both on rank
//     0, NOTE [re-packing under chunks]), and
//   - its predicted iteration time is at most (1 + max_slowdown) × the predicted time of
//     the current placement. Both predictions come from the same model: the schedule
//     (pipeline/schedule.h) for q resp. p stages simulated (pipeline/schedule_simulator.h)
//     with each stage's F, B and W summed from the measured per-layer costs. With the
//     slowdown bounded, tokens/s per rank rises by about p/q.
// DecideRepack returns the admissible coarsening with the fewest stages, ties broken by the
// smaller predicted time, then by the lexicographically smaller cuts (the old stages that
// end a group; with one chunk per stage the same as the smaller stage ends); no repack when
// none is admissible. Up to kExhaustiveRepackStages current stages it tries every
// coarsening (2^(p-1)); above, for each stage count q (fewest first) it simulates the
// q-stage coarsening of least bottleneck (NOTE [re-packing by bottleneck] in repack.cc,
// a dynamic program), and also merges first fit: the leftmost adjacent pair whose merge is
// admissible, repeated until none is; the one with fewer stages (then the faster) wins.
// The result is admissible, not always the fewest stages.
//
// NOTE [re-packing under chunks]
// With virtual pipeline stages (interleaved 1F1B, interleaved ZB-H1, ZB-V: v model chunks
// per rank) a placement has one range per VIRTUAL stage in model order (p·v ranges) and
// the schedule's layout says which rank holds each (pipeline/schedule.h VirtualStages).
// Re-packing still merges *adjacent ranks*: a coarsening groups ranks 0..p-1 into q runs
// of consecutive ranks, and the new rank g's chunk c is the union of chunk c of every rank
// in group g. That union is one contiguous range because both layouts number a chunk's
// ranks in model order: round-robin puts rank r's chunk c at virtual c·p + r, the V puts
// chunk 0 at r and chunk 1 at 2p−1−r (so merging ranks r..s merges virtual stages r..s and
// 2p−1−s..2p−1−r, which is again a V, with the turn on the new last rank). No layer
// changes order, the embedding and the head stay on the ranks of group 0 (V) resp. the
// first and last group (round-robin), and the surviving rank of each group is its first.
// A pipeline packed onto one rank runs one chunk: a single range, under the schedule's
// one-chunk form (OneStageScheduleName: zbv → zbh1).
// What is refused: a stage count the schedule cannot run — interleaved 1F1B and ZB-H1 need
// the micro-batches to be a multiple of the stages (m % q = 0) — is no candidate (the
// decision's note lists those counts and why; first fit steps over them); a coarsening onto
// q ≥ 2 ranks keeps v, so --num_layers_per_virtual_pipeline_stage is refused with
// re-packing (recipes/repack_flags.cc), and a relaunch onto one rank drops the chunks.
//
// NOTE [re-packing under the measured V]
// ZB-V's order in training is built at the measured chunk costs (--zbv_order=measured, the
// default; NOTE [ZB-V at measured costs] in pipeline/measured_order.h), and at B > F it is
// much faster than the unit-cost order. So with RepackProblem::measured_zbv_order each
// placement on q ≥ 2 ranks is predicted — time and memory — under the order the runner would
// build for it: of the greedy's orders at the mean chunk action on q ranks (the whole
// model's F, B and W over the 2q virtual stages, the same for every placement of q ranks)
// and the unit-cost V, the fastest on the placement's own stage costs — the runner's rule
// (pipeline::VOrderCandidates, FastestVOrder). A steady state: the runner keeps an order
// until the costs move past its hysteresis, and starts a re-packed run on the order built at
// the old costs.
//
// Pure functions; thread-safe.
#pragma once

#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"
#include "pipeline/schedule.h"
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
  /// --virtual_pipeline_model_parallel_size (ZB-V runs 2 whatever is asked): with v > 1
  /// chunks a placement on p ≥ 2 ranks has p·v ranges (NOTE [re-packing under chunks]).
  int num_chunks = 1;
  /// ZB-V only: predict under the order built at measured costs (NOTE [re-packing under the
  /// measured V]); false: the unit-cost order (--zbv_order=unit). Default: false.
  bool measured_zbv_order = false;
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

/// Model chunks per rank that --pipeline_schedule=`schedule` runs on two or more ranks
/// with --virtual_pipeline_model_parallel_size=`num_chunks` (ZB-V: 2 whatever is asked);
/// `num_chunks` for a schedule that cannot be made (its error is reported elsewhere).
int ChunksPerRank(const std::string& schedule, int num_chunks);

/// The ranks a placement of `num_ranges` ranges occupies with `chunks` per rank: one range
/// is one rank (NOTE [re-packing under chunks]), else num_ranges / chunks.
int RanksOf(int num_ranges, int chunks);

/// Rank and chunk of each virtual stage, in model order, when `num_ranks` ranks run
/// `schedule` with `num_chunks` chunks (NOTE [re-packing under chunks]): the schedule's
/// layout, or one range per rank when it runs one chunk (always on one rank). Errors: the
/// schedule cannot be made for num_ranks (its generator's reason).
absl::StatusOr<std::vector<pipeline::ChunkId>> RepackLayout(const std::string& schedule,
                                                           int num_ranks, int num_chunks);

/// `current` (laid out by RepackLayout(schedule, p, num_chunks)) coarsened onto q = cuts.size()
/// + 1 ranks: old ranks grouped at `cuts` (ascending ranks that end a group, the last rank
/// implied), new rank g's chunk c the union of chunk c of group g's ranks (NOTE [re-packing
/// under chunks]). With one chunk this is the old one-range-per-stage coarsening.
/// InvalidArgument for cuts out of order or a layout whose unions are not contiguous.
absl::StatusOr<Placement> CoarsenRanks(const Placement& current, const std::string& schedule,
                                       int num_chunks, const std::vector<int>& cuts);

/// OK, or InvalidArgument naming the field: per-layer vectors of different lengths, a
/// negative or non-finite cost or size, num_microbatches < 1.
absl::Status ValidateRepackProblem(const RepackProblem& problem);

/// The schedule's predicted iteration time (makespan) for `placement`, each stage's
/// action costs summed from its layers plus what is pinned to the first and last stage.
/// Errors: an invalid problem or placement, an unknown schedule.
absl::StatusOr<double> PredictIterationTime(const RepackProblem& problem,
                                            const Placement& placement);

/// Every rank's memory under `placement` (formula at NOTE [re-packing decision]; with
/// chunks a rank holds its chunks' state and PeakHeldBytes of their activations).
absl::StatusOr<std::vector<double>> RepackStageMemory(const RepackProblem& problem,
                                                      const Placement& placement);

/// The re-packing decision for `current` (NOTE [re-packing decision]). Errors:
/// InvalidArgument for an invalid problem, placement or options.
absl::StatusOr<RepackPlan> DecideRepack(const RepackProblem& problem, const Placement& current,
                                        const RepackOptions& options);

/// `current` coarsened onto `num_stages` ranks for --repack_script: consecutive old ranks
/// grouped as evenly as possible (the first groups one rank more), e.g. 4 → 2: {0,1},{2,3};
/// with chunks each group merges chunk by chunk (CoarsenRanks). InvalidArgument unless
/// 1 ≤ num_stages ≤ the ranks `current` occupies.
absl::StatusOr<Placement> EvenCoarsening(const Placement& current, int num_stages,
                                         const std::string& schedule = "1f1b",
                                         int num_chunks = 1);

}  // namespace fulcrum::dynamic
