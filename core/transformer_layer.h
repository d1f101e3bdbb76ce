// The units of a GPT decoder (Megatron-core parameter names):
//   Embedding         "embedding": word_embeddings.weight [V, h], position_embeddings.weight [P, h]
//   TransformerLayer  "layers.<i>": pre-norm causal self-attention and GeLU MLP
//   Head              "head": final_layernorm.*, output_layer.weight (untied only)
// and, by ModelOptions, the Llama family's variants: RMSNorm (no norm biases), SwiGLU MLP,
// grouped-query attention, no linear biases (--disable_bias_linear). P is
// ModelOptions::position_rows(): --max_position_embeddings, or --seq_length when 0.
//
// NOTE [QKV rows]
// The fused QKV weight is [(heads + 2·G)·d, h] for G key/value heads (query groups), its
// rows grouped by key/value head: for g = 0..G−1, the d rows of each of the heads/G query
// heads of group g, then g's key rows, then g's value rows. Query head j uses key/value
// head j / (heads/G), as Hugging Face's repeat_kv does. With G = heads this is (head,
// {q, k, v}, d). A tensor-parallel shard is a contiguous block of whole groups, so G must be
// a multiple of tp, and the checkpoint holds the same tensor under every tp.
//
// NOTE [SwiGLU rows]
// Under --swiglu the MLP computes fc2(silu(gate) ⊙ up); fc1 holds both [2f, h], its rows
// interleaved: row 2j is gate row j, row 2j+1 up row j. Any contiguous shard of whole pairs
// then holds matching gate and up rows, so tensor parallelism slices fc1 as it does the GeLU
// MLP's and checkpoints stay layout-free (Megatron instead concatenates [gate; up] per
// rank, which ties the stored tensor to the tp size). MoE experts use the same layout.
//
// NOTE [layer load composition]
// Several plugins may say how much of a layer's work runs, and their effects are
// independent, so they multiply: Load() = base × the product of the fractions. The base is a
// plugin's absolute prediction (SetLoadReporter, at most one), else what the layer's blocks
// measured (an MoE block's expert rows, a sparse-attention core's score entries), else 1 —
// a fraction of the dense layer. Fractions are of two kinds: weights (pruning keeps 50% of
// the weights: half of each product's work) and tokens (Mixture-of-Depths computes 25% of
// the tokens). Mixture-of-Depths routing 25% of the tokens through weights pruned to 50% does
// 12.5% of the dense work. A block's measure counts only the tokens it was given (an MoE
// block under Mixture-of-Depths multiplies the routed rows only), so token fractions are
// not applied on top of it again; weight fractions always are. A layer no plugin speaks for
// reports its blocks' measure, 0 for a plain dense layer.
//
// Activations are [sequence, batch, hidden] like Megatron, so sequence parallelism can
// later split dimension 0 contiguously. With a tensor-parallel group each unit holds its
// shards (NOTE [tensor-parallel sharding]); the group pointer must outlive the unit.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/feed_forward.h"
#include "core/plugin.h"
#include "core/tensor_parallel.h"
#include "core/unit.h"

namespace fulcrum {

/// What a forward pass needs besides its input: training mode and the counters that key
/// dropout masks (NOTE [layout-independent randomness] in core/random.h).
struct ForwardContext {
  // The leading fields in order, as brace initialisation lists them (`{true, it, first,
  // scale}`); the rest keep their defaults.
  ForwardContext(bool training = true, int64_t iteration = 0, int64_t first_sample = 0,
                 double loss_scale = 0.0, at::Tensor token_positions = at::Tensor(),
                 int64_t epoch = 0)
      : training(training),
        iteration(iteration),
        first_sample(first_sample),
        loss_scale(loss_scale),
        token_positions(std::move(token_positions)),
        epoch(epoch) {}

  bool training = true;
  int64_t iteration = 0;     // Optimizer step being computed (1-based during training).
  int64_t first_sample = 0;  // Global index of the micro-batch's first sample.
  /// What the micro-batch's summed token loss is multiplied by before the backward pass
  /// (1 / tokens of the global batch). Layers that add a loss of their own (MoE auxiliary
  /// losses) scale its gradient by loss_scale × the micro-batch's tokens, so it counts as
  /// the mean over micro-batches whatever the layout. 0 outside training.
  double loss_scale = 0.0;
  /// [s, b] int64 in training: each input token's position in the training split
  /// (GptDataset: the same number names the same corpus token in every epoch), for blocks
  /// that remember tokens across epochs (the MoE assignment cache). Undefined otherwise.
  at::Tensor token_positions;
  /// Data epoch of the optimizer step's first sample (training).
  int64_t epoch = 0;
  /// [s, b] int64: each input token's label (the next token), on every stage whose model
  /// asks for them (GptModel::needs_labels: early-exit heads); undefined otherwise.
  at::Tensor labels;
  /// NOTE [carried token state]
  /// Per-token values [s, b] (float) that a plugin's layers set and read as the hidden
  /// states pass through them — early exit: the layer each token exited at, −1 while it is
  /// active — and that the pipeline sends beside the activation to the next stage when the
  /// model carries them (GptModel::carries_token_state). Mutable because layers receive the
  /// context as const; undefined until a layer sets it. One micro-batch's forward starts
  /// without it (GptModel::ForwardLoss, the stage executor). A layer sets a new tensor and
  /// never edits the one it received in place: a recomputed layer (NOTE [activation
  /// recomputation]) is given that one again.
  mutable at::Tensor token_state;
  /// [n, b] int64: each token's position in its sequence, for the rotary positions of hidden
  /// states [n, b, h] that are not the sequence's tokens 0..n−1 (Mixture-of-Depths' routed
  /// subset, ascending); undefined: 0..n−1.
  at::Tensor rotary_positions;
  /// True while a layer's forward runs a second time inside the backward pass (NOTE
  /// [activation recomputation]): a block must compute exactly what it computed the first
  /// time and record nothing again (measurements, counters, caches).
  bool recomputing = false;
};

// NOTE [activation recomputation]
// Megatron's full recomputation (--recompute_granularity=full; Chen et al. 2016, "Training
// Deep Nets with Sublinear Memory Cost"): a recomputed layer runs its forward without
// autograd, keeping only its input, and in the backward runs it again with autograd and
// back-propagates through that. What it keeps between F and B is one [s, b, h] tensor (its
// rows under sequence parallelism) instead of every intermediate (the activation meter
// measures it per layer, so the
// balancer's memory model sees the smaller footprint). The second forward draws the same
// dropout masks (they are keyed by global identity: NOTE [layout-independent randomness])
// and runs under the tag of the first (NOTE [weight-gradient tags]), so under the B/W split
// its weight gradients still wait for the W action, and gradients equal the plain layer's
// bit for bit. It costs one more forward of the layer in every backward. The second
// forward runs with ForwardContext::recomputing set, so blocks that measure in the forward
// (MoE loads, auxiliary-loss values) measure once; a plugin says it honours that with
// Plugin::SupportsRecompute, and the trainer refuses recomputation with any that does not.
//
// Selective recomputation (--recompute_granularity=selective; Korthikanti et al. 2022,
// §5): only the dense attention core — q·kᵀ, the causal softmax, the attention dropout and
// the product with v — keeps its inputs q, k, v alone and runs again in the backward. That
// is where the s×s tensors live when attention dropout is on (the probabilities and their
// masks, NOTE [attention core contract] in core/kernels/attention.h); without attention
// dropout the core is a flash kernel that keeps no s×s tensor, and selective saves little
// at the price of the core's forward. A plugin's attention core is not recomputed. Every
// layer is covered (recompute_num_layers is for full). Same masks, same bits as the plain
// layer; the core has no weights, so the B/W split is untouched.

class TransformerLayer;

/// `layer`'s forward of `hidden`, recomputed in the backward pass (NOTE [activation
/// recomputation]). Where nothing needs a gradient (no autograd, or `hidden` without one:
/// a frozen prefix) the plain forward.
at::Tensor RecomputedForward(const TransformerLayer& layer, const at::Tensor& hidden,
                             const ForwardContext& ctx);

/// The layer norm of options.normalization over x's last dimension: LayerNorm with weight and
/// bias, or RMSNorm with the weight (bias undefined).
at::Tensor Norm(const ModelOptions& options, const at::Tensor& x, const at::Tensor& weight,
                const at::Tensor& bias);
/// The MLP's nonlinearity applied to fc1's output [..., f] (GeLU, exact or tanh-approximate
/// with openai_gelu) or [..., 2f] (SwiGLU: NOTE [SwiGLU rows]) → [..., f].
at::Tensor MlpActivation(const ModelOptions& options, const at::Tensor& fc1_out);
/// Keys or values [b, G, s, d] → [b, G·per_group, s, d], each head repeated for the query
/// heads of its group (NOTE [QKV rows]); the tensor itself when per_group is 1.
at::Tensor ExpandGroups(const at::Tensor& kv, int64_t per_group);

/// The master dtype of the parameters: options.device_spec.master_dtype.
at::ScalarType ParamsScalarType(const ModelOptions& options);

/// Inverted dropout whose mask is a pure function of (seed, site, layer, ctx counters).
/// With `whole_rows` > x.size(0), x is rows [first_row, first_row + x.size(0)) of a
/// [whole_rows, ...] tensor (a sequence shard: NOTE [sequence parallelism]) and is dropped
/// by those rows of the whole tensor's mask.
at::Tensor Dropout(const at::Tensor& x, double p, uint64_t seed, std::string_view site,
                   int64_t layer, const ForwardContext& ctx, int64_t first_row = 0,
                   int64_t whole_rows = 0);

class Embedding : public Unit {
 public:
  explicit Embedding(const ModelOptions& options, TensorParallelGroup* tp = nullptr);
  /// tokens [b, s] (int64) → hidden [s, b, h] (replicated over the tensor-parallel group),
  /// or this rank's rows [s/tp, b, h] under sequence parallelism.
  at::Tensor Forward(const at::Tensor& tokens, const ForwardContext& ctx) const;
  /// This rank's rows of the word embeddings: [V/tp, h], starting at vocab_start().
  const at::Tensor& word_embeddings() const { return word_embeddings_; }
  int64_t vocab_start() const { return vocab_start_; }

 private:
  ModelOptions options_;
  TensorParallelGroup* tp_;
  TensorParallelRegions regions_;
  int64_t vocab_start_;
  at::Tensor word_embeddings_;
  at::Tensor position_embeddings_;  // Undefined with rotary positions.
};

/// The weights of a dense transformer layer whose product a plugin may replace
/// (TransformerLayer::SetLinear).
enum class LinearSlot : uint8_t { kQkv, kProj, kFc1, kFc2 };
inline constexpr int kNumLinearSlots = 4;
/// The weight's local parameter name, e.g. "self_attention.linear_qkv.weight".
const char* LinearSlotName(LinearSlot slot);

/// y = x·Wᵀ + b with W and b a layer's own parameters (b may be undefined): a replacement of
/// one of its products. It must give the gradients of the dense product (of the weights as
/// they are; e.g. masked) and honour the B/W split (core/linear.h NOTE [B/W split]).
using LinearImpl =
    std::function<at::Tensor(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias)>;

class TransformerLayer : public Unit {
 public:
  /// Parameters are initialised from the seed, or — with `initialize` false — left
  /// uninitialised, for a shell that receives a migrated layer's state. `customizer` (may
  /// be null; must outlive the layer) may replace the dense MLP and the attention core and
  /// edits the layer once built (core/plugin.h).
  TransformerLayer(const ModelOptions& options, int64_t layer_index,
                   TensorParallelGroup* tp = nullptr, bool initialize = true,
                   LayerCustomizer* customizer = nullptr);
  ~TransformerLayer() override;
  int64_t layer_index() const { return layer_index_; }
  /// The block replacing the dense MLP, or null.
  FeedForward* feed_forward() const { return feed_forward_.get(); }
  /// The attention core replacing softmax attention, or null.
  AttentionCore* attention_core() const { return attention_core_.get(); }

  /// Replaces the product of the weight in `slot` (a plugin's EditLayer: sparse compute of a
  /// pruned weight); an empty impl restores the dense product. The MLP slots exist only
  /// while no block replaces the MLP.
  void SetLinear(LinearSlot slot, LinearImpl impl);
  /// The weight of `slot` (undefined for the MLP slots of a layer whose MLP is replaced).
  const at::Tensor& weight(LinearSlot slot) const;
  /// The layer's measure of its work in the last step, for the balancers (StageLoad::
  /// layer_block_load) and the metrics file's layer_loads: its base (a plugin's reporter,
  /// else its MLP block's plus its attention core's measure) times the plugins' fractions
  /// (NOTE [layer load composition]); 0 for a plain dense layer.
  double Load() const;
  /// What a load fraction scales (NOTE [layer load composition]).
  enum class LoadFraction {
    kTokens,   ///< the share of the layer's tokens it computes (Mixture-of-Depths, early exit)
    kWeights,  ///< the share of its weights it multiplies (pruning)
  };
  /// Adds a plugin's fraction of the layer's dense work, in [0, 1], read at every Load().
  void AddLoadFraction(LoadFraction kind, std::function<double()> fraction) {
    load_fractions_.push_back({kind, std::move(fraction)});
  }
  /// Sets the layer's base load: a plugin's own absolute prediction (e.g. an average of
  /// something it measures), which replaces the blocks' measures. One per layer: a second
  /// reporter throws std::logic_error (fractions compose; two predictions of the same work
  /// would not).
  void SetLoadReporter(std::function<double()> reporter);

  /// Unit's, plus the block's step state under "<layer>.mlp.step_state.<name>".
  NamedTensors MigrationTensors() const override;
  absl::Status LoadMigrationTensors(const std::map<std::string, at::Tensor>& tensors) override;
  /// hidden [s, b, h] → [s, b, h]: the wrapper's (SetForwardWrapper) if one is set, else
  /// hidden + Residual(hidden) (computed as two residual additions). Under sequence
  /// parallelism s is this rank's rows of the sequence (NOTE [sequence parallelism]).
  at::Tensor Forward(const at::Tensor& hidden, const ForwardContext& ctx) const;
  /// What the layer adds to the residual stream, f(x) = attention + MLP: hidden [n, b, h]
  /// → [n, b, h] for any n, the n tokens of each sequence attending causally to each other
  /// (rotary positions: ctx.rotary_positions, else 0..n−1).
  at::Tensor Residual(const at::Tensor& hidden, const ForwardContext& ctx) const;
  /// Residual for some tokens only: f(x) of the tokens at `index` ([k, b] int64, each
  /// sequence's positions, ascending for speed; repeats allowed) → [k, b, h], where every
  /// token of `hidden` [s, b, h] still serves as a key and value — early exit's active tokens
  /// attending to the propagated states of the exited ones (CALM, Schuster et al. 2022,
  /// §3). The same function as Residual(hidden).gather(0, index), but the queries, the
  /// attention's output projection and the MLP run on the k tokens only (the query rows of
  /// the QKV weight on k tokens, its key and value rows on all s). Where that is not
  /// possible — a replaced attention core or QKV product, attention dropout in training —
  /// it computes Residual on all tokens and gathers. Rotary positions: the queries are
  /// rotated to their positions in `index`, the keys to 0..s−1.
  at::Tensor ResidualAt(const at::Tensor& hidden, const at::Tensor& index,
                        const ForwardContext& ctx) const;
  /// The plain layer, hidden + Residual(hidden), whatever wrapper is set (a wrapper that
  /// sometimes runs the whole layer calls it).
  at::Tensor PlainForward(const at::Tensor& hidden, const ForwardContext& ctx) const;
  /// Replaces how Forward applies the layer (a plugin's EditLayer: Mixture-of-Depths runs
  /// Residual on the routed tokens only). The wrapper gets the layer and Forward's
  /// arguments; an empty one restores the plain layer.
  using ForwardWrapper = std::function<at::Tensor(const TransformerLayer& layer,
                                                  const at::Tensor& hidden,
                                                  const ForwardContext& ctx)>;
  void SetForwardWrapper(ForwardWrapper wrapper) { forward_wrapper_ = std::move(wrapper); }
  /// The wrapper set so far (empty: none). Wrappers compose by hand: a plugin wrapping a
  /// layer that an earlier plugin (in --plugins order) wrapped keeps this one and calls it
  /// where it runs the whole layer (early exit around Mixture-of-Depths); a plugin that
  /// cannot do so refuses a layer already wrapped.
  const ForwardWrapper& forward_wrapper() const { return forward_wrapper_; }

 private:
  at::Tensor Attention(const at::Tensor& x, const ForwardContext& ctx) const;
  // Causal softmax attention of q [b, heads, s, d] and k, v [b, groups, s, d] (grouped:
  // kernels::AttentionCore) → [b, heads, s, d].
  at::Tensor SoftmaxAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const ForwardContext& ctx) const;
  // SoftmaxAttention recomputed in the backward (NOTE [activation recomputation]:
  // selective).
  at::Tensor RecomputedSoftmaxAttention(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const ForwardContext& ctx) const;
  friend struct RecomputedAttentionCore;
  at::Tensor Mlp(const at::Tensor& x, const ForwardContext& ctx) const;
  // x·Wᵀ + b through the slot's replacement, else the dense Linear (core/linear.h).
  at::Tensor Project(LinearSlot slot, const at::Tensor& x, const at::Tensor& w,
                     const at::Tensor& b) const;

  // Its dropout of x, this rank's rows of the residual stream (all of them without
  // sequence parallelism).
  at::Tensor DropoutRows(const at::Tensor& x, std::string_view site, const ForwardContext& ctx) const;

  ModelOptions options_;
  TensorParallelGroup* tp_;
  TensorParallelRegions regions_;  // NOTE [sequence parallelism]
  int64_t layer_index_;
  int64_t local_heads_;   // Attention heads on this rank: num_attention_heads / tp.
  int64_t local_groups_;  // Key/value heads on this rank: query_groups() / tp.
  at::Tensor ln1_weight_, ln1_bias_, qkv_weight_, qkv_bias_, proj_weight_, proj_bias_;
  at::Tensor ln2_weight_, ln2_bias_, fc1_weight_, fc1_bias_, fc2_weight_, fc2_bias_;
  std::unique_ptr<FeedForward> feed_forward_;  // Replaces the fc1/fc2 MLP when set.
  std::unique_ptr<AttentionCore> attention_core_;  // Replaces softmax attention when set.
  std::array<LinearImpl, kNumLinearSlots> linears_;
  std::function<double()> load_reporter_;
  std::vector<std::pair<LoadFraction, std::function<double()>>> load_fractions_;
  ForwardWrapper forward_wrapper_;
};

class Head : public Unit {
 public:
  /// With `mirror_word_embeddings` (a tied head on a stage without the embedding), the head
  /// keeps a mirror of the word embeddings, "word_embeddings_mirror.weight" (see
  /// Parameter::mirror_of), initialised like them.
  explicit Head(const ModelOptions& options, TensorParallelGroup* tp = nullptr,
                bool mirror_word_embeddings = false);
  /// hidden [s, b, h] (this rank's [s/tp, b, h] rows under sequence parallelism) → this
  /// rank's vocabulary columns of the whole sequence's logits, [s, b, V/tp].
  /// `word_embeddings` is the tied output weight shard (ignored when untied).
  at::Tensor Logits(const at::Tensor& hidden, const at::Tensor& word_embeddings) const;
  /// Per-token cross-entropy [s, b] of hidden [s, b, h] (this rank's rows under sequence
  /// parallelism: the logits are of the whole sequence) against labels [s, b].
  at::Tensor TokenLosses(const at::Tensor& hidden, const at::Tensor& word_embeddings,
                         const at::Tensor& labels) const;

 private:
  ModelOptions options_;
  TensorParallelGroup* tp_;
  TensorParallelRegions regions_;
  int64_t vocab_start_;
  at::Tensor ln_weight_, ln_bias_;
  at::Tensor output_weight_;  // Undefined when tied to an embedding on the same stage.
};

/// Applies rotary position embedding (RoFormer, Su et al. 2021, eq. 34; the "rotate half"
/// pairing of GPT-NeoX) to x [b, heads, s, d].
at::Tensor ApplyRotary(const at::Tensor& x, double base);
/// The same at given positions: x [b, heads, n, d], positions [b, n] int64. With positions
/// 0..n−1 it equals ApplyRotary bit for bit.
at::Tensor ApplyRotaryAt(const at::Tensor& x, const at::Tensor& positions, double base);

}  // namespace fulcrum
