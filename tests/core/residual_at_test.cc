// TransformerLayer::ResidualAt (some tokens' queries against every token's keys) and
// LinearRowsForward (a product with some rows of a weight) against the dense layer:
// values and every gradient equal Residual(hidden).gather(0, index)'s, also with the
// weight gradients deferred (B/W split).
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/linear.h"
#include "core/transformer_layer.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

ModelOptions Fp64Model() {
  ModelOptions m = testing::SmallModel();  // hidden 32, 4 heads
  m.seq_length = 64;  // ResidualAt's query chunks are ≥ 16 rows: several chunks
  m.device_spec.master_dtype = m.device_spec.compute_dtype = at::kDouble;
  m.hidden_dropout = 0;
  m.attention_dropout = 0;
  return m;
}

// The Llama variants with learned positions (rotary positions take the whole-layer path):
// two query heads per key/value head, RMSNorm, SwiGLU, no linear biases.
ModelOptions Fp64Grouped() {
  ModelOptions m = Fp64Model();
  m.num_query_groups = 2;
  m.normalization = Normalization::kRMSNorm;
  m.swiglu = true;
  m.add_bias_linear = false;
  return m;
}

// The same with rotary positions: the queries rotated to their positions, the keys to all.
ModelOptions Fp64GroupedRotary() {
  ModelOptions m = Fp64Grouped();
  m.position_embedding = PositionEmbedding::kRotary;
  return m;
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Ascending positions per column: column j keeps the positions whose random draw is below
// a per-column rate (at least one), padded with repeats of its last position.
at::Tensor SomePositions(int64_t s, int64_t b, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<std::vector<int64_t>> columns(b);
  size_t k = 0;
  for (int64_t j = 0; j < b; ++j) {
    const at::Tensor keep = at::rand({s}).lt(0.2 + 0.25 * static_cast<double>(j));
    for (int64_t p = 0; p < s; ++p) {
      if (keep[p].item<bool>()) columns[j].push_back(p);
    }
    if (columns[j].empty()) columns[j].push_back(s - 1);
    k = std::max(k, columns[j].size());
  }
  at::Tensor index = at::empty({static_cast<int64_t>(k), b}, at::kLong);
  for (int64_t j = 0; j < b; ++j) {
    for (size_t i = 0; i < k; ++i) {
      index[static_cast<int64_t>(i)][j] = columns[j][std::min(i, columns[j].size() - 1)];
    }
  }
  return index;
}

std::map<std::string, at::Tensor> LayerGrads(TransformerLayer& layer) {
  std::map<std::string, at::Tensor> out;
  for (Parameter& p : layer.parameters()) {
    out[p.name] = p.value.grad().defined() ? p.value.grad().clone() : at::zeros_like(p.value);
    p.value.mutable_grad() = at::Tensor();
  }
  return out;
}

TEST(ResidualAtTest, AllPositionsEqualTheDenseResidual) {
  const ModelOptions m = Fp64Model();
  TransformerLayer layer(m, /*layer_index=*/1);
  const int64_t s = m.seq_length, b = 3;
  at::manual_seed(1);
  const at::Tensor x = at::randn({s, b, m.hidden_size}, at::kDouble);
  const at::Tensor all = at::arange(s, at::kLong).unsqueeze(1).expand({s, b});
  at::NoGradGuard no_grad;
  ForwardContext ctx{false};
  EXPECT_LT(MaxAbsDiff(layer.ResidualAt(x, all, ctx), layer.Residual(x, ctx)), 1e-12);
}

TEST(ResidualAtTest, SomeTokensEqualTheDenseResidualAtThemValuesAndGradients) {
  for (const ModelOptions& m : {Fp64Model(), Fp64Grouped(), Fp64GroupedRotary()})
  for (bool deferred : {false, true}) {
    SCOPED_TRACE(deferred ? "weight gradients deferred" : "fused");
    SCOPED_TRACE(m.query_groups() == m.num_attention_heads ? "multi-head" : "grouped-query");
    SCOPED_TRACE(m.position_embedding == PositionEmbedding::kRotary ? "rotary" : "learned");
    TransformerLayer layer(m, /*layer_index=*/1);
    const int64_t s = m.seq_length, b = 3, h = m.hidden_size;
    const at::Tensor index = SomePositions(s, b, 7);
    const int64_t k = index.size(0);
    ASSERT_LT(k, s) << "a subset";
    ASSERT_GT(k, 32) << "three query chunks";
    at::manual_seed(2);
    const at::Tensor x0 = at::randn({s, b, h}, at::kDouble);
    const at::Tensor upstream = at::randn({k, b, h}, at::kDouble);
    ForwardContext ctx{true, 1, 0, 0.0};

    // Reference: the whole layer, then the rows of `index`.
    at::Tensor x_ref = x0.clone().requires_grad_(true);
    const at::Tensor want =
        layer.Residual(x_ref, ctx).gather(0, index.unsqueeze(-1).expand({k, b, h}));
    (want * upstream).sum().backward();
    const auto want_grads = LayerGrads(layer);

    at::Tensor x = x0.clone().requires_grad_(true);
    WeightGradStore store;
    at::Tensor got;
    {
      WeightGradStore::Scope scope(deferred ? &store : nullptr);
      got = layer.ResidualAt(x, index, ctx);
      (got * upstream).sum().backward();
    }
    if (deferred) {
      EXPECT_GT(store.size(), 0u) << "the QKV rows' weight gradients wait for W";
      EXPECT_FALSE(layer.FindParameter("self_attention.linear_qkv.weight")->value.grad().defined());
      store.Flush();
    }
    const auto got_grads = LayerGrads(layer);
    EXPECT_LT(MaxAbsDiff(got, want), 1e-12);
    EXPECT_LT(MaxAbsDiff(x.grad(), x_ref.grad()), 1e-12) << "input gradient: every token, as key and value";
    for (const auto& [name, g] : want_grads) {
      EXPECT_LT(MaxAbsDiff(got_grads.at(name), g), 1e-12) << name;
    }
    EXPECT_GT(want_grads.at("self_attention.linear_qkv.weight").abs().sum().item<double>(), 0);
  }
}

// Rotary positions of a subset (Mixture-of-Depths): only the distances between positions
// matter, so shifting every position alike changes nothing; positions 0..s−1 given
// explicitly are the default bit for bit; the subset's own positions are not 0..k−1's.
TEST(ResidualAtTest, RotaryPositionsOfASubset) {
  const ModelOptions m = Fp64GroupedRotary();
  TransformerLayer layer(m, /*layer_index=*/1);
  const int64_t s = 20, b = 2;
  at::manual_seed(4);
  const at::Tensor x = at::randn({s, b, m.hidden_size}, at::kDouble);
  at::NoGradGuard no_grad;
  ForwardContext plain{false};
  ForwardContext given{false};
  given.rotary_positions = at::arange(s, at::kLong).unsqueeze(1).expand({s, b});
  EXPECT_TRUE(at::equal(layer.Residual(x, given), layer.Residual(x, plain)));
  const at::Tensor spread = (at::arange(s, at::kLong) * 3 + 1).unsqueeze(1).expand({s, b});
  ForwardContext at_spread{false}, shifted{false};
  at_spread.rotary_positions = spread;
  shifted.rotary_positions = spread + 17;
  EXPECT_LT(MaxAbsDiff(layer.Residual(x, at_spread), layer.Residual(x, shifted)), 1e-10);
  EXPECT_GT(MaxAbsDiff(layer.Residual(x, at_spread), layer.Residual(x, plain)), 1e-5);
}

TEST(LinearRowsForwardTest, EqualsTheProductWithTheSelectedRows) {
  at::manual_seed(3);
  const at::Tensor w0 = at::randn({6, 4}, at::kDouble);
  const at::Tensor b0 = at::randn({6}, at::kDouble);
  const at::Tensor x = at::randn({5, 4}, at::kDouble);
  const at::Tensor rows = at::tensor({4, 1, 2}, at::kLong);
  const at::Tensor upstream = at::randn({5, 3}, at::kDouble);
  at::Tensor w = w0.clone().requires_grad_(true), bias = b0.clone().requires_grad_(true);
  at::Tensor w_ref = w0.clone().requires_grad_(true), b_ref = b0.clone().requires_grad_(true);
  const at::Tensor got = LinearRowsForward(x, w, bias, rows);
  const at::Tensor want = at::linear(x, w_ref.index_select(0, rows), b_ref.index_select(0, rows));
  (got * upstream).sum().backward();
  (want * upstream).sum().backward();
  EXPECT_LT(MaxAbsDiff(got, want), 1e-12);
  EXPECT_LT(MaxAbsDiff(w.grad(), w_ref.grad()), 1e-12);
  EXPECT_LT(MaxAbsDiff(bias.grad(), b_ref.grad()), 1e-12);
  EXPECT_EQ(w.grad()[0].abs().sum().item<double>(), 0.0) << "rows not selected get no gradient";
}

}  // namespace
}  // namespace fulcrum
