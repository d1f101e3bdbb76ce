// The rebalancer hook: once per iteration the pipeline runner hands a Rebalancer what every
// stage measured and carries out the plan it returns — a new placement of the layers, each
// moving layer going straight from its old stage to its new one (NOTE [layer migration] in
// core/gpt_model.h). Balancing algorithms (Partition, Diffusion, re-packing) implement this
// interface in dynamic/; this file has the two that exercise the mechanism: a no-op and a
// scripted one. Pure C++ (no LibTorch): fulcrum_sim drives the same interface.
//
// NOTE [when the plan is made]
// The executor carries a plan out in the backward tail of the iteration it is made for (NOTE
// [early migration] in pipeline/stage_executor.h): a layer leaves its stage right after its
// last W, the neighbour adopts it before the optimizer step, so the step of that iteration
// already runs on the new layout. The plan must therefore exist before the iteration's
// backward tail; asking for it mid-iteration would put a collective (and a wait for the
// slowest stage) into the pipeline. So the runner asks at the *start* of iteration i, with
// the loads measured in iteration i-1 — the latest complete measurement — gathered over the
// pipeline and averaged over the replicas of each stage. Plan(i, loads) returns the
// placement of iteration i: ScriptedRebalancer's "at iteration i move layer l to stage s"
// means the move happens during iteration i's backward tail and iteration i's optimizer
// step sees it. Before the first iteration nothing is measured: the loads carry ranges and
// memory, and zero times.
//
// Every rank of a pipeline calls Plan with the same inputs and must return the same plan.
// Data-parallel (and tensor-parallel) replicas of a stage must apply the identical plan —
// their gradients are reduced unit by unit after the moves — so the runner averages the
// loads over those groups first, in rank order, and every replica sees the same bits. It
// then checks: every rank hashes its plan (PlanHash) and the hashes are compared over the
// pipeline and the replica groups; a mismatch is an error naming the ranks, never a silent
// divergence.
//
// NOTE [rebalancing under chunks]
// With virtual pipeline stages (v model chunks per rank, pipeline/schedule.h) a placement has
// one range per VIRTUAL stage, in model order (p·v entries); the rank that holds virtual
// stage k is VirtualStages(schedule)[k].stage. Every function below that takes LayerRanges
// works on virtual stages (ValidateRanges, ApplyMoves, MovesBetween, PlanHash); a StageLoad
// is still what one RANK measured, with its chunks' ranges in `chunk_ranges` and its
// per-layer values over those chunks' layers in chunk order (CurrentRanges and ChunkRanks
// rebuild the placement and the virtual → rank map from the loads). A layer moving between
// two virtual stages on one rank is local: PlannedMove::local(), no transfer. With v = 1
// everything is as it was: virtual stage k is rank k.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum::pipeline {

/// Each (virtual) stage's layer range [begin, end), in model order: a placement of the
/// layers (NOTE [rebalancing under chunks]).
using LayerRanges = std::vector<std::pair<int64_t, int64_t>>;

/// What one stage measured in the previous iteration (NOTE [when the plan is made]), on the
/// current layout: the range is what the stage holds now, per-layer values follow the layers
/// (a layer moved at the end of the last iteration brings the times measured where it ran),
/// and the stage totals are those of the stage as it ran. Times are milliseconds summed over
/// the micro-batches; replicas' values are averaged.
struct StageLoad {
  int stage = 0;
  int64_t layer_begin = 0;                // The stage's layer range [begin, end) (v = 1).
  int64_t layer_end = 0;
  /// With v > 1 chunks per rank (NOTE [rebalancing under chunks]): the rank's chunks' ranges
  /// [begin, end), in chunk order (chunk 0 first, which is also model order); then "the
  /// range" below means these ranges' layers, in this order, and layer_begin/layer_end are
  /// not read. Empty with one chunk per rank.
  std::vector<std::pair<int64_t, int64_t>> chunk_ranges;
  // Per layer of the range (NOTE [per-layer timing] in pipeline/stage_executor.h). The
  // sums are the stage's F, B and W minus the embedding, head and loss and the transfers.
  std::vector<double> layer_forward_ms;   // F.
  std::vector<double> layer_backward_ms;  // B, or the fused BW of 1F1B (then W is 0).
  std::vector<double> layer_weight_ms;    // W (deferred weight-gradient GEMMs).
  // The layer's own measure of its work (TransformerLayer::Load): its MLP block's (an MoE
  // layer: the rows its experts multiplied in the last completed step), or a plugin's
  // prediction; 0 for a dense layer (DESIGN.md "Load model": plugins contribute a load).
  std::vector<double> layer_block_load;
  /// Trainable parameters (scalars) of each layer of the range, as this rank holds them
  /// (its tensor-parallel shards; its experts): the static, DeepSpeed-style cost measure.
  std::vector<double> layer_parameters;
  /// Trainable parameters of the stage's other units (embedding, head — a tied output
  /// weight counted where its GEMM runs): the pinned part of the parameter measure.
  double pinned_parameters = 0;
  double forward_ms = 0;                  // F actions (whole stage, without waits).
  double backward_ms = 0;                 // B (or fused BW) actions.
  double weight_ms = 0;                   // W actions.
  double wait_ms = 0;                     // Blocked on neighbours inside the run.
  double total_ms = 0;                    // The stage's run, first action to last send.
  /// With chunks: each chunk's F, B (or fused BW) and W action time, in chunk order (as
  /// chunk_ranges), so that what is no layer's — the embedding, the head and the loss — can
  /// be told apart per chunk when one rank holds both ends of the model (ZB-V); a replay
  /// needs them (dynamic/trace_replay.h). Empty with one chunk per rank.
  std::vector<double> chunk_forward_ms;
  std::vector<double> chunk_backward_ms;
  std::vector<double> chunk_weight_ms;

  // Memory in bytes. State: what the units the stage holds now keep between iterations —
  // parameter values and buffers, one gradient per trainable parameter, and the two fp32
  // AdamW moments per trainable parameter (counted whether or not the first step has
  // allocated them yet).
  int64_t parameter_bytes = 0;
  int64_t gradient_bytes = 0;
  int64_t optimizer_bytes = 0;
  std::vector<int64_t> layer_state_bytes;  // Per layer of the range: the three summed.
  /// Measured: the most bytes the stage held for micro-batches in flight — saved
  /// activations between F and B, the weight-GEMM operands between B and W (NOTE
  /// [activation memory] in pipeline/stage_executor.h).
  int64_t peak_activation_bytes = 0;
  /// Measured, per layer of the range: the bytes one micro-batch's forward of the layer
  /// left allocated (what its backward will read), the largest over the micro-batches.
  std::vector<int64_t> layer_activation_bytes;
  /// The most micro-batches the schedule keeps in flight on this stage (PeakInFlight):
  /// what per-micro-batch activations are multiplied by.
  int64_t peak_in_flight = 0;

  int64_t state_bytes() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

/// What a rebalancer decided for one iteration.
struct RebalanceDecision {
  /// The placement to reach in this iteration's backward tail; empty: keep the current one.
  /// Every layer whose stage changes goes straight from its old stage to its new one (any
  /// distance), after its last W (NOTE [early migration] in pipeline/stage_executor.h).
  /// Must be a valid placement: contiguous ranges in stage order covering every layer, none
  /// empty.
  LayerRanges target;
  /// The load model's bottleneck (the most loaded stage's cost) of the current placement
  /// and of the one chosen (`target`, or the current one when it is kept), in `unit`; 0
  /// when the rebalancer has no load model (a script).
  double predicted_before = 0;
  double predicted_after = 0;
  std::string unit;  // "ms", "params".
  /// One line for the log: what was decided and why (empty: nothing to say).
  std::string note;
  /// Not OK when the caller asked for what no placement can give (a memory budget that no
  /// placement fits): the pipeline run fails with it, on every rank alike, and the run ends.
  absl::Status error;
};

class Rebalancer {
 public:
  virtual ~Rebalancer() = default;
  virtual const char* name() const = 0;
  /// The decision for iteration `iteration`, given every stage's load measured in the
  /// iteration before (indexed by stage; NOTE [when the plan is made]). Every rank calls it
  /// with the same arguments and must decide the same.
  virtual RebalanceDecision Plan(int64_t iteration, const std::vector<StageLoad>& loads) = 0;
  /// A dynamism changed the model in iteration `iteration` (a pruning or freezing step, an
  /// exit threshold...): measurements from before it are stale. A balancing rebalancer
  /// profiles the next iteration and then plans, whatever its interval (DESIGN.md,
  /// "Trigger"). Called on every rank with the same arguments, between iterations.
  virtual void OnModelChanged(int64_t iteration, const std::string& reason) {}
  /// Figures of the last Plan for the metrics file and the log, e.g.
  /// {"predicted_bottleneck_ms", 12.5}.
  virtual std::vector<std::pair<std::string, double>> Metrics() const { return {}; }
};

/// Never moves anything.
class NoOpRebalancer final : public Rebalancer {
 public:
  const char* name() const override { return "none"; }
  RebalanceDecision Plan(int64_t, const std::vector<StageLoad>&) override { return {}; }
};

/// One boundary layer moving to a neighbouring stage (a step of a --rebalance_script). With
/// chunks, stages here are virtual stages (NOTE [rebalancing under chunks]).
struct LayerMove {
  int64_t layer = 0;
  int to_stage = 0;
};

/// Placements given by a script, --rebalance_script: steps "ITER:WHAT" separated by ';'.
/// WHAT is either moves "LAYER->STAGE[,LAYER->STAGE...]", applied in order to the placement
/// the iteration starts with (each a boundary layer to a neighbouring stage: "3:1->1" moves
/// layer 1 to stage 1 in iteration 3, its optimizer step running on the new layout), or the
/// stages' layer counts "N0,N1,...", e.g. "5:1,1,1,5" — any placement, reached in one
/// iteration with layers moving over any distance.
class ScriptedRebalancer final : public Rebalancer {
 public:
  struct Step {
    std::vector<LayerMove> moves;  // Either moves...
    std::vector<int64_t> sizes;    // ...or layer counts per stage.
  };
  /// Parses `script`; InvalidArgument naming the bad part.
  static absl::StatusOr<std::unique_ptr<ScriptedRebalancer>> Parse(const std::string& script);
  const char* name() const override { return "script"; }
  RebalanceDecision Plan(int64_t iteration, const std::vector<StageLoad>& loads) override;
  /// The whole script, by iteration.
  const std::map<int64_t, Step>& steps() const { return steps_; }
  /// Plays the script through from `initial` (every step's placement, by iteration), so a
  /// step that cannot happen is refused before any work: FailedPrecondition naming the
  /// iteration and the step.
  absl::StatusOr<std::map<int64_t, LayerRanges>> Placements(const LayerRanges& initial) const;

 private:
  std::map<int64_t, Step> steps_;
};

/// The ranges after applying `moves` to `ranges` ([begin, end) per stage), or
/// FailedPrecondition naming the first move that is not a boundary layer going to an
/// adjacent stage or that would empty a stage.
absl::StatusOr<LayerRanges> ApplyMoves(LayerRanges ranges, const std::vector<LayerMove>& moves);

/// OK when `ranges` is a placement of `num_layers` layers over `num_stages` (virtual)
/// stages — p·v with chunks: contiguous, in model order, from 0 to num_layers, none empty.
/// InvalidArgument naming the stage otherwise.
absl::Status ValidateRanges(const LayerRanges& ranges, int64_t num_layers, int num_stages);

/// "[0,3) [3,8)", for logs.
std::string FormatRanges(const LayerRanges& ranges);

/// A layer changing stage between two placements.
struct PlannedMove {
  int64_t layer = 0;
  int from_stage = 0;  ///< The (virtual) stage it leaves: an index into the ranges.
  int to_stage = 0;    ///< The (virtual) stage it joins.
  int from_rank = 0;   ///< The rank that holds from_stage (= from_stage when v = 1).
  int to_rank = 0;     ///< The rank that holds to_stage.
  /// Both virtual stages on one rank: the layer changes chunk, nothing is sent.
  bool local() const { return from_rank == to_rank; }
  friend bool operator==(const PlannedMove& a, const PlannedMove& b) {
    return a.layer == b.layer && a.from_stage == b.from_stage && a.to_stage == b.to_stage &&
           a.from_rank == b.from_rank && a.to_rank == b.to_rank;
  }
};

/// Every layer whose (virtual) stage differs between `from` and `to` (both valid placements
/// of the same layers), in layer order. `stage_rank[k]`: the rank holding virtual stage k
/// (empty: rank k, v = 1).
std::vector<PlannedMove> MovesBetween(const LayerRanges& from, const LayerRanges& to,
                                      const std::vector<int>& stage_rank = {});

/// The layer ranges `load`'s per-layer vectors follow, in their order: its range, or with
/// chunks its chunks' ranges in chunk order (NOTE [rebalancing under chunks]).
LayerRanges HeldRanges(const StageLoad& load);
/// One past the last layer any of `loads` holds: the model's layer count for every stage's
/// load (0 for none).
int64_t NumLayersHeld(const std::vector<StageLoad>& loads);

/// The placement the loads describe, in model order: each load's range, or with chunks
/// every load's chunk_ranges sorted by where they begin (no check).
LayerRanges CurrentRanges(const std::vector<StageLoad>& loads);
/// The rank of each virtual stage of CurrentRanges(loads) (the `stage` of the load the
/// range came from); empty when no load has chunk_ranges (v = 1).
std::vector<int> ChunkRanks(const std::vector<StageLoad>& loads);

/// A 64-bit hash of (iteration, ranges), the same on every platform: replicas compare it to
/// check that they apply the same plan.
uint64_t PlanHash(int64_t iteration, const LayerRanges& ranges);

}  // namespace fulcrum::pipeline
