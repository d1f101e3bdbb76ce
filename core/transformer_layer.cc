#include "core/transformer_layer.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "absl/strings/str_cat.h"
#include "core/kernels/attention.h"
#include "core/linear.h"
#include "core/random.h"

namespace fulcrum {
namespace {

at::Tensor Zeros(at::IntArrayRef shape) { return at::zeros(shape, at::kFloat); }
at::Tensor Ones(at::IntArrayRef shape) { return at::ones(shape, at::kFloat); }

int TpRank(TensorParallelGroup* tp) { return tp ? tp->rank() : 0; }
int TpSize(TensorParallelGroup* tp) { return tp ? tp->size() : 1; }

// Marks the unit's replicated parameters that compute on sequence shards (NOTE [sequence
// parallelism]): their gradients are partial sums over the tensor-parallel group.
void MarkSequenceParallel(Unit& unit, const TensorParallelRegions& regions,
                          std::initializer_list<const char*> names) {
  if (!regions.sequence_parallel()) return;
  for (const char* name : names) {
    if (Parameter* p = unit.FindParameter(name)) p->sharding.sequence_parallel = true;
  }
}

// x + b, or x when the bias is absent (--disable_bias_linear). The (master) bias is cast
// to x's dtype where it is used (NOTE [mixed precision] in core/linear.h); a no-op when the
// dtypes agree.
at::Tensor AddBias(const at::Tensor& x, const at::Tensor& bias) {
  return bias.defined() ? x + bias.to(x.scalar_type()) : x;
}

}  // namespace

at::Tensor Norm(const ModelOptions& options, const at::Tensor& x, const at::Tensor& weight,
                const at::Tensor& bias) {
  const int64_t h = x.size(-1);
  // NOTE [mixed precision] in core/linear.h: the norms compute in the master dtype of their
  // weights (fp32 under --bf16, as Megatron's fused norms do) and hand back x's dtype.
  // Both casts are no-ops when x is already in the master dtype.
  const at::ScalarType out_dtype = x.scalar_type();
  const at::Tensor wide = x.to(weight.scalar_type());
  if (options.normalization == Normalization::kLayerNorm) {
    return at::layer_norm(wide, {h}, weight, bias, options.layernorm_epsilon).to(out_dtype);
  }
  return at::rms_norm(wide, {h}, weight, options.layernorm_epsilon).to(out_dtype);
}

at::Tensor MlpActivation(const ModelOptions& options, const at::Tensor& fc1_out) {
  if (options.swiglu) {
    // NOTE [SwiGLU rows]: gate and up rows alternate, so the last dimension is (f, 2).
    const at::Tensor pairs = fc1_out.unflatten(-1, {-1, 2});
    return at::silu(pairs.select(-1, 0)) * pairs.select(-1, 1);
  }
  return options.openai_gelu ? at::gelu(fc1_out, "tanh") : at::gelu(fc1_out);
}

at::Tensor Dropout(const at::Tensor& x, double p, uint64_t seed, std::string_view site,
                   int64_t layer, const ForwardContext& ctx, int64_t first_row,
                   int64_t whole_rows) {
  if (!ctx.training || p == 0.0) return x;
  at::Generator gen = MakeGenerator(seed, site, {layer, ctx.iteration, ctx.first_sample});
  std::vector<int64_t> shape = x.sizes().vec();
  const bool rows = whole_rows > x.size(0);
  if (rows) shape[0] = whole_rows;
  at::Tensor keep = at::empty(shape, x.options().requires_grad(false)).bernoulli_(1.0 - p, gen);
  // Its rows copied out (clone: a dimension-0 slice is contiguous already, and a view would
  // keep the whole mask alive for the backward).
  if (rows) keep = keep.narrow(0, first_row, x.size(0)).clone(at::MemoryFormat::Contiguous);
  return x * keep.div_(1.0 - p);
}

namespace {

// x rotated by `angles` [..., n, d] (broadcast over x [b, heads, n, d]).
at::Tensor Rotate(const at::Tensor& x, at::Tensor angles) {
  const int64_t d = x.size(3);
  angles = at::cat({angles, angles}, -1).to(x.scalar_type());
  at::Tensor cos = angles.cos();
  at::Tensor sin = angles.sin();
  at::Tensor x1 = x.narrow(-1, 0, d / 2);
  at::Tensor x2 = x.narrow(-1, d / 2, d / 2);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

at::Tensor InverseFrequencies(int64_t d, double base, c10::Device device) {
  return at::pow(base, -at::arange(0, d, 2, at::TensorOptions().dtype(at::kDouble).device(device)) /
                           static_cast<double>(d));  // [d/2]
}

}  // namespace

at::Tensor ApplyRotary(const at::Tensor& x, double base) {
  const int64_t s = x.size(2);
  return Rotate(x, at::outer(at::arange(s, at::TensorOptions().dtype(at::kDouble).device(x.device())),
                             InverseFrequencies(x.size(3), base, x.device())));
}

at::Tensor ApplyRotaryAt(const at::Tensor& x, const at::Tensor& positions, double base) {
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == x.size(0) && positions.size(1) == x.size(2),
              "rotary positions must be [", x.size(0), ", ", x.size(2), "], got ", positions.sizes());
  const at::Tensor angles = positions.to(at::kDouble).unsqueeze(-1) *
                            InverseFrequencies(x.size(3), base, x.device());  // [b, n, d/2]
  return Rotate(x, angles.unsqueeze(1));
}

at::Tensor ExpandGroups(const at::Tensor& kv, int64_t per_group) {
  return per_group == 1 ? kv : kv.repeat_interleave(per_group, 1);
}

at::ScalarType ParamsScalarType(const ModelOptions& options) {
  return options.device_spec.master_dtype;
}

// ---------------------------------------------------------------------------------------
Embedding::Embedding(const ModelOptions& options, TensorParallelGroup* tp)
    : Unit("embedding", TpRank(tp), TpSize(tp)),
      options_(options),
      tp_(tp),
      regions_(tp, options.sequence_parallel),
      vocab_start_(TpRank(tp) * (options.vocab_size / TpSize(tp))) {
  set_params_dtype(ParamsScalarType(options), options.device_spec.device);
  const int64_t h = options.hidden_size;
  // Vocab-parallel: each rank keeps a contiguous block of rows.
  word_embeddings_ = AddParameter(
      "word_embeddings.weight",
      ShardOf(NormalInit(options.seed, GlobalName("word_embeddings.weight"),
                         {options.vocab_size, h}, options.init_method_std),
              0, tp_rank(), tp_size()),
      /*weight_decay=*/true, /*tp_shard_dim=*/0);
  if (options.position_embedding == PositionEmbedding::kLearned) {
    position_embeddings_ = AddParameter(
        "position_embeddings.weight",
        NormalInit(options.seed, GlobalName("position_embeddings.weight"),
                   {options.position_rows(), h}, options.init_method_std),
        /*weight_decay=*/true);
  }
  MarkSequenceParallel(*this, regions_, {"position_embeddings.weight"});
}

at::Tensor Embedding::Forward(const at::Tensor& tokens, const ForwardContext& ctx) const {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be [batch, sequence], got ", tokens.sizes());
  const int64_t s = tokens.size(1);
  TORCH_CHECK(s <= options_.seq_length, "sequence of ", s, " tokens exceeds seq_length ",
              options_.seq_length);  // ≤ position_rows() (ModelOptions::Validate)
  // Batches arrive from the CPU data loader; they move to the spec's device here, at the
  // model's entry (a no-op on cpu).
  at::Tensor ids = tokens.t().to(word_embeddings_.device());  // [s, b]
  at::Tensor hidden;
  if (tp_size() == 1) {
    hidden = at::embedding(word_embeddings_, ids);  // [s, b, h]
  } else {
    // Tokens outside this rank's rows look up row 0 and are zeroed; the sum over ranks then
    // holds every token's embedding exactly once.
    const int64_t rows = word_embeddings_.size(0);
    at::Tensor outside = (ids < vocab_start_).logical_or_(ids >= vocab_start_ + rows);
    at::Tensor local = (ids - vocab_start_).masked_fill_(outside, 0);
    hidden = at::embedding(word_embeddings_, local).masked_fill(outside.unsqueeze(-1), 0.0);
    // The sum over ranks: whole on every rank, or each rank's sequence rows (NOTE
    // [sequence parallelism]).
    hidden = regions_.LeaveRowParallel(hidden);
  }
  const auto [first_row, rows] = regions_.SequenceRows(s);
  if (position_embeddings_.defined()) {
    hidden = hidden + position_embeddings_.narrow(0, first_row, rows).unsqueeze(1);
  }
  // The residual stream carries the compute dtype (bf16 under --bf16); the lookup itself
  // reads the master rows, so its backward scatters fp32 gradients.
  hidden = hidden.to(options_.device_spec.compute_dtype);
  return Dropout(hidden, options_.hidden_dropout, options_.seed, "embedding_dropout", -1, ctx,
                 first_row, s);
}

// ---------------------------------------------------------------------------------------
TransformerLayer::TransformerLayer(const ModelOptions& options, int64_t layer_index,
                                   TensorParallelGroup* tp, bool initialize,
                                   LayerCustomizer* customizer)
    : Unit(absl::StrCat("layers.", layer_index), TpRank(tp), TpSize(tp)),
      options_(options),
      tp_(tp),
      regions_(tp, options.sequence_parallel),
      layer_index_(layer_index),
      local_heads_(options.num_attention_heads / TpSize(tp)),
      local_groups_(options.query_groups() / TpSize(tp)) {
  set_params_dtype(ParamsScalarType(options), options.device_spec.device);
  const int64_t h = options.hidden_size;
  const int64_t f = options.ffn_hidden_size;
  const double std = options.init_method_std;
  // Output projections feed the residual stream: scaled init (GPT-2 / Megatron).
  const double out_std = std / std::sqrt(2.0 * options.num_layers);
  const int r = tp_rank();
  const int n = tp_size();
  // Full initial value from the seed, then this rank's shard (NOTE [tensor-parallel sharding]).
  // A shell skips the random draws: its state arrives by migration.
  auto shell = [&](at::IntArrayRef shape, int64_t shard_dim) {
    std::vector<int64_t> local = shape.vec();
    if (shard_dim >= 0) local[shard_dim] /= n;
    return at::empty(local, at::kFloat);  // AddParameter moves it to the spec's dtype/device
  };
  auto weight = [&](const char* name, at::IntArrayRef shape, double s, int64_t shard_dim) {
    at::Tensor init = initialize ? ShardOf(NormalInit(options.seed, GlobalName(name), shape, s),
                                           shard_dim, r, n)
                                 : shell(shape, shard_dim);
    return AddParameter(name, init, /*weight_decay=*/true, shard_dim);
  };
  auto constant = [&](const char* name, at::Tensor full, int64_t shard_dim) {
    at::Tensor init = initialize ? ShardOf(full, shard_dim, r, n) : shell(full.sizes(), shard_dim);
    return AddParameter(name, init, /*weight_decay=*/false, shard_dim);
  };
  const bool norm_bias = options.normalization == Normalization::kLayerNorm;
  const bool bias = options.add_bias_linear;
  const int64_t qkv_rows = options.qkv_rows();
  ln1_weight_ = constant("input_layernorm.weight", Ones({h}), -1);
  if (norm_bias) ln1_bias_ = constant("input_layernorm.bias", Zeros({h}), -1);
  // Column-parallel; rows grouped by key/value head so each shard is whole groups (NOTE
  // [QKV rows]).
  qkv_weight_ = weight("self_attention.linear_qkv.weight", {qkv_rows, h}, std, 0);
  if (bias) qkv_bias_ = constant("self_attention.linear_qkv.bias", Zeros({qkv_rows}), 0);
  // Row-parallel; the bias is added once, after the reduction.
  proj_weight_ = weight("self_attention.linear_proj.weight", {h, h}, out_std, 1);
  if (bias) proj_bias_ = constant("self_attention.linear_proj.bias", Zeros({h}), -1);
  ln2_weight_ = constant("pre_mlp_layernorm.weight", Ones({h}), -1);
  if (norm_bias) ln2_bias_ = constant("pre_mlp_layernorm.bias", Zeros({h}), -1);
  if (customizer != nullptr) {
    attention_core_ = customizer->MakeAttentionCore(layer_index, *this, initialize);
    feed_forward_ = customizer->MakeFeedForward(layer_index, *this, initialize);
  }
  if (feed_forward_ == nullptr) {
    // Under SwiGLU fc1 holds gate and up, interleaved (NOTE [SwiGLU rows]).
    const int64_t fc1_rows = options.swiglu ? 2 * f : f;
    fc1_weight_ = weight("mlp.linear_fc1.weight", {fc1_rows, h}, std, 0);
    if (bias) fc1_bias_ = constant("mlp.linear_fc1.bias", Zeros({fc1_rows}), 0);
    fc2_weight_ = weight("mlp.linear_fc2.weight", {h, f}, out_std, 1);
    if (bias) fc2_bias_ = constant("mlp.linear_fc2.bias", Zeros({h}), -1);
  }
  // Used on this rank's sequence rows (a feed-forward block's own parameters see the whole
  // sequence and are not among these).
  MarkSequenceParallel(*this, regions_,
                       {"input_layernorm.weight", "input_layernorm.bias",
                        "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight",
                        "pre_mlp_layernorm.bias", "mlp.linear_fc2.bias"});
  if (customizer != nullptr) customizer->EditLayer(*this, initialize);
}

void TransformerLayer::SetLinear(LinearSlot slot, LinearImpl impl) {
  linears_[static_cast<size_t>(slot)] = std::move(impl);
}

const at::Tensor& TransformerLayer::weight(LinearSlot slot) const {
  switch (slot) {
    case LinearSlot::kQkv: return qkv_weight_;
    case LinearSlot::kProj: return proj_weight_;
    case LinearSlot::kFc1: return fc1_weight_;
    case LinearSlot::kFc2: return fc2_weight_;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown linear slot");
}

const char* LinearSlotName(LinearSlot slot) {
  switch (slot) {
    case LinearSlot::kQkv: return "self_attention.linear_qkv.weight";
    case LinearSlot::kProj: return "self_attention.linear_proj.weight";
    case LinearSlot::kFc1: return "mlp.linear_fc1.weight";
    case LinearSlot::kFc2: return "mlp.linear_fc2.weight";
  }
  return "?";
}

at::Tensor TransformerLayer::Project(LinearSlot slot, const at::Tensor& x, const at::Tensor& w,
                                     const at::Tensor& b) const {
  const LinearImpl& impl = linears_[static_cast<size_t>(slot)];
  return impl ? impl(x, w, b) : LinearForward(x, w, b);
}

double TransformerLayer::Load() const {
  // NOTE [layer load composition].
  double measured = feed_forward_ != nullptr ? feed_forward_->Load() : 0.0;
  if (attention_core_ != nullptr) measured += attention_core_->Load();
  if (load_fractions_.empty()) return load_reporter_ ? load_reporter_() : measured;
  const bool from_blocks = !load_reporter_ && measured > 0;
  double load = load_reporter_ ? load_reporter_() : from_blocks ? measured : 1.0;
  for (const auto& [kind, fraction] : load_fractions_) {
    if (from_blocks && kind == LoadFraction::kTokens) continue;  // the blocks saw the tokens
    load *= fraction();
  }
  return load;
}

void TransformerLayer::SetLoadReporter(std::function<double()> reporter) {
  if (load_reporter_) {
    throw std::logic_error(absl::StrCat(
        name(), ": a second plugin sets the layer's load reporter; plugins that scale a "
        "layer's work compose through AddLoadFraction (NOTE [layer load composition])"));
  }
  load_reporter_ = std::move(reporter);
}

TransformerLayer::~TransformerLayer() = default;

NamedTensors TransformerLayer::MigrationTensors() const {
  NamedTensors out = Unit::MigrationTensors();
  if (feed_forward_ != nullptr) {
    for (auto& [name, tensor] : feed_forward_->StepState()) {
      out.emplace_back(GlobalName("mlp.step_state." + name), tensor);
    }
  }
  return out;
}

absl::Status TransformerLayer::LoadMigrationTensors(
    const std::map<std::string, at::Tensor>& tensors) {
  if (absl::Status s = Unit::LoadMigrationTensors(tensors); !s.ok()) return s;
  if (feed_forward_ == nullptr) return absl::OkStatus();
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (auto& [name, tensor] : feed_forward_->StepState()) {
    auto it = tensors.find(GlobalName("mlp.step_state." + name));
    if (it == tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat("migrated unit ", this->name(), " lacks ",
                                                     GlobalName("mlp.step_state." + name)));
    }
    state.emplace_back(name, it->second);
  }
  feed_forward_->LoadStepState(state);
  return absl::OkStatus();
}

at::Tensor TransformerLayer::Attention(const at::Tensor& x, const ForwardContext& ctx) const {
  // Column-parallel QKV on the whole sequence (gathered from the shards under sequence
  // parallelism).
  const at::Tensor input = regions_.EnterColumnParallel(x);
  const int64_t s = input.size(0);
  const int64_t b = input.size(1);
  const int64_t heads = local_heads_;
  const int64_t groups = local_groups_;
  const int64_t per_group = heads / groups;
  const int64_t d = options_.head_dim();
  at::Tensor qkv = Project(LinearSlot::kQkv, input, qkv_weight_, qkv_bias_)
                       .view({s, b, groups, per_group + 2, d});
  // [s, b, heads, d] → [b, heads, s, d]. unbind, not three selects: its backward writes
  // the three gradients into one tensor instead of zero-filling and adding three.
  at::Tensor q, k, v;
  if (per_group == 1) {
    std::vector<at::Tensor> parts = qkv.unbind(3);
    q = parts[0].permute({1, 2, 0, 3});
    k = parts[1].permute({1, 2, 0, 3});
    v = parts[2].permute({1, 2, 0, 3});
  } else {
    std::vector<at::Tensor> parts = qkv.split({per_group, 1, 1}, 3);
    q = parts[0].reshape({s, b, heads, d}).permute({1, 2, 0, 3});
    k = parts[1].squeeze(3).permute({1, 2, 0, 3});  // [b, groups, s, d]
    v = parts[2].squeeze(3).permute({1, 2, 0, 3});
  }
  if (options_.position_embedding == PositionEmbedding::kRotary) {
    if (ctx.rotary_positions.defined()) {
      const at::Tensor positions = ctx.rotary_positions.t();  // [b, s]
      q = ApplyRotaryAt(q, positions, options_.rotary_base);
      k = ApplyRotaryAt(k, positions, options_.rotary_base);
    } else {
      q = ApplyRotary(q, options_.rotary_base);
      k = ApplyRotary(k, options_.rotary_base);
    }
  }
  // Each key/value head serves its group's query heads. The dense core takes k, v grouped
  // (NOTE [attention core contract]: on CUDA no expanded copy is made); a plugin's core is
  // handed them expanded, one key/value head per query head. Rotary ran before either: on
  // the grouped heads there are fewer to rotate.
  at::Tensor context;  // [b, heads, s, d]
  if (attention_core_ != nullptr) {
    context = attention_core_->Forward(q, ExpandGroups(k, per_group), ExpandGroups(v, per_group), ctx);
  } else if (options_.recompute_attention && ctx.training) {
    context = RecomputedSoftmaxAttention(q, k, v, ctx);
  } else {
    context = SoftmaxAttention(q, k, v, ctx);
  }
  context = context.permute({2, 0, 1, 3})                   // [s, b, heads, d]
                .reshape({s, b, heads * d});
  // Row-parallel: partial products summed over the group, then the bias once.
  return AddBias(
      regions_.LeaveRowParallel(Project(LinearSlot::kProj, context, proj_weight_, at::Tensor())),
      proj_bias_);
}

// The dense causal attention: kernels::AttentionCore (NOTE [attention core contract] in
// core/kernels/attention.h), each head's dropout mask keyed by its global head.
at::Tensor TransformerLayer::SoftmaxAttention(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const ForwardContext& ctx) const {
  kernels::AttentionOptions core;
  core.dropout_p = ctx.training ? options_.attention_dropout : 0.0;
  const int64_t first_head = tp_rank() * q.size(1);
  core.drop_head = [&](const at::Tensor& probs, int64_t i) {
    return Dropout(probs, options_.attention_dropout, options_.seed, "attention_dropout",
                   layer_index_ * options_.num_attention_heads + first_head + i, ctx);
  };
  return kernels::AttentionCore(q, k, v, core);
}

at::Tensor TransformerLayer::Mlp(const at::Tensor& x, const ForwardContext& ctx) const {
  // A block computes on the whole sequence, replicated over the group, as without sequence
  // parallelism (NOTE [sequence parallelism]).
  if (feed_forward_ != nullptr) {
    return regions_.OwnSequence(feed_forward_->Forward(regions_.WholeSequence(x), ctx));
  }
  at::Tensor local;  // This rank's share of fc2's output, before the reduction and the bias.
  if (!options_.swiglu && !linears_[static_cast<size_t>(LinearSlot::kFc1)] &&
      !linears_[static_cast<size_t>(LinearSlot::kFc2)]) {
    // fc1, GeLU and fc2 as one function through the fused GEMM epilogues; a plugin's
    // product for either weight keeps the unfused path (NOTE [fused GeLU MLP] in
    // core/linear.h).
    local = LinearGeluMlpForward(regions_.EnterColumnParallel(x), fc1_weight_, fc1_bias_, fc2_weight_,
                                 options_.openai_gelu);
  } else {
    at::Tensor h = MlpActivation(
        options_, Project(LinearSlot::kFc1, regions_.EnterColumnParallel(x), fc1_weight_, fc1_bias_));
    local = Project(LinearSlot::kFc2, h, fc2_weight_, at::Tensor());
  }
  return AddBias(regions_.LeaveRowParallel(local), fc2_bias_);
}

at::Tensor TransformerLayer::DropoutRows(const at::Tensor& x, std::string_view site,
                                         const ForwardContext& ctx) const {
  const int64_t whole = regions_.WholeSequenceLength(x.size(0));
  return Dropout(x, options_.hidden_dropout, options_.seed, site, layer_index_, ctx,
                 regions_.SequenceRows(whole).first, whole);
}

at::Tensor TransformerLayer::Residual(const at::Tensor& hidden, const ForwardContext& ctx) const {
  at::Tensor attn = DropoutRows(Attention(Norm(options_, hidden, ln1_weight_, ln1_bias_), ctx),
                                "attention_output_dropout", ctx);
  at::Tensor mlp = Mlp(Norm(options_, hidden + attn, ln2_weight_, ln2_bias_), ctx);
  return attn + DropoutRows(mlp, "mlp_output_dropout", ctx);
}

at::Tensor TransformerLayer::ResidualAt(const at::Tensor& hidden, const at::Tensor& index,
                                        const ForwardContext& ctx) const {
  const int64_t s = hidden.size(0);
  const int64_t b = hidden.size(1);
  const int64_t h = options_.hidden_size;
  const int64_t k = index.size(0);
  TORCH_CHECK(!regions_.sequence_parallel(),
              "ResidualAt: not built for --sequence_parallel (the index names whole-sequence "
              "positions)");
  TORCH_CHECK(index.dim() == 2 && index.size(1) == b, "ResidualAt: index must be [k, ", b,
              "], got ", index.sizes());
  const at::Tensor index3 = index.unsqueeze(-1).expand({k, b, h});
  const bool whole = attention_core_ != nullptr ||
                     linears_[static_cast<int>(LinearSlot::kQkv)] ||
                     (ctx.training && options_.attention_dropout > 0);
  if (whole) return Residual(hidden, ctx).gather(0, index3);

  const int64_t heads = local_heads_;
  const int64_t groups = local_groups_;
  const int64_t per_group = heads / groups;
  const int64_t d = options_.head_dim();
  // The local QKV weight's rows are [groups, per_group + 2, d]: each group's query heads,
  // then its key and its value (NOTE [QKV rows]).
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(hidden.device());
  const at::Tensor base =
      at::arange(groups, longs).mul_((per_group + 2) * d).view({groups, 1, 1});
  const at::Tensor within = at::arange(d, longs).view({1, 1, d});
  const at::Tensor q_rows =
      (base + at::arange(per_group, longs).mul_(d).view({1, per_group, 1}) + within)
          .reshape({-1});
  const at::Tensor kv_rows =
      (base + at::arange(per_group, per_group + 2, longs).mul_(d).view({1, 2, 1}) + within)
          .reshape({-1});
  const at::Tensor x = regions_.EnterColumnParallel(Norm(options_, hidden, ln1_weight_, ln1_bias_));
  at::Tensor q = LinearRowsForward(x.gather(0, index3), qkv_weight_, qkv_bias_, q_rows)
                     .view({k, b, heads, d})
                     .permute({1, 2, 0, 3});  // [b, heads, k, d]
  std::vector<at::Tensor> kv =
      LinearRowsForward(x, qkv_weight_, qkv_bias_, kv_rows).view({s, b, groups, 2, d}).unbind(3);
  at::Tensor key_heads = kv[0].permute({1, 2, 0, 3});  // [b, groups, s, d]
  if (options_.position_embedding == PositionEmbedding::kRotary) {
    // The queries at their own positions, the keys at every position.
    const at::Tensor all = ctx.rotary_positions.defined() ? ctx.rotary_positions
                                                          : at::arange(s, longs).unsqueeze(1).expand({s, b});
    q = ApplyRotaryAt(q, all.gather(0, index).t(), options_.rotary_base);
    key_heads = ApplyRotaryAt(key_heads, all.t(), options_.rotary_base);
  }
  const at::Tensor keys = ExpandGroups(key_heads, per_group);  // [b, heads, s, d]
  const at::Tensor values = ExpandGroups(kv[1].permute({1, 2, 0, 3}), per_group);
  // NOTE [causal query chunks]
  // The k chosen queries are taken in chunks of max(16, ⌈k/8⌉), and a chunk scores only the
  // keys up to the latest position among its queries: with ascending positions about half
  // of the k×s matrix is computed. The masked entries it skips are exactly the zeros of the
  // full computation, so the result is the same function as the dense layer's
  // (tests/core/residual_at_test.cc, 1e-12 in fp64).
  const at::Tensor scaled_q = q * (1.0 / std::sqrt(double(d)));
  const at::Tensor query_pos = index.t().reshape({b, 1, k, 1});
  const int64_t chunk = std::max<int64_t>(16, (k + 7) / 8);
  std::vector<at::Tensor> parts;
  for (int64_t begin = 0; begin < k; begin += chunk) {
    const int64_t rows = std::min(k, begin + chunk) - begin;
    const at::Tensor pos = query_pos.narrow(2, begin, rows);
    const int64_t end = pos.max().item<int64_t>() + 1;
    const at::Tensor scores =
        at::matmul(scaled_q.narrow(2, begin, rows), keys.narrow(2, 0, end).transpose(-2, -1));
    // Query at position p sees keys 0..p.
    const at::Tensor future = at::arange(end, longs).view({1, 1, 1, end}) > pos;
    parts.push_back(
        at::matmul(kernels::MaskedSoftmax(scores, future), values.narrow(2, 0, end)));
  }
  at::Tensor context = (parts.size() == 1 ? parts[0] : at::cat(parts, 2))
                           .permute({2, 0, 1, 3})
                           .reshape({k, b, heads * d});
  at::Tensor attn = AddBias(
      regions_.LeaveRowParallel(Project(LinearSlot::kProj, context, proj_weight_, at::Tensor())),
      proj_bias_);
  attn = Dropout(attn, options_.hidden_dropout, options_.seed, "attention_output_dropout",
                 layer_index_, ctx);
  at::Tensor mlp =
      Mlp(Norm(options_, hidden.gather(0, index3) + attn, ln2_weight_, ln2_bias_), ctx);
  return attn + Dropout(mlp, options_.hidden_dropout, options_.seed, "mlp_output_dropout",
                        layer_index_, ctx);
}

at::Tensor TransformerLayer::Forward(const at::Tensor& hidden, const ForwardContext& ctx) const {
  if (forward_wrapper_) return forward_wrapper_(*this, hidden, ctx);
  return PlainForward(hidden, ctx);
}

at::Tensor TransformerLayer::PlainForward(const at::Tensor& hidden, const ForwardContext& ctx) const {
  at::Tensor attn = Attention(Norm(options_, hidden, ln1_weight_, ln1_bias_), ctx);
  at::Tensor x = hidden + DropoutRows(attn, "attention_output_dropout", ctx);
  at::Tensor mlp = Mlp(Norm(options_, x, ln2_weight_, ln2_bias_), ctx);
  return x + DropoutRows(mlp, "mlp_output_dropout", ctx);
}

namespace {

// NOTE [activation recomputation]: the layer and the context travel in the node's saved
// data; the layer outlives the backward (a moving layer leaves after its last W).
void SaveForRecompute(torch::autograd::AutogradContext* node, const TransformerLayer* layer,
                      const ForwardContext& ctx) {
  auto& saved = node->saved_data;
  saved["layer"] = reinterpret_cast<int64_t>(layer);
  saved["tag"] = WeightGradStore::CurrentTag();
  saved["training"] = ctx.training;
  saved["iteration"] = ctx.iteration;
  saved["first_sample"] = ctx.first_sample;
  saved["loss_scale"] = ctx.loss_scale;
  saved["epoch"] = ctx.epoch;
  saved["token_positions"] = ctx.token_positions;
  saved["labels"] = ctx.labels;
  saved["rotary_positions"] = ctx.rotary_positions;
  // The carried token state the layer received (NOTE [carried token state]): layers set a
  // new tensor rather than edit this one, so the reference is the input.
  saved["token_state"] = ctx.token_state;
}

// The context SaveForRecompute kept, marked as the recomputation's.
ForwardContext RestoreForRecompute(torch::autograd::AutogradContext* node) {
  auto& saved = node->saved_data;
  ForwardContext ctx{saved["training"].toBool(), saved["iteration"].toInt(),
                     saved["first_sample"].toInt(), saved["loss_scale"].toDouble(),
                     saved["token_positions"].toOptional<at::Tensor>().value_or(at::Tensor()),
                     saved["epoch"].toInt()};
  ctx.labels = saved["labels"].toOptional<at::Tensor>().value_or(at::Tensor());
  ctx.rotary_positions = saved["rotary_positions"].toOptional<at::Tensor>().value_or(at::Tensor());
  ctx.token_state = saved["token_state"].toOptional<at::Tensor>().value_or(at::Tensor());
  ctx.recomputing = true;
  return ctx;
}

const TransformerLayer* SavedLayer(torch::autograd::AutogradContext* node) {
  return reinterpret_cast<const TransformerLayer*>(node->saved_data["layer"].toInt());
}

struct RecomputedLayer : public torch::autograd::Function<RecomputedLayer> {
  static at::Tensor forward(torch::autograd::AutogradContext* node, const at::Tensor& hidden,
                            const TransformerLayer* layer, const ForwardContext* ctx) {
    node->save_for_backward({hidden});
    SaveForRecompute(node, layer, *ctx);
    // Autograd is off inside a custom function's forward: nothing of the layer is kept.
    return layer->Forward(hidden, *ctx);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* node,
                                               torch::autograd::tensor_list grads) {
    auto& saved = node->saved_data;
    const TransformerLayer* layer = SavedLayer(node);
    const ForwardContext ctx = RestoreForRecompute(node);
    const at::Tensor input = node->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor output;
    {
      at::AutoGradMode with_grad(true);
      WeightGradStore::TagScope tag(saved["tag"].toInt());
      output = layer->Forward(input, ctx);
    }
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// Selective (NOTE [activation recomputation]): the dense attention core of one layer.
struct RecomputedAttentionCore : public torch::autograd::Function<RecomputedAttentionCore> {
  static at::Tensor forward(torch::autograd::AutogradContext* node, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const TransformerLayer* layer, const ForwardContext* ctx) {
    node->save_for_backward({q, k, v});
    SaveForRecompute(node, layer, *ctx);
    return layer->SoftmaxAttention(q, k, v, *ctx);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* node,
                                               torch::autograd::tensor_list grads) {
    const ForwardContext ctx = RestoreForRecompute(node);
    const auto saved = node->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : saved) inputs.push_back(t.detach().requires_grad_(true));
    at::Tensor output;
    {
      at::AutoGradMode with_grad(true);
      output = SavedLayer(node)->SoftmaxAttention(inputs[0], inputs[1], inputs[2], ctx);
    }
    torch::autograd::backward({output}, {grads[0]});
    return {inputs[0].grad(), inputs[1].grad(), inputs[2].grad(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor TransformerLayer::RecomputedSoftmaxAttention(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v,
                                                        const ForwardContext& ctx) const {
  if (!at::GradMode::is_enabled() ||
      !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    return SoftmaxAttention(q, k, v, ctx);
  }
  return RecomputedAttentionCore::apply(q, k, v, this, &ctx);
}

at::Tensor RecomputedForward(const TransformerLayer& layer, const at::Tensor& hidden,
                             const ForwardContext& ctx) {
  if (!at::GradMode::is_enabled() || !hidden.requires_grad()) return layer.Forward(hidden, ctx);
  return RecomputedLayer::apply(hidden, &layer, &ctx);
}

// ---------------------------------------------------------------------------------------
Head::Head(const ModelOptions& options, TensorParallelGroup* tp, bool mirror_word_embeddings)
    : Unit("head", TpRank(tp), TpSize(tp)),
      options_(options),
      tp_(tp),
      regions_(tp, options.sequence_parallel),
      vocab_start_(TpRank(tp) * (options.vocab_size / TpSize(tp))) {
  set_params_dtype(ParamsScalarType(options), options.device_spec.device);
  const int64_t h = options.hidden_size;
  ln_weight_ = AddParameter("final_layernorm.weight", Ones({h}), false);
  if (options.normalization == Normalization::kLayerNorm) {
    ln_bias_ = AddParameter("final_layernorm.bias", Zeros({h}), false);
  }
  if (!options.tie_embeddings) {
    output_weight_ = AddParameter(
        "output_layer.weight",
        ShardOf(NormalInit(options.seed, GlobalName("output_layer.weight"),
                           {options.vocab_size, h}, options.init_method_std),
                0, tp_rank(), tp_size()),
        true, /*tp_shard_dim=*/0);
  } else if (mirror_word_embeddings) {
    // Same key as the embedding's initialisation, so the mirror starts equal to it.
    const std::string source = "embedding.word_embeddings.weight";
    output_weight_ = AddParameter(
        "word_embeddings_mirror.weight",
        ShardOf(NormalInit(options.seed, source, {options.vocab_size, h}, options.init_method_std),
                0, tp_rank(), tp_size()),
        true, /*tp_shard_dim=*/0, /*mirror_of=*/source);
  }
  MarkSequenceParallel(*this, regions_, {"final_layernorm.weight", "final_layernorm.bias"});
}

at::Tensor Head::Logits(const at::Tensor& hidden, const at::Tensor& word_embeddings) const {
  at::Tensor x = Norm(options_, hidden, ln_weight_, ln_bias_);
  const at::Tensor& w = output_weight_.defined() ? output_weight_ : word_embeddings;
  TORCH_CHECK(w.defined(), "tied output layer needs the word embeddings");
  // Vocab-parallel output layer: column-parallel over the vocabulary, on the whole sequence.
  return LinearForward(regions_.EnterColumnParallel(x), w, at::Tensor());
}

at::Tensor Head::TokenLosses(const at::Tensor& hidden, const at::Tensor& word_embeddings,
                             const at::Tensor& labels) const {
  // The full logits are never gathered (NOTE [tensor-parallel sharding]).
  return VocabParallelCrossEntropy(Logits(hidden, word_embeddings), labels.to(hidden.device()),
                                   vocab_start_, tp_);
}

}  // namespace fulcrum
