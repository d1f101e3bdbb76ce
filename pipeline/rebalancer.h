// The rebalancer hook: once per iteration the pipeline runner hands a Rebalancer what every
// stage measured and carries out the plan it returns — whole layers moving between
// neighbouring stages (NOTE [layer migration] in core/gpt_model.h). Balancing algorithms
// (Partition, Diffusion, re-packing) implement this interface in dynamic/; this file has the
// two that exercise the mechanism: a no-op and a scripted one.
//
// NOTE [when the plan is made]
// The executor carries a plan out in the backward tail of the iteration it is made for (NOTE
// [early migration] in pipeline/stage_executor.h): a layer leaves its stage right after its
// last W, the neighbour adopts it before the optimizer step, so the step of that iteration
// already runs on the new layout. The plan must therefore exist before the iteration's
// backward tail; asking for it mid-iteration would put a collective (and a wait for the
// slowest stage) into the pipeline. So the runner asks at the *start* of iteration i, with
// the loads measured in iteration i-1 — the latest complete measurement — gathered over the
// pipeline and averaged over the replicas of each stage. Plan(i, loads) returns the moves of
// iteration i: ScriptedRebalancer's "at iteration i move layer l to stage s" means the
// move happens during iteration i's backward tail and iteration i's optimizer step sees it.
// Before the first iteration nothing is measured: the loads carry ranges and memory, and
// zero times.
//
// Every rank of a pipeline calls Plan with the same inputs and must return the same plan.
// Data-parallel (and tensor-parallel) replicas of a stage must apply the identical plan —
// their gradients are reduced unit by unit after the moves — so the runner averages the
// loads over those groups first, in rank order, and every replica sees the same bits.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace fulcrum::pipeline {

/// What one stage measured in the previous iteration (NOTE [when the plan is made]), on the
/// current layout: the range is what the stage holds now, per-layer values follow the layers
/// (a layer moved at the end of the last iteration brings the times measured where it ran),
/// and the stage totals are those of the stage as it ran. Times are milliseconds summed over
/// the micro-batches; replicas' values are averaged.
struct StageLoad {
  int stage = 0;
  int64_t layer_begin = 0;                // The stage's layer range [begin, end).
  int64_t layer_end = 0;
  // Per layer of the range (NOTE [per-layer timing] in pipeline/stage_executor.h). The
  // sums are the stage's F, B and W minus the embedding, head and loss and the transfers.
  std::vector<double> layer_forward_ms;   // F.
  std::vector<double> layer_backward_ms;  // B, or the fused BW of 1F1B (then W is 0).
  std::vector<double> layer_weight_ms;    // W (deferred weight-gradient GEMMs).
  // The layer's own measure of its work from its FeedForward block (core/feed_forward.h),
  // 0 for a dense layer: an MoE layer reports the rows its experts multiplied in the last
  // completed step (DESIGN.md "Load model": plugins contribute a predicted load).
  std::vector<double> layer_block_load;
  double forward_ms = 0;                  // F actions (whole stage, without waits).
  double backward_ms = 0;                 // B (or fused BW) actions.
  double weight_ms = 0;                   // W actions.
  double wait_ms = 0;                     // Blocked on neighbours inside the run.
  double total_ms = 0;                    // The stage's run, first action to last send.

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

  int64_t state_bytes() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
};

/// One boundary layer moving to the neighbouring stage.
struct LayerMove {
  int64_t layer = 0;
  int to_stage = 0;
};

class Rebalancer {
 public:
  virtual ~Rebalancer() = default;
  virtual const char* name() const = 0;
  /// The moves to make in iteration `iteration`'s backward tail, given every stage's load
  /// measured in the iteration before (indexed by stage; NOTE [when the plan is made]).
  /// Moves are applied in order; each must move the first or last layer of a stage to the
  /// adjacent stage, leaving every stage at least one layer.
  virtual std::vector<LayerMove> Plan(int64_t iteration, const std::vector<StageLoad>& loads) = 0;
};

/// Never moves anything.
class NoOpRebalancer final : public Rebalancer {
 public:
  const char* name() const override { return "none"; }
  std::vector<LayerMove> Plan(int64_t, const std::vector<StageLoad>&) override { return {}; }
};

/// Moves layers at given iterations: "ITER:LAYER->STAGE[,LAYER->STAGE...][;ITER:...]",
/// e.g. "3:1->1;6:1->0" moves layer 1 to stage 1 in iteration 3 (its optimizer step runs
/// on the new layout) and back in iteration 6.
class ScriptedRebalancer final : public Rebalancer {
 public:
  /// Parses `script` (--rebalance_script); InvalidArgument naming the bad part.
  static absl::StatusOr<std::unique_ptr<ScriptedRebalancer>> Parse(const std::string& script);
  const char* name() const override { return "script"; }
  std::vector<LayerMove> Plan(int64_t iteration, const std::vector<StageLoad>& loads) override;
  /// The whole script, by iteration.
  const std::map<int64_t, std::vector<LayerMove>>& moves() const { return moves_; }

 private:
  std::map<int64_t, std::vector<LayerMove>> moves_;
};

/// The ranges after applying `moves` to `ranges` ([begin, end) per stage), or
/// FailedPrecondition naming the first move that is not a boundary layer going to an
/// adjacent stage or that would empty a stage.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ApplyMoves(
    std::vector<std::pair<int64_t, int64_t>> ranges, const std::vector<LayerMove>& moves);

}  // namespace fulcrum::pipeline
