// The sparse_attention plugin (plugins/sparse_attention.cc) in one process: with one bucket
// it is the dense causal attention of the layer; with many it is the dense attention under
// the bucket mask (NOTE [sparse attention mask]), forward and gradients, and its gradients
// match finite differences; it computes only the block pairs the buckets imply, far fewer
// than dense; a head hashes alike whichever tensor-parallel rank holds it.
#include <ATen/ATen.h>
#include <gflags/gflags.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/plugin.h"
#include "core/transformer_layer.h"
#include "core/unit.h"
#include "gtest/gtest.h"
#include "plugins/plugin_registry.h"
#include "tests/core/test_util.h"

DECLARE_int64(sparse_attention_buckets);
DECLARE_int64(sparse_attention_window);
DECLARE_int64(sparse_attention_block);
DECLARE_int64(sparse_attention_seed);

namespace fulcrum::plugins {
namespace {

constexpr char kRotations[] = "sparse_attention.rotations";

ModelOptions SmallAttentionModel() { return testing::SmallModelOf(2, 64); }  // head_dim 8

std::shared_ptr<PluginSet> BuildSparse(int64_t buckets, int64_t window, int64_t block,
                                 const ModelOptions& model = SmallAttentionModel()) {
  gflags::FlagSaver saver;
  FLAGS_sparse_attention_buckets = buckets;
  FLAGS_sparse_attention_window = window;
  FLAGS_sparse_attention_block = block;
  PluginSetup setup;
  setup.model = model;
  auto set = MakePlugins({"sparse_attention"}, setup);
  EXPECT_TRUE(set.ok()) << set.status();
  return *set;
}

// The buckets of x [b, heads, s, d] for global heads first.. from a rotation buffer,
// written from the definition (NOTE [sparse attention hashing]).
at::Tensor BucketsOf(const at::Tensor& x, const at::Tensor& rotations, int64_t first,
                     int64_t buckets) {
  if (buckets == 1) return at::zeros({x.size(0), x.size(1), x.size(2)}, at::kLong);
  at::Tensor r = rotations.narrow(0, first, x.size(1)).to(x.scalar_type());
  at::Tensor proj = at::einsum("bhsd,hdc->bhsc", {x, r});
  if (buckets % 2 == 0) proj = at::cat({proj, -proj}, -1);
  return proj.argmax(-1);
}

// Dense causal attention under the mask: j ≤ i and (same bucket, i − j < window or j = i).
at::Tensor Reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& bq, const at::Tensor& bk, int64_t window) {
  const int64_t s = q.size(2);
  const at::Tensor i = at::arange(s).unsqueeze(1), j = at::arange(s).unsqueeze(0);
  const at::Tensor allowed =
      j.le(i) & (bq.unsqueeze(-1).eq(bk.unsqueeze(-2)) | (i - j).lt(window) | i.eq(j));
  const at::Tensor scores =
      at::matmul(q / std::sqrt(double(q.size(3))), k.transpose(-2, -1))
          .masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), v);
}

struct Inputs {
  at::Tensor q, k, v;
};

Inputs RandomInputs(int64_t b, int64_t heads, int64_t s, int64_t d, at::ScalarType dtype,
                    int seed) {
  at::manual_seed(seed);
  auto make = [&] {
    return at::randn({b, heads, s, d}, at::kDouble).to(dtype).requires_grad_(true);
  };
  Inputs in;
  in.q = make();
  in.k = make();
  in.v = make();
  return in;
}

TEST(SparseAttentionTest, OneBucketIsTheDenseCausalAttentionOfTheLayer) {
  const ModelOptions options = SmallAttentionModel();
  auto plugins = BuildSparse(/*buckets=*/1, /*window=*/0, /*block=*/16);
  TransformerLayer dense(options, 1);
  TransformerLayer sparse(options, 1, nullptr, true, plugins.get());
  ASSERT_NE(sparse.attention_core(), nullptr);
  ASSERT_EQ(dense.attention_core(), nullptr);
  at::manual_seed(3);
  const at::Tensor hidden = at::randn({40, 2, options.hidden_size});  // s = 40: a partial block
  ForwardContext ctx;
  const at::Tensor out_dense = dense.Forward(hidden, ctx);
  const at::Tensor out_sparse = sparse.Forward(hidden, ctx);
  EXPECT_TRUE(at::allclose(out_sparse, out_dense, 1e-5, 1e-6))
      << (out_sparse - out_dense).abs().max().item<double>();
  const at::Tensor w = at::randn(out_dense.sizes());
  (out_dense * w).sum().backward();
  (out_sparse * w).sum().backward();
  for (size_t i = 0; i < dense.parameters().size(); ++i) {
    const Parameter& pd = dense.parameters()[i];
    const Parameter& ps = *sparse.FindParameter(pd.name);
    EXPECT_TRUE(at::allclose(ps.value.grad(), pd.value.grad(), 1e-5, 1e-6))
        << pd.name << " " << (ps.value.grad() - pd.value.grad()).abs().max().item<double>();
  }
  // The core reports its work: 3 blocks of 16 rows per sequence, causal: 6 block pairs.
  EXPECT_EQ(sparse.Load(), 2.0 * 4 * 6 * 16 * 16);
}

TEST(SparseAttentionTest, ManyBucketsAreTheDenseAttentionUnderTheBucketMask) {
  for (const auto& [buckets, window, block] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {4, 0, 8}, {4, 5, 8}, {3, 0, 16}, {8, 2, 7}, {2, 0, 64}}) {
    SCOPED_TRACE(absl::StrCat("buckets ", buckets, " window ", window, " block ", block));
    auto plugins = BuildSparse(buckets, window, block);
    Unit unit("layers.0");
    std::unique_ptr<AttentionCore> core = plugins->MakeAttentionCore(0, unit, true);
    ASSERT_NE(core, nullptr);
    const at::Tensor rotations = unit.FindBuffer(kRotations);
    ASSERT_TRUE(rotations.defined());
    Inputs a = RandomInputs(2, 4, 50, 8, at::kFloat, 11);
    Inputs r = RandomInputs(2, 4, 50, 8, at::kFloat, 11);
    const at::Tensor bq = BucketsOf(a.q.detach(), rotations, 0, buckets);
    const at::Tensor bk = BucketsOf(a.k.detach(), rotations, 0, buckets);
    // The buckets are really used: several of them are non-empty.
    EXPECT_GT(std::get<0>(at::_unique(bq)).numel(), 1);
    const at::Tensor out = core->Forward(a.q, a.k, a.v, ForwardContext());
    const at::Tensor expected = Reference(r.q, r.k, r.v, bq, bk, window);
    EXPECT_TRUE(at::allclose(out, expected, 1e-5, 1e-6))
        << (out - expected).abs().max().item<double>();
    const at::Tensor w = at::randn(out.sizes());
    (out * w).sum().backward();
    (expected * w).sum().backward();
    for (auto [got, want, name] : {std::make_tuple(a.q.grad(), r.q.grad(), "q"),
                                   std::make_tuple(a.k.grad(), r.k.grad(), "k"),
                                   std::make_tuple(a.v.grad(), r.v.grad(), "v")}) {
      EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5))
          << name << " " << (got - want).abs().max().item<double>();
    }
  }
}

// NOTE [sparse attention mixed precision]: bf16 queries, keys and values are hashed and
// attended in fp32 — the output is the fp32 reference on the widened values (the dense
// attention under the fp32 hash's mask) rounded to bf16 — and the gradients come back bf16.
// The check is sensitive to the hash's precision: hashing the bf16 values with a bf16
// product (rotations rounded to bf16) puts some tokens in other buckets, which changes
// their attention far beyond bf16 rounding.
TEST(SparseAttentionTest, Bf16TokensAreHashedAndAttendedInFp32) {
  auto plugins = BuildSparse(/*buckets=*/8, /*window=*/0, /*block=*/8);
  Unit unit("layers.0");
  std::unique_ptr<AttentionCore> core = plugins->MakeAttentionCore(0, unit, true);
  const at::Tensor rotations = unit.FindBuffer(kRotations);
  ASSERT_EQ(rotations.scalar_type(), at::kFloat);
  Inputs in = RandomInputs(2, 4, 64, 8, at::kBFloat16, 13);
  const at::Tensor q = in.q.detach().to(at::kFloat), k = in.k.detach().to(at::kFloat),
                   v = in.v.detach().to(at::kFloat);
  const at::Tensor bq = BucketsOf(q, rotations, 0, 8), bk = BucketsOf(k, rotations, 0, 8);
  const at::Tensor bq_bf16 = BucketsOf(in.q.detach(), rotations, 0, 8);
  ASSERT_FALSE(at::equal(bq, bq_bf16)) << "the data must tell the two hashes apart";
  const at::Tensor out = core->Forward(in.q, in.k, in.v, ForwardContext());
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  const at::Tensor expected = Reference(q, k, v, bq, bk, /*window=*/0);
  // bf16 rounding of the output: half a step of 2^-8 relative, plus the fp32 difference
  // between the block computation and the dense reference (1e-6 at these magnitudes).
  const at::Tensor error = (out.to(at::kFloat) - expected).abs();
  const at::Tensor bound = expected.abs() * std::ldexp(1.0, -8) + 1e-5;
  EXPECT_TRUE(error.le(bound).all().item<bool>()) << (error - bound).max().item<double>();
  const at::Tensor misplaced = Reference(q, k, v, bq_bf16, BucketsOf(in.k.detach(), rotations, 0, 8), 0);
  EXPECT_FALSE((out.to(at::kFloat) - misplaced).abs().le(bound).all().item<bool>())
      << "the bf16 hash's mask gives a different attention";
  out.to(at::kFloat).square().sum().backward();
  for (const at::Tensor& t : {in.q, in.k, in.v}) {
    ASSERT_TRUE(t.grad().defined());
    EXPECT_EQ(t.grad().scalar_type(), at::kBFloat16);
  }
}

TEST(SparseAttentionTest, GradientsMatchFiniteDifferencesInDouble) {
  auto plugins = BuildSparse(/*buckets=*/4, /*window=*/2, /*block=*/4);
  Unit unit("layers.0");
  std::unique_ptr<AttentionCore> core = plugins->MakeAttentionCore(0, unit, true);
  Inputs in = RandomInputs(1, 2, 10, 8, at::kDouble, 5);
  at::manual_seed(6);
  const at::Tensor w = at::randn({1, 2, 10, 8}, at::kDouble);
  auto loss = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return (core->Forward(q, k, v, ForwardContext()) * w).sum();
  };
  loss(in.q, in.k, in.v).backward();
  const double eps = 1e-6;
  at::NoGradGuard no_grad;
  double worst = 0;
  for (int which = 0; which < 3; ++which) {
    at::Tensor x = (which == 0 ? in.q : which == 1 ? in.k : in.v).detach().clone();
    const at::Tensor grad = (which == 0 ? in.q : which == 1 ? in.k : in.v).grad();
    at::Tensor flat = x.view(-1);
    for (int64_t e = 0; e < flat.numel(); ++e) {
      const double saved = flat[e].item<double>();
      auto at_value = [&](double value) {
        flat[e] = value;
        const at::Tensor q = which == 0 ? x : in.q.detach();
        const at::Tensor k = which == 1 ? x : in.k.detach();
        const at::Tensor v = which == 2 ? x : in.v.detach();
        return loss(q, k, v).item<double>();
      };
      const double numeric = (at_value(saved + eps) - at_value(saved - eps)) / (2 * eps);
      flat[e] = saved;
      worst = std::max(worst, std::abs(numeric - grad.view(-1)[e].item<double>()));
    }
  }
  EXPECT_LT(worst, 1e-7);
}

TEST(SparseAttentionTest, OnlyTheBlockPairsTheBucketsImplyAreComputed) {
  const int64_t s = 256, d = 16, heads = 4, block = 16, buckets = 4;
  ModelOptions model = SmallAttentionModel();
  model.hidden_size = heads * d;
  auto plugins = BuildSparse(buckets, /*window=*/0, block, model);
  Unit unit("layers.0");
  std::unique_ptr<AttentionCore> core = plugins->MakeAttentionCore(0, unit, true);
  Inputs in = RandomInputs(1, heads, s, d, at::kFloat, 9);
  core->Forward(in.q, in.k, in.v, ForwardContext());
  // The pairs of blocks of the (bucket, position)-sorted queries and keys that hold an
  // allowed same-bucket pair, counted by brute force.
  const at::Tensor rotations = unit.FindBuffer(kRotations);
  const at::Tensor bq = BucketsOf(in.q.detach(), rotations, 0, buckets)[0];
  const at::Tensor bk = BucketsOf(in.k.detach(), rotations, 0, buckets)[0];
  int64_t expected_blocks = 0;
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor pos = at::arange(s);
    const at::Tensor qkey = std::get<0>((bq[h] * s + pos).sort());
    const at::Tensor kkey = std::get<0>((bk[h] * s + pos).sort());
    const at::Tensor qb = qkey.div(s, "floor"), qp = qkey.remainder(s);
    const at::Tensor kb = kkey.div(s, "floor"), kp = kkey.remainder(s);
    const at::Tensor allowed =
        qb.unsqueeze(1).eq(kb.unsqueeze(0)) & kp.unsqueeze(0).le(qp.unsqueeze(1));
    expected_blocks +=
        allowed.view({s / block, block, s / block, block}).any(3).any(1).sum().item<int64_t>();
  }
  // Blocks × block² scores, and the diagonal band (one key per query).
  EXPECT_EQ(core->Load(), static_cast<double>(expected_blocks * block * block + heads * s));
  const double dense = static_cast<double>(heads * s * s);
  std::cout << "4 buckets: " << expected_blocks << " blocks, load " << core->Load() << " of dense "
            << dense << " (" << core->Load() / dense << ")" << std::endl;
  EXPECT_LT(core->Load(), 0.3 * dense) << "4 buckets compute well under the dense scores";
  // One bucket: every causal block pair.
  auto dense_plugins = BuildSparse(1, 0, block, model);
  Unit unit1("layers.0");
  std::unique_ptr<AttentionCore> one = dense_plugins->MakeAttentionCore(0, unit1, true);
  one->Forward(in.q, in.k, in.v, ForwardContext());
  const int64_t nblk = s / block;
  EXPECT_EQ(one->Load(), static_cast<double>(heads * nblk * (nblk + 1) / 2 * block * block));
}

TEST(SparseAttentionTest, AHeadHashesAlikeWhicheverTensorParallelRankHoldsIt) {
  auto plugins = BuildSparse(/*buckets=*/4, /*window=*/0, /*block=*/8);
  Unit whole("layers.1", 0, 1), second_half("layers.1", 1, 2), other_layer("layers.0", 0, 1);
  Unit shell("layers.1", 1, 2);
  std::unique_ptr<AttentionCore> core_whole = plugins->MakeAttentionCore(1, whole, true);
  std::unique_ptr<AttentionCore> core_half = plugins->MakeAttentionCore(1, second_half, true);
  plugins->MakeAttentionCore(0, other_layer, true);
  plugins->MakeAttentionCore(1, shell, /*initialize=*/false);
  EXPECT_TRUE(at::equal(whole.FindBuffer(kRotations), second_half.FindBuffer(kRotations)));
  EXPECT_TRUE(at::equal(whole.FindBuffer(kRotations), shell.FindBuffer(kRotations)));
  EXPECT_FALSE(at::equal(whole.FindBuffer(kRotations), other_layer.FindBuffer(kRotations)));
  // Heads 2 and 3 on rank 1 of tp 2 compute what they compute among all four heads.
  Inputs in = RandomInputs(2, 4, 48, 8, at::kFloat, 13);
  const at::Tensor all = core_whole->Forward(in.q, in.k, in.v, ForwardContext());
  const at::Tensor half = core_half->Forward(in.q.narrow(1, 2, 2), in.k.narrow(1, 2, 2),
                                             in.v.narrow(1, 2, 2), ForwardContext());
  EXPECT_TRUE(at::allclose(half, all.narrow(1, 2, 2), 1e-6, 1e-7));
  // And the buckets are those of the global heads 2 and 3, not of the local 0 and 1.
  const at::Tensor rotations = whole.FindBuffer(kRotations);
  const at::Tensor global = BucketsOf(in.q.narrow(1, 2, 2).detach(), rotations, 2, 4);
  const at::Tensor local = BucketsOf(in.q.narrow(1, 2, 2).detach(), rotations, 0, 4);
  EXPECT_FALSE(at::equal(global, local)) << "the heads' rotations differ";
}

TEST(SparseAttentionTest, BadFlagsAreRefusedNamingTheFlag) {
  PluginSetup setup;
  setup.model = SmallAttentionModel();
  auto refused = [&](const char* flag, int64_t value) {
    gflags::FlagSaver saver;
    gflags::SetCommandLineOption(flag, std::to_string(value).c_str());
    absl::Status s = ValidatePlugins({"sparse_attention"}, setup);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(std::string(s.message()).find(std::string("--") + flag), std::string::npos) << s;
  };
  refused("sparse_attention_buckets", 0);
  refused("sparse_attention_window", -1);
  refused("sparse_attention_block", 0);
  setup.model.attention_dropout = 0.1;
  absl::Status s = ValidatePlugins({"sparse_attention"}, setup);
  EXPECT_NE(std::string(s.message()).find("--attention_dropout"), std::string::npos) << s;
}

}  // namespace
}  // namespace fulcrum::plugins
