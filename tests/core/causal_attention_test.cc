// The dense layer's causal attention (NOTE [attention core contract] in
// core/kernels/attention.h: LibTorch's scaled_dot_product_attention) against a plain
// reference written here: the whole s×s masked softmax. Several sequence lengths, short and
// ragged against any block size; forward and gradients. And the layer's attention is
// kernels::AttentionCore on the grouped keys and values, bit for bit.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/kernels/attention.h"
#include "core/linear.h"
#include "core/transformer_layer.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

// The layer's computation with full attention, from its parameters.
at::Tensor Reference(const TransformerLayer& layer, const ModelOptions& o, const at::Tensor& x) {
  std::map<std::string, at::Tensor> p;
  for (const Parameter& q : layer.parameters()) p[q.name] = q.value;
  const int64_t s = x.size(0), b = x.size(1), h = o.hidden_size, heads = o.num_attention_heads;
  const int64_t d = h / heads;
  const at::Tensor ln1 = at::layer_norm(x, {h}, p["input_layernorm.weight"], p["input_layernorm.bias"], o.layernorm_epsilon);
  const at::Tensor qkv = at::linear(ln1, p["self_attention.linear_qkv.weight"], p["self_attention.linear_qkv.bias"])
                             .view({s, b, heads, 3, d});
  const at::Tensor q = qkv.select(3, 0).permute({1, 2, 0, 3});
  const at::Tensor k = qkv.select(3, 1).permute({1, 2, 0, 3});
  const at::Tensor v = qkv.select(3, 2).permute({1, 2, 0, 3});
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
  scores = scores.masked_fill(at::ones({s, s}, at::kBool).triu(1), -INFINITY);
  const at::Tensor context = at::matmul(at::softmax(scores, -1), v).permute({2, 0, 1, 3}).reshape({s, b, h});
  const at::Tensor attn = at::linear(context, p["self_attention.linear_proj.weight"], p["self_attention.linear_proj.bias"]);
  const at::Tensor mid = x + attn;
  const at::Tensor ln2 = at::layer_norm(mid, {h}, p["pre_mlp_layernorm.weight"], p["pre_mlp_layernorm.bias"], o.layernorm_epsilon);
  const at::Tensor mlp = at::linear(at::gelu(at::linear(ln2, p["mlp.linear_fc1.weight"], p["mlp.linear_fc1.bias"])),
                                    p["mlp.linear_fc2.weight"], p["mlp.linear_fc2.bias"]);
  return mid + mlp;
}

TEST(CausalAttentionTest, TheLayerEqualsTheFullMaskedSoftmax) {
  for (int64_t s : {40, 128, 300}) {
    SCOPED_TRACE(s);
    ModelOptions o = testing::SmallModelOf(1, s);
    o.device_spec.master_dtype = o.device_spec.compute_dtype = at::kDouble;
    TransformerLayer layer(o, 0);
    torch::manual_seed(11);
    testing::ExpectLayerMatchesReference(
        layer, [&](const at::Tensor& y) { return Reference(layer, o, y); },
        {s, 2, o.hidden_size}, 1e-12);
  }
}

// The comparison itself: a reference that is another function (twice the layer) fails it
// on the output and on the input gradient.
TEST(CausalAttentionTest, AnotherReferenceFailsTheComparison) {
  ModelOptions o = testing::SmallModelOf(1, 40);
  o.device_spec.master_dtype = o.device_spec.compute_dtype = at::kDouble;
  TransformerLayer layer(o, 0);
  torch::manual_seed(11);
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    testing::ExpectLayerMatchesReference(
        layer, [&](const at::Tensor& y) { return 2 * Reference(layer, o, y); },
        {40, 2, o.hidden_size}, 1e-12);
  }
  EXPECT_EQ(failures.size(), 2);
}

// A Llama layer with grouped-query attention (4 query heads, 2 key/value heads), fp32.
ModelOptions GroupedLlama() {
  ModelOptions o = testing::SmallModelOf(1, 40);
  o.num_query_groups = 2;
  o.normalization = Normalization::kRMSNorm;
  o.position_embedding = PositionEmbedding::kRotary;
  o.swiglu = true;
  o.add_bias_linear = false;
  o.hidden_dropout = 0;
  return o;
}

// TransformerLayer::PlainForward op for op (one rank, no plugin) with its attention written
// as a call of kernels::AttentionCore on k, v [b, groups, s, d] as `kv` hands them over.
at::Tensor KernelReference(const TransformerLayer& layer, const ModelOptions& o, const at::Tensor& x,
                           const ForwardContext& ctx,
                           const std::function<at::Tensor(const at::Tensor&)>& kv) {
  std::map<std::string, at::Tensor> p;
  for (const Parameter& q : layer.parameters()) p[q.name] = q.value;
  const int64_t s = x.size(0), b = x.size(1), heads = o.num_attention_heads;
  const int64_t groups = o.query_groups(), per_group = heads / groups, d = o.head_dim();
  const at::Tensor qkv = LinearForward(Norm(o, x, p["input_layernorm.weight"], at::Tensor()),
                                       p["self_attention.linear_qkv.weight"], at::Tensor())
                             .view({s, b, groups, per_group + 2, d});
  const std::vector<at::Tensor> parts = qkv.split({per_group, 1, 1}, 3);
  const at::Tensor q = ApplyRotary(parts[0].reshape({s, b, heads, d}).permute({1, 2, 0, 3}), o.rotary_base);
  const at::Tensor k = ApplyRotary(parts[1].squeeze(3).permute({1, 2, 0, 3}), o.rotary_base);
  const at::Tensor v = parts[2].squeeze(3).permute({1, 2, 0, 3});
  kernels::AttentionOptions core;
  core.dropout_p = ctx.training ? o.attention_dropout : 0.0;
  core.drop_head = [&](const at::Tensor& probs, int64_t i) {
    return Dropout(probs, o.attention_dropout, o.seed, "attention_dropout", i, ctx);  // layer 0
  };
  const at::Tensor context =
      kernels::AttentionCore(q, kv(k), kv(v), core).permute({2, 0, 1, 3}).reshape({s, b, heads * d});
  const at::Tensor mid = x + LinearForward(context, p["self_attention.linear_proj.weight"], at::Tensor());
  const at::Tensor h = MlpActivation(o, LinearForward(Norm(o, mid, p["pre_mlp_layernorm.weight"], at::Tensor()),
                                                      p["mlp.linear_fc1.weight"], at::Tensor()));
  return mid + LinearForward(h, p["mlp.linear_fc2.weight"], at::Tensor());
}

// The layer's output and input gradient against the reference's: {max |Δ|, bit-equal}.
std::pair<double, bool> CompareWithKernel(const ModelOptions& o, const ForwardContext& ctx,
                                          const std::function<at::Tensor(const at::Tensor&)>& kv) {
  TransformerLayer layer(o, 0);
  torch::manual_seed(5);
  const at::Tensor x0 = at::randn({o.seq_length, 2, o.hidden_size});
  const at::Tensor probe = at::randn_like(x0);
  at::Tensor x = x0.clone().requires_grad_();
  at::Tensor y = x0.clone().requires_grad_();
  const at::Tensor got = layer.Forward(x, ctx);
  const at::Tensor want = KernelReference(layer, o, y, ctx, kv);
  (got * probe).sum().backward();
  (want * probe).sum().backward();
  const double diff = std::max(testing::MaxAbsDiff(got, want), testing::MaxAbsDiff(x.grad(), y.grad()));
  return {diff, at::equal(got, want) && at::equal(x.grad(), y.grad())};
}

// The layer goes through kernels::AttentionCore with k, v grouped (not expanded by the
// layer first): bit for bit in fp32, without attention dropout and with it (its masks per
// global head from Fulcrum's generators, through drop_head). The comparison sees the group
// mapping: tiling the key/value heads (head i served by group i mod groups) instead of the
// contract's consecutive query heads per group is another function, which fails it.
TEST(CausalAttentionTest, GroupedQueryLayerIsTheKernelOnGroupedKeysBitForBit) {
  const auto grouped = [](const at::Tensor& t) { return t; };
  const auto tiled = [](const at::Tensor& t) { return t.repeat({1, 2, 1, 1}); };
  ModelOptions o = GroupedLlama();
  for (bool dropout : {false, true}) {
    SCOPED_TRACE(dropout);
    o.attention_dropout = dropout ? 0.2 : 0.0;
    const ForwardContext ctx{true, 3, 8, 0.0, {}, 0};
    const auto [diff, equal] = CompareWithKernel(o, ctx, grouped);
    EXPECT_TRUE(equal) << "max |layer - kernel| " << diff;
    const auto [wrong_diff, wrong_equal] = CompareWithKernel(o, ctx, tiled);
    EXPECT_FALSE(wrong_equal);
    EXPECT_GT(wrong_diff, 1e-3);
  }
  // Dropout did drop: the layer in training with attention dropout differs from evaluation.
  o.attention_dropout = 0.2;
  TransformerLayer layer(o, 0);
  torch::manual_seed(5);
  const at::Tensor x = at::randn({o.seq_length, 2, o.hidden_size});
  EXPECT_FALSE(at::equal(layer.Forward(x, ForwardContext{true, 3, 8, 0.0, {}, 0}),
                         layer.Forward(x, ForwardContext{false, 3, 8, 0.0, {}, 0})));
}

}  // namespace
}  // namespace fulcrum
