// Dynamism plugins (DESIGN.md "Dynamism plugins"): what a plugin may do to the model and to
// each iteration, and the set of plugins a run uses. Implementations live in plugins/, one
// file each, found by name in a registry (plugins/plugin_registry.h); core/ knows only this
// interface.
//
// A plugin can:
//  - build parts of each transformer layer: its MLP (MakeFeedForward: the MoE layer), its
//    attention core (MakeAttentionCore: sparse attention), and edit the layer once built
//    (EditLayer): replace the products of its weights (TransformerLayer::SetLinear: sparse
//    compute of pruned weights), register per-layer state as the layer's buffers (they
//    travel with the layer when it migrates and are saved in checkpoints — invariant 2),
//    re-derive what depends on that state whenever it is loaded (Unit::OnStateLoaded), and
//    say how much of the layer's work runs (TransformerLayer::AddLoadFraction, SetLoadReporter;
//    NOTE [layer load composition]);
//  - act at fixed points of each iteration (BeforeIteration, AfterBackward — gradients
//    complete and reduced over data parallelism, before clipping, read and edited through
//    PluginContext::gradients() — and AfterOptimizerStep),
//    deciding over the whole distributed model through the PluginContext, and tell the
//    balancer that the model changed (PluginContext::ModelChanged);
//  - add fields to the metrics file and the log line;
//  - take part in the parallel layout through the ParallelContext it is given in OnLayout
//    (sums over a group, the communicators a library below it needs: NOTE [plugin doors] in
//    core/parallel_context.h) — never through parallel/ itself.
//
// NOTE [plugin order]
// Plugins run in the order --plugins names them, every hook in that order on every rank, so
// collective decisions inside hooks line up. At most one plugin may build a layer's MLP and
// one its attention core; EditLayer runs for every plugin, in order, after the layer's own
// parameters and the replaced blocks exist.
//
// Not thread-safe; hooks run on the training thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/feed_forward.h"
#include "core/optimizer/parameter_parts.h"
#include "core/rank_roles.h"

namespace fulcrum {

class GptModel;
class ParallelContext;
class TransformerLayer;
struct ForwardContext;

/// A layer's attention core: from queries, keys and values [b, heads, s, d] (this rank's
/// heads, rotary positions applied) to the context [b, heads, s, d], causal. By default
/// softmax attention over all earlier positions; a plugin may replace it.
class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  virtual at::Tensor Forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ForwardContext& ctx) = 0;
  /// The core's own measure of its work in the last forward (e.g. attention blocks
  /// computed), for the layer's load; 0 when it has none.
  virtual double Load() const { return 0.0; }
};

/// What builds a transformer layer's replaceable parts and edits the layer once built
/// (TransformerLayer's constructor calls it). `initialize` false: a shell that will receive
/// a migrated layer's state (parameters may stay uninitialised; buffers are overwritten).
class LayerCustomizer {
 public:
  virtual ~LayerCustomizer() = default;
  /// The block replacing layer `layer`'s dense MLP, or null to keep it. It registers its
  /// parameters and buffers into `unit` (local names beginning with "mlp.").
  virtual std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit& unit, bool initialize) {
    return nullptr;
  }
  /// The attention core of layer `layer`, or null for the default softmax attention.
  virtual std::unique_ptr<AttentionCore> MakeAttentionCore(int64_t layer, Unit& unit,
                                                           bool initialize) {
    return nullptr;
  }
  /// Edits the built layer (see the file comment).
  virtual void EditLayer(TransformerLayer& layer, bool initialize) {}
  /// Whether the layers read ForwardContext::labels (early-exit heads compute a loss): then
  /// every stage reads its micro-batches' labels.
  virtual bool NeedsLabels() const { return false; }
  /// Whether the layers set ForwardContext::token_state (NOTE [carried token state]): then
  /// the pipeline sends it beside each activation.
  virtual bool CarriesTokenState() const { return false; }
  /// What every token's state is before any layer set it (early exit: −1, "still active"):
  /// a stage whose layers left ForwardContext::token_state undefined sends this value.
  /// Asked only when CarriesTokenState().
  virtual double InitialTokenState() const { return 0.0; }
};

/// A LayerCustomizer that only replaces MLPs, from a FeedForwardFactory (core/feed_forward.h).
class FeedForwardCustomizer final : public LayerCustomizer {
 public:
  explicit FeedForwardCustomizer(FeedForwardFactory factory) : factory_(std::move(factory)) {}
  std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit& unit, bool initialize) override {
    return factory_ ? factory_(layer, unit, initialize) : nullptr;
  }

 private:
  FeedForwardFactory factory_;
};

/// What a plugin's hooks are given.
class PluginContext {
 public:
  /// `roles` are this rank's under `parallel` (default: the one-process job's).
  PluginContext(int64_t iteration, GptModel& model, ParallelContext* parallel,
                std::function<void(const std::string&)> model_changed, RankRoles roles = {})
      : iteration_(iteration),
        model_(model),
        parallel_(parallel),
        model_changed_(std::move(model_changed)),
        roles_(std::move(roles)) {}

  /// The optimizer step being computed (BeforeIteration, AfterBackward) or just taken
  /// (AfterOptimizerStep); after a checkpoint load, the checkpoint's iteration.
  int64_t iteration() const { return iteration_; }
  /// This rank's part of the model: its stage's layers, which move between iterations.
  GptModel& model() { return model_; }
  /// The parallel layout (null: one process), for collectives of a plugin's own.
  ParallelContext* parallel() { return parallel_; }
  /// Sums `values` over the ranks that hold different parts of one model replica — every
  /// stage and tensor-parallel shard (ParallelContext::SumOverModelParallel) — so that a
  /// decision over the whole distributed model is the same on every rank. Values of data-
  /// parallel replicas are not added (they hold the same model). Collective: every rank of
  /// the job calls it, in the same order.
  void SumOverModel(std::vector<double>& values);
  /// This rank's place among the ranks SumOverModel adds over, and their number (the same
  /// order on every replica): a canonical order of the model's parts, e.g. to break ties.
  int model_parallel_rank() const;
  int model_parallel_size() const;
  /// The same over the expert-parallel group (each rank holds other experts of each MoE
  /// layer); identity when ep == 1.
  void SumOverExperts(std::vector<double>& values);
  /// Whether this rank writes the job's log lines (one rank per job).
  bool is_logging_rank() const;
  /// Tells the balancer that the model changed after this iteration (pruned, froze...): it
  /// profiles the next iteration and rebalances after it. Every rank must call it alike.
  void ModelChanged(const std::string& reason) {
    if (model_changed_) model_changed_(reason);
  }
  /// In AfterBackward: this rank's parts of the reduced gradients (NOTE [reduced
  /// gradients] in core/optimizer/parameter_parts.h) — whole gradients under AdamW, the owned
  /// slices under the distributed optimizer. Read and edit gradients here, not through
  /// Parameter grads (which the distributed optimizer does not reduce), and the plugin runs
  /// under both. Anywhere else in a trainer's hooks it throws std::logic_error (Parameter
  /// grads are not the reduced gradients there, or already cleared). In a context a test
  /// built by hand (one process): the model's Parameter grads, whole, as they are at the
  /// first call.
  ReducedGradients& gradients();
  /// In AfterBackward: each layer's squared gradient norm over the whole model (indexed by
  /// layer, num_layers entries), summed as the global norm sums it — this rank's parts of
  /// the reduced gradients, over their holders, the experts' over the expert-parallel ranks
  /// (each holds other experts), tensor-parallel slices on every shard and replicas once,
  /// every stage — so every rank gets the same values. Collective over the job.
  std::vector<double> LayerGradientSquares();
  /// This rank's parts of the optimizer state of its model (Optimizer::StateParts):
  /// writable 1-D views, whole per parameter or the distributed optimizer's owned slices.
  /// Not collective. Call it from the hooks (between iterations or in AfterBackward), never
  /// from forward code: the distributed optimizer takes back state it gathered for moving
  /// layers. Without an optimizer (a context a test built): the Parameters' state.
  absl::StatusOr<std::vector<MomentSlice>> OptimizerStateParts();

  /// Set by the trainer: where the optimizer state is (which also marks the context as the
  /// trainer's), and the reduced gradients in AfterBackward.
  using StatePartsSource = std::function<absl::StatusOr<std::vector<MomentSlice>>()>;
  void set_optimizer_state_parts(StatePartsSource source) { state_parts_ = std::move(source); }
  void set_gradients(ReducedGradients* gradients) { gradients_ = gradients; }

 private:
  int64_t iteration_;
  GptModel& model_;
  ParallelContext* parallel_;
  std::function<void(const std::string&)> model_changed_;
  RankRoles roles_;
  ReducedGradients* gradients_ = nullptr;
  std::shared_ptr<ReducedGradients> own_gradients_;  // gradients() without the trainer's
  StatePartsSource state_parts_;
};

/// A dynamism plugin. Every method has a default that does nothing.
class Plugin : public LayerCustomizer {
 public:
  /// Its registered name (--plugins).
  virtual const char* name() const = 0;
  /// The parallel layout the next model is built under (null: one process). The Trainer
  /// calls it before it builds any model — in Trainer::Create and again in ChangeLayout, after
  /// a live shrink replaced every process group — so a plugin builds whatever depends on the
  /// groups (the MoE layers' expert exchange) here, and drops what it built for the old
  /// layout: the layers built afterwards must use only the new groups. Collective: every rank
  /// calls it, in plugin order. Until it is called a plugin assumes one process.
  virtual absl::Status OnLayout(ParallelContext* parallel) { return absl::OkStatus(); }
  /// Before the iteration's forward passes.
  virtual absl::Status BeforeIteration(PluginContext& ctx) { return absl::OkStatus(); }
  /// After the backward passes and the data-parallel reduction: the gradients are complete
  /// and equal on every replica; before the gradient norm, clipping and the optimizer step.
  /// Read or edit them through PluginContext::gradients(): under the distributed optimizer
  /// (core/optimizer/distributed_adamw.h) no rank holds them whole, and Parameter grads
  /// are not the reduced ones.
  virtual absl::Status AfterBackward(PluginContext& ctx) { return absl::OkStatus(); }
  /// True when the plugin's blocks honour ForwardContext::recomputing (record nothing and
  /// compute the same again): --recompute_granularity=full refuses a plugin that says false
  /// (NOTE [activation recomputation] in core/transformer_layer.h).
  virtual bool SupportsRecompute() const { return false; }
  /// True when the plugin reads or edits reduced gradients through Parameter grads, or
  /// the optimizer state through Parameter::optimizer_state, instead of through
  /// PluginContext::gradients() and OptimizerStateParts(): --use_distributed_optimizer
  /// refuses it (neither is there under that optimizer).
  virtual bool ReadsWholeGradients() const { return false; }
  /// True when the plugin works on sequence-parallel layers (NOTE [sequence parallelism] in
  /// core/tensor_parallel.h): between the tensor-parallel regions a layer holds only its
  /// rank's rows of the sequence; a feed-forward block still sees the whole sequence.
  /// --sequence_parallel refuses a plugin that says false.
  virtual bool SupportsSequenceParallel() const { return false; }
  /// After the optimizer step (and the MLP blocks' own AfterOptimizerStep).
  virtual absl::Status AfterOptimizerStep(PluginContext& ctx) { return absl::OkStatus(); }
  /// After a checkpoint was loaded into the model (its layers' states restored; their
  /// OnStateLoaded callbacks ran).
  virtual absl::Status AfterLoad(PluginContext& ctx) { return absl::OkStatus(); }
  /// Fields for this iteration's metrics record (after AfterOptimizerStep; collective:
  /// every rank calls it, only the logging rank's record is written) and text for its log
  /// line, e.g. " | sparsity 0.52".
  virtual absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) {
    return absl::OkStatus();
  }
  /// After an evaluation (Trainer::Evaluate; collective like Metrics): fields for the
  /// metrics record beside valid_loss and text for the validation log line, e.g. the
  /// average exit layer of early exit.
  virtual absl::Status AfterEvaluation(PluginContext& ctx, nlohmann::json* record,
                                       std::string* log_line) {
    return absl::OkStatus();
  }
  /// Settings of the plugin that decide the shape of the model's parameters or state, as
  /// (flag name, value): recorded in checkpoints; a resume with other values is refused
  /// naming the flag (NOTE [resume checks] in core/training_manifest.h).
  virtual std::vector<std::pair<std::string, std::string>> CheckpointShape() const { return {}; }
};

/// The plugins of a run, in order (NOTE [plugin order]). As a LayerCustomizer it builds
/// each layer through all of them.
class PluginSet final : public LayerCustomizer {
 public:
  PluginSet() = default;
  explicit PluginSet(std::vector<std::unique_ptr<Plugin>> plugins) : plugins_(std::move(plugins)) {}

  void Add(std::unique_ptr<Plugin> plugin) { plugins_.push_back(std::move(plugin)); }
  const std::vector<std::unique_ptr<Plugin>>& plugins() const { return plugins_; }
  bool empty() const { return plugins_.empty(); }
  /// "moe, freeze" (for logs).
  std::string Names() const;

  /// The plugins' blocks: at most one plugin may build a layer's MLP or attention core
  /// (a second throws std::logic_error naming both).
  std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit& unit, bool initialize) override;
  std::unique_ptr<AttentionCore> MakeAttentionCore(int64_t layer, Unit& unit, bool initialize) override;
  void EditLayer(TransformerLayer& layer, bool initialize) override;

  /// Each hook of every plugin, in order; the first error stops and is returned, naming
  /// the plugin.
  absl::Status OnLayout(ParallelContext* parallel);
  absl::Status BeforeIteration(PluginContext& ctx);
  absl::Status AfterBackward(PluginContext& ctx);
  absl::Status AfterOptimizerStep(PluginContext& ctx);
  absl::Status AfterLoad(PluginContext& ctx);
  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line);
  /// Whether any plugin's layers read labels / set the token state.
  bool NeedsLabels() const override;
  bool CarriesTokenState() const override;
  /// The initial token state of the first plugin that carries one (0 when none does).
  double InitialTokenState() const override;
  /// Every plugin's AfterEvaluation, in order.
  absl::Status AfterEvaluation(PluginContext& ctx, nlohmann::json* record, std::string* log_line);
  /// Every plugin's CheckpointShape, concatenated.
  std::vector<std::pair<std::string, std::string>> CheckpointShape() const;

 private:
  std::vector<std::unique_ptr<Plugin>> plugins_;
};

}  // namespace fulcrum
