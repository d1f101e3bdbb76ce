// The dense layer's causal attention (NOTE [dense causal attention] in
// core/transformer_layer.cc: LibTorch's scaled_dot_product_attention) against a plain
// reference written here: the whole s×s masked softmax. Several sequence lengths, short and
// ragged against any block size; forward and gradients.
#include <torch/torch.h>

#include <cmath>
#include <map>

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

}  // namespace
}  // namespace fulcrum
