#include "core/transformer_layer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/linear.h"
#include "core/random.h"

namespace fulcrum {
namespace {

// Every initial value is drawn from a generator keyed by the parameter's global name
// (NOTE [layout-independent randomness]).
at::Tensor NormalInit(uint64_t seed, const std::string& global_name, at::IntArrayRef shape,
                      double std) {
  at::Generator gen = MakeGenerator(seed, global_name);
  return at::empty(shape, at::kFloat).normal_(0.0, std, gen);
}

at::Tensor Zeros(at::IntArrayRef shape) { return at::zeros(shape, at::kFloat); }
at::Tensor Ones(at::IntArrayRef shape) { return at::ones(shape, at::kFloat); }

}  // namespace

at::Tensor Dropout(const at::Tensor& x, double p, uint64_t seed, std::string_view site,
                   int64_t layer, const ForwardContext& ctx) {
  if (!ctx.training || p == 0.0) return x;
  at::Generator gen = MakeGenerator(seed, site, {layer, ctx.iteration, ctx.first_sample});
  at::Tensor keep = at::empty(x.sizes(), x.options().requires_grad(false)).bernoulli_(1.0 - p, gen);
  return x * keep.div_(1.0 - p);
}

at::Tensor ApplyRotary(const at::Tensor& x, double base) {
  const int64_t s = x.size(2);
  const int64_t d = x.size(3);
  at::Tensor inv_freq =
      at::pow(base, -at::arange(0, d, 2, at::kDouble) / static_cast<double>(d));  // [d/2]
  at::Tensor angles = at::outer(at::arange(s, at::kDouble), inv_freq);            // [s, d/2]
  angles = at::cat({angles, angles}, -1).to(x.scalar_type());                     // [s, d]
  at::Tensor cos = angles.cos();
  at::Tensor sin = angles.sin();
  at::Tensor x1 = x.narrow(-1, 0, d / 2);
  at::Tensor x2 = x.narrow(-1, d / 2, d / 2);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

// ---------------------------------------------------------------------------------------
Embedding::Embedding(const ModelOptions& options) : Unit("embedding"), options_(options) {
  const int64_t h = options.hidden_size;
  word_embeddings_ = AddParameter(
      "word_embeddings.weight",
      NormalInit(options.seed, GlobalName("word_embeddings.weight"), {options.vocab_size, h},
                 options.init_method_std),
      /*weight_decay=*/true);
  if (options.position_embedding == PositionEmbedding::kLearned) {
    position_embeddings_ = AddParameter(
        "position_embeddings.weight",
        NormalInit(options.seed, GlobalName("position_embeddings.weight"),
                   {options.seq_length, h}, options.init_method_std),
        /*weight_decay=*/true);
  }
}

at::Tensor Embedding::Forward(const at::Tensor& tokens, const ForwardContext& ctx) const {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be [batch, sequence], got ", tokens.sizes());
  const int64_t s = tokens.size(1);
  TORCH_CHECK(s <= options_.seq_length, "sequence of ", s, " tokens exceeds seq_length ",
              options_.seq_length);
  at::Tensor hidden = at::embedding(word_embeddings_, tokens.t());  // [s, b, h]
  if (position_embeddings_.defined()) {
    hidden = hidden + position_embeddings_.narrow(0, 0, s).unsqueeze(1);
  }
  return Dropout(hidden, options_.hidden_dropout, options_.seed, "embedding_dropout", -1, ctx);
}

// ---------------------------------------------------------------------------------------
TransformerLayer::TransformerLayer(const ModelOptions& options, int64_t layer_index)
    : Unit(absl::StrCat("layers.", layer_index)), options_(options), layer_index_(layer_index) {
  const int64_t h = options.hidden_size;
  const int64_t f = options.ffn_hidden_size;
  const double std = options.init_method_std;
  // Output projections feed the residual stream: scaled init (GPT-2 / Megatron).
  const double out_std = std / std::sqrt(2.0 * options.num_layers);
  auto normal = [&](const char* name, at::IntArrayRef shape, double s) {
    return NormalInit(options.seed, GlobalName(name), shape, s);
  };
  ln1_weight_ = AddParameter("input_layernorm.weight", Ones({h}), false);
  ln1_bias_ = AddParameter("input_layernorm.bias", Zeros({h}), false);
  // Rows of linear_qkv are ordered (head, {q, k, v}, head_dim), so a split of the rows by
  // tensor-parallel rank hands each rank whole heads.
  qkv_weight_ = AddParameter("self_attention.linear_qkv.weight",
                             normal("self_attention.linear_qkv.weight", {3 * h, h}, std), true);
  qkv_bias_ = AddParameter("self_attention.linear_qkv.bias", Zeros({3 * h}), false);
  proj_weight_ = AddParameter("self_attention.linear_proj.weight",
                              normal("self_attention.linear_proj.weight", {h, h}, out_std), true);
  proj_bias_ = AddParameter("self_attention.linear_proj.bias", Zeros({h}), false);
  ln2_weight_ = AddParameter("pre_mlp_layernorm.weight", Ones({h}), false);
  ln2_bias_ = AddParameter("pre_mlp_layernorm.bias", Zeros({h}), false);
  fc1_weight_ = AddParameter("mlp.linear_fc1.weight", normal("mlp.linear_fc1.weight", {f, h}, std),
                             true);
  fc1_bias_ = AddParameter("mlp.linear_fc1.bias", Zeros({f}), false);
  fc2_weight_ = AddParameter("mlp.linear_fc2.weight",
                             normal("mlp.linear_fc2.weight", {h, f}, out_std), true);
  fc2_bias_ = AddParameter("mlp.linear_fc2.bias", Zeros({h}), false);
}

at::Tensor TransformerLayer::Attention(const at::Tensor& x, const ForwardContext& ctx) const {
  const int64_t s = x.size(0);
  const int64_t b = x.size(1);
  const int64_t heads = options_.num_attention_heads;
  const int64_t d = options_.head_dim();
  at::Tensor qkv = LinearForward(x, qkv_weight_, qkv_bias_).view({s, b, heads, 3, d});
  // [s, b, heads, d] → [b, heads, s, d]
  at::Tensor q = qkv.select(3, 0).permute({1, 2, 0, 3});
  at::Tensor k = qkv.select(3, 1).permute({1, 2, 0, 3});
  at::Tensor v = qkv.select(3, 2).permute({1, 2, 0, 3});
  if (options_.position_embedding == PositionEmbedding::kRotary) {
    q = ApplyRotary(q, options_.rotary_base);
    k = ApplyRotary(k, options_.rotary_base);
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(d)));
  at::Tensor future = at::ones({s, s}, at::TensorOptions().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores, -1);
  probs = Dropout(probs, options_.attention_dropout, options_.seed, "attention_dropout",
                  layer_index_, ctx);
  at::Tensor context = at::matmul(probs, v)                 // [b, heads, s, d]
                           .permute({2, 0, 1, 3})           // [s, b, heads, d]
                           .reshape({s, b, heads * d});
  return LinearForward(context, proj_weight_, proj_bias_);
}

at::Tensor TransformerLayer::Mlp(const at::Tensor& x, const ForwardContext& ctx) const {
  at::Tensor h = at::gelu(LinearForward(x, fc1_weight_, fc1_bias_));
  return LinearForward(h, fc2_weight_, fc2_bias_);
}

at::Tensor TransformerLayer::Forward(const at::Tensor& hidden, const ForwardContext& ctx) const {
  const int64_t h = options_.hidden_size;
  const double eps = options_.layernorm_epsilon;
  at::Tensor attn = Attention(at::layer_norm(hidden, {h}, ln1_weight_, ln1_bias_, eps), ctx);
  at::Tensor x = hidden + Dropout(attn, options_.hidden_dropout, options_.seed,
                                  "attention_output_dropout", layer_index_, ctx);
  at::Tensor mlp = Mlp(at::layer_norm(x, {h}, ln2_weight_, ln2_bias_, eps), ctx);
  return x + Dropout(mlp, options_.hidden_dropout, options_.seed, "mlp_output_dropout",
                     layer_index_, ctx);
}

// ---------------------------------------------------------------------------------------
Head::Head(const ModelOptions& options) : Unit("head"), options_(options) {
  const int64_t h = options.hidden_size;
  ln_weight_ = AddParameter("final_layernorm.weight", Ones({h}), false);
  ln_bias_ = AddParameter("final_layernorm.bias", Zeros({h}), false);
  if (!options.tie_embeddings) {
    output_weight_ = AddParameter(
        "output_layer.weight",
        NormalInit(options.seed, GlobalName("output_layer.weight"), {options.vocab_size, h},
                   options.init_method_std),
        true);
  }
}

at::Tensor Head::Logits(const at::Tensor& hidden, const at::Tensor& word_embeddings) const {
  at::Tensor x = at::layer_norm(hidden, {options_.hidden_size}, ln_weight_, ln_bias_,
                                options_.layernorm_epsilon);
  const at::Tensor& w = output_weight_.defined() ? output_weight_ : word_embeddings;
  TORCH_CHECK(w.defined(), "tied output layer needs the word embeddings");
  return LinearForward(x, w, at::Tensor());
}

}  // namespace fulcrum
