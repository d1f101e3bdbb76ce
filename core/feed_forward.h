// The replaceable MLP of a transformer layer. By default a TransformerLayer computes the
// dense GeLU MLP itself; a FeedForwardFactory given to the GptModel may replace it in any
// layer it chooses — the MoE layer (moe/moe_layer.h) replaces every --moe_layer_freq-th
// one. core/ knows nothing of what the replacement does: it calls Forward, lets it register
// parameters and buffers into the layer's Unit (so they live, move and are checkpointed
// with the layer — invariant 2), and collects its per-iteration statistics.
//
// Not thread-safe; a FeedForward belongs to one layer on one stage.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fulcrum {

struct ForwardContext;
class Unit;

/// One per-step statistic of a block, already combined over the step's micro-batches and
/// the data-parallel replicas (each block documents how: sums of counts, token-weighted
/// means of losses).
struct BlockStatistic {
  std::string name;            // Metrics-file field, e.g. "expert_tokens", "z_loss".
  std::vector<double> values;
  /// Reported per layer, {"expert_tokens": {"layers.3": [...]}}; otherwise `values` has one
  /// element, summed over layers in the metrics file.
  bool per_layer = false;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;

  /// x [s, b, h], the layer-normed residual stream → [s, b, h], the block's contribution
  /// before the layer's dropout and residual add. Gradients flow as usual; a block that
  /// adds a loss of its own scales its gradient by ctx.loss_scale (see ForwardContext).
  virtual at::Tensor Forward(const at::Tensor& x, const ForwardContext& ctx) = 0;

  /// Called once per optimizer step, after it, on every rank in the same layer order
  /// (collective over the groups the block uses): update non-trained state from the
  /// step's measurements and make them the statistics Statistics() returns.
  virtual void AfterOptimizerStep() {}

  /// Whether Forward reads ForwardContext::token_positions in training (the trainer reads
  /// the corpus positions only for stages that hold such a block).
  virtual bool needs_token_positions() const { return false; }

  /// The last completed step's statistics (empty before the first).
  virtual std::vector<BlockStatistic> Statistics() const { return {}; }

  /// The measurements of the step in progress, which travel with the layer when it moves
  /// to another pipeline stage mid-step (after its last W, before the optimizer step), by
  /// local name. Not checkpointed: checkpoints are written between steps, when the next
  /// step has measured nothing yet. Values may arrive as fp32.
  virtual std::vector<std::pair<std::string, at::Tensor>> StepState() const { return {}; }
  /// Restores StepState() in the layer's new home.
  virtual void LoadStepState(const std::vector<std::pair<std::string, at::Tensor>>& state) {}

  /// The block's own measure of the work it did on this rank in the last completed step,
  /// for load balancing (DESIGN.md, "Load model": plugins may contribute a predicted load):
  /// for an MoE layer, the rows its local experts multiplied (capacity padding included),
  /// averaged over the data-parallel replicas so every replica sees the same value.
  /// 0 when the block has none.
  virtual double Load() const { return 0.0; }
};

/// Builds the block of layer `layer_index`, registering its parameters and buffers into
/// `layer` (Unit::AddParameter / AddBuffer, local names beginning with "mlp."). With
/// `initialize` false the parameters may stay uninitialised (a shell receiving a migrated
/// layer's state). Returns null to keep the dense MLP for this layer.
using FeedForwardFactory = std::function<std::unique_ptr<FeedForward>(
    int64_t layer_index, Unit& layer, bool initialize)>;

}  // namespace fulcrum
