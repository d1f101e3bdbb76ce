// The rebalancer hook: once per iteration, after the backward passes, the pipeline runner
// hands a Rebalancer what it measured on every stage and carries out the plan it returns —
// whole layers moving between neighbouring stages — before the optimizer step, so the
// step already runs on the new layout and the next iteration uses it (NOTE [layer
// migration] in core/gpt_model.h). Balancing algorithms (Partition, Diffusion,
// re-packing) implement this interface in dynamic/; this file has the two that exercise
// the mechanism: a no-op and a scripted one.
//
// Every rank of a pipeline calls Plan with the same inputs and must return the same plan;
// data-parallel replicas must too (a measured-cost balancer agrees on its inputs first).
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

/// What one stage measured in the last iteration.
struct StageLoad {
  int stage = 0;
  int64_t layer_begin = 0;               // The stage's layer range [begin, end).
  int64_t layer_end = 0;
  std::vector<double> layer_forward_ms;  // Per layer of the range, summed over micro-batches.
  double forward_ms = 0;                 // F actions (whole stage).
  double backward_ms = 0;                // B (or fused BW) actions.
  double weight_ms = 0;                  // W actions.
  double wait_ms = 0;                    // Blocked on neighbours.
  double total_ms = 0;
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
  /// The moves to make after iteration `iteration`'s backward, given every stage's load
  /// (indexed by stage). Moves are applied in order; each must move the first or last layer
  /// of a stage to the adjacent stage, leaving every stage at least one layer.
  virtual std::vector<LayerMove> Plan(int64_t iteration, const std::vector<StageLoad>& loads) = 0;
};

/// Never moves anything.
class NoOpRebalancer final : public Rebalancer {
 public:
  const char* name() const override { return "none"; }
  std::vector<LayerMove> Plan(int64_t, const std::vector<StageLoad>&) override { return {}; }
};

/// Moves layers at given iterations: "ITER:LAYER->STAGE[,LAYER->STAGE...][;ITER:...]",
/// e.g. "3:1->1;6:1->0" moves layer 1 to stage 1 after iteration 3 and back after 6.
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
