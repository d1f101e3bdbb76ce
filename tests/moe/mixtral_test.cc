// Mixtral-style MoE against Hugging Face transformers' MixtralSparseMoeBlock, computed here
// by hand: the `mixtral` router (fp32 softmax over all experts, top-k, weights renormalised
// to sum 1), SwiGLU experts with interleaved gate/up rows (NOTE [SwiGLU rows]) and no
// biases (--disable_bias_linear), dropless capacity; and HF's load_balancing_loss_func for
// one layer as the router's auxiliary loss. The hand references are plain loops over tokens
// and experts that share no code with the router, capacity, dispatch or expert paths.
//
// Negative controls (checked to fail the tolerance, in the tests themselves): a reference
// that does not renormalise the top-k weights, one that reads gate and up as the two
// contiguous halves of fc1 (HF v5's fused gate_up_proj order) instead of interleaved rows,
// and the Megatron/Switch loss of `topk` (k times smaller than HF's).
//
// The layer was also compared once with transformers 5.24's MixtralSparseMoeBlock itself
// (fp32, E = 4, k = 2, 32 tokens, fc1 rows de-interleaved into gate_up_proj): output, aux
// loss and its router gradient were bit-identical. That check needs Python and is not part
// of this suite.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/transformer_layer.h"
#include "core/unit.h"
#include "moe/aux_losses.h"
#include "moe/moe_layer.h"
#include "tests/moe/moe_layer_test_util.h"
#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::AuxLoss;
using testing::Doubles;
using testing::Eval;
using testing::ExpectNear;
using testing::HandHidden;
using testing::Longs;
using testing::MakeOrDie;
using testing::ParamOf;
using testing::SetParam;
using testing::TakeGrads;
using testing::TinyOptions;

constexpr int64_t kMixtralExperts = 4;
constexpr int64_t kMixtralHidden = 8;
constexpr int64_t kMixtralFfn = 6;
constexpr int64_t kTopK = 2;
constexpr double kAuxCoeff = 0.02;  // Mixtral's router_aux_loss_coef is 0.001/0.02 in configs

ModelOptions MixtralModel() {
  ModelOptions m;
  m.hidden_size = kMixtralHidden;
  m.num_attention_heads = 2;
  m.ffn_hidden_size = 32;
  m.num_layers = 2;
  m.seed = 11;
  m.swiglu = true;
  m.add_bias_linear = false;
  return m;
}

MoeOptions MixtralOptions(const std::string& router = "mixtral") {
  MoeOptions o;
  o.num_experts = kMixtralExperts;
  o.topk = kTopK;
  o.ffn_hidden_size = kMixtralFfn;
  o.router = router;
  o.capacity_factor = 0.0;  // dropless (moe/capacity.h): C = the largest expert load
  o.router_options.aux_loss_coeff = kAuxCoeff;
  o.router_options.z_loss_coeff = 0.0;  // Mixtral has none
  return o;
}

using Built = testing::BuiltMoe;

Built BuildMixtral(const MoeOptions& options, const ModelOptions& model, at::ScalarType dtype) {
  return testing::BuildMoe(options, model, /*layer=*/0, dtype);
}

// max |a − b| / max |b|.
double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

enum class Variant { kHf, kNoRenormalisation, kContiguousGateUp };

// HF's MixtralSparseMoeBlock token by token from the unit's parameters: softmax over all E
// (from exp), the k largest probabilities (by sorting), renormalised to sum 1, and
// Σ w · W2·(silu(W1_gate·x) ⊙ W1_up·x) with silu(z) = z·σ(z). Differentiable.
at::Tensor HandMixtral(Unit& unit, const at::Tensor& tokens, int64_t k, Variant variant) {
  const at::Tensor& router = ParamOf(unit, "mlp.router.weight");  // [E, D]
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < tokens.size(0); ++t) {
    const at::Tensor x = tokens[t];
    const at::Tensor logits = at::mv(router, x);
    const at::Tensor exp = (logits - logits.max().detach()).exp();
    const at::Tensor p = exp / exp.sum();
    const std::vector<double> pv = Doubles(p);
    std::vector<int64_t> order(pv.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pv[a] > pv[b]; });
    at::Tensor kept = p[order[0]];
    for (int64_t j = 1; j < k; ++j) kept = kept + p[order[j]];
    at::Tensor y = at::zeros({tokens.size(1)}, tokens.options());
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j];
      const std::string prefix = absl::StrCat("mlp.experts.", e, ".");
      const at::Tensor& w1 = ParamOf(unit, prefix + "linear_fc1.weight");  // [2F, D]
      const at::Tensor& w2 = ParamOf(unit, prefix + "linear_fc2.weight");  // [D, F]
      const int64_t f = w1.size(0) / 2;
      at::Tensor gate, up;
      if (variant == Variant::kContiguousGateUp) {
        gate = at::mv(w1.narrow(0, 0, f), x);
        up = at::mv(w1.narrow(0, f, f), x);
      } else {  // row 2j = gate_j, row 2j+1 = up_j
        gate = at::mv(w1.slice(0, 0, 2 * f, 2), x);
        up = at::mv(w1.slice(0, 1, 2 * f, 2), x);
      }
      const at::Tensor h = gate * at::sigmoid(gate) * up;
      const at::Tensor weight = variant == Variant::kNoRenormalisation ? p[e] : p[e] / kept;
      y = y + weight * at::mv(w2, h);
    }
    rows.push_back(y);
  }
  return at::stack(rows);
}

// HF's load_balancing_loss_func for one layer's logits [T, E], literally: softmax, top-k
// indices, one_hot → mean over tokens [k, E], mean probabilities [E],
// E · Σ tokens_per_expert · P.
at::Tensor HandHfAuxLoss(const at::Tensor& logits, int64_t k) {
  const int64_t num_experts = logits.size(1);
  const at::Tensor probs = at::softmax(logits, -1);
  const at::Tensor selected = std::get<1>(at::topk(probs, k, -1));               // [T, k]
  const at::Tensor mask = at::one_hot(selected, num_experts).to(probs.dtype());  // [T, k, E]
  const at::Tensor tokens_per_expert = mask.mean(0);                             // [k, E]
  const at::Tensor prob_per_expert = probs.mean(0);                              // [E]
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts);
}

// Makes the routing of positive tokens unequal: expert 0's logit gains Σx, so it is every
// token's first choice (x in [0.1, 1.1), the initial router weight of std 0.02). At equal
// loads HF's loss has no gradient (E/T·Σ load·∇P_i = c·∇ΣP_i = 0), and a gradient check
// would compare round-off.
void FavourExpertZero(at::Tensor& router_weight) {
  at::NoGradGuard no_grad;
  router_weight[0].add_(1.0);
}

// ---- The router. ------------------------------------------------------------------------

// The hand example of moe_test_util.h: for k = 2 the gates are topk's, the loss k times its
// (HF's f divides by T, Megatron's by T·k); for k = 1 every gate is 1.
TEST(MixtralRouterTest, HandExample) {
  RouterOptions options = TinyOptions(3, 3, 2);
  options.aux_loss_coeff = 0.01;
  options.z_loss_coeff = 0.0;
  auto router = MakeOrDie("mixtral", options);
  SetParam(*router, "router.weight", at::eye(3));
  Routing r = router->Route(HandHidden(), 2, Eval());
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  ExpectNear(Doubles(r.gate),
             {5.0 / 8, 2.0 / 3, 13.0 / 18, 7.0 / 9, 3.0 / 8, 1.0 / 3, 5.0 / 18, 2.0 / 9}, 1e-6);
  // loads (3, 3, 2), P = (.3875, .3, .3125): E·Σ (load/T)·P = 3·2.6875/4 = 2.015625.
  EXPECT_NEAR(AuxLoss(r, "load_balancing_loss"), 0.01 * 2.015625, 1e-8);
  EXPECT_EQ(r.aux_losses.size(), 1u) << "no z-loss at coefficient 0";

  Routing top1 = router->Route(HandHidden(), 1, Eval());
  EXPECT_EQ(Longs(top1.expert), (std::vector<int64_t>{0, 1, 2, 0}));
  ExpectNear(Doubles(top1.gate), {1, 1, 1, 1}, 0);  // renormalised over one: HF's, not p
  // loads (2, 1, 1): 3·(2·.3875 + .3 + .3125)/4 = 1.040625 (Switch's value at k = 1).
  EXPECT_NEAR(AuxLoss(top1, "load_balancing_loss"), 0.01 * 1.040625, 1e-8);
}

// For k > 1, `topk` already routes exactly as HF's Mixtral: same experts, bit-identical
// gates. Only the loss differs, by the factor k.
TEST(MixtralRouterTest, GatesAreTopKsForKAboveOneAndTheLossIsKTimesIt) {
  for (int64_t k : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("k=", k));
    RouterOptions options = TinyOptions(5, 7, k);
    auto mixtral = MakeOrDie("mixtral", options);
    auto topk = MakeOrDie("topk", options);  // the same key: the same initial weight
    const at::Tensor hidden = at::randn({12, 7});
    Routing a = mixtral->Route(hidden, k, Eval());
    Routing b = topk->Route(hidden, k, Eval());
    EXPECT_TRUE(a.expert.equal(b.expert));
    EXPECT_TRUE(a.gate.equal(b.gate));
    EXPECT_NEAR(AuxLoss(a, "load_balancing_loss"), k * AuxLoss(b, "load_balancing_loss"), 1e-7);
  }
}

// The router's loss is HF's load_balancing_loss_func of its own logits, value and gradient.
TEST(MixtralAuxLossTest, EqualsHfsFormulaByHandWithItsGradient) {
  RouterOptions options = TinyOptions(kMixtralExperts, kMixtralHidden, kTopK);
  options.aux_loss_coeff = kAuxCoeff;
  auto router = MakeOrDie("mixtral", options);
  testing::ToDouble(*router);
  at::Tensor& weight = testing::Param(*router, "router.weight");
  FavourExpertZero(weight);
  const at::Tensor hidden = at::rand({16, kMixtralHidden}, at::kDouble) + 0.1;
  Routing r = router->Route(hidden, kTopK, Eval());
  ASSERT_GT(r.expert_load.max().item<int64_t>(), r.expert_load.min().item<int64_t>() + 2)
      << "unequal loads";
  ASSERT_EQ(r.aux_losses.size(), 1u);
  const at::Tensor got = r.aux_losses[0].second;
  got.backward();
  const at::Tensor got_grad = weight.grad().clone();
  weight.mutable_grad() = at::Tensor();

  const at::Tensor expected = HandHfAuxLoss(at::linear(hidden, weight), kTopK) * kAuxCoeff;
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-15);
  expected.backward();
  EXPECT_LE(RelativeError(got_grad, weight.grad()), 1e-12);
  // Negative control: Megatron/Switch's loss (topk's) is 1/k of HF's — far outside.
  const at::Tensor megatron = LoadBalancingLoss(r.probs, r.expert_load, kTopK) * kAuxCoeff;
  EXPECT_GT(std::abs(megatron.item<double>() - expected.item<double>()),
            0.4 * expected.item<double>());
}

// ---- The layer: SwiGLU experts without biases behind the mixtral router. -----------------

TEST(MixtralLayerTest, ParametersAreInterleavedFc1AndNoBiases) {
  Built b = BuildMixtral(MixtralOptions(), MixtralModel(), at::kFloat);
  ASSERT_NE(b.block, nullptr);
  std::vector<std::string> names;
  for (const Parameter& p : b.unit->parameters()) names.push_back(p.name);
  EXPECT_EQ(names.size(), 1u + 2 * kMixtralExperts) << "router and two weights per expert";
  for (const std::string& name : names) {
    EXPECT_EQ(name.find(".bias"), std::string::npos) << name;
  }
  EXPECT_EQ(ParamOf(*b.unit, "mlp.experts.3.linear_fc1.weight").sizes(),
            (std::vector<int64_t>{2 * kMixtralFfn, kMixtralHidden}));
  EXPECT_EQ(ParamOf(*b.unit, "mlp.experts.3.linear_fc2.weight").sizes(),
            (std::vector<int64_t>{kMixtralHidden, kMixtralFfn}));
  EXPECT_EQ(ParamOf(*b.unit, "mlp.router.weight").sizes(), (std::vector<int64_t>{kMixtralExperts, kMixtralHidden}));
  // With biases (SwiGLU): fc1's bias has the 2F interleaved rows.
  ModelOptions biased = MixtralModel();
  biased.add_bias_linear = true;
  Built c = BuildMixtral(MixtralOptions(), biased, at::kFloat);
  EXPECT_EQ(ParamOf(*c.unit, "mlp.experts.0.linear_fc1.bias").sizes(), (std::vector<int64_t>{2 * kMixtralFfn}));
  EXPECT_EQ(ParamOf(*c.unit, "mlp.experts.0.linear_fc2.bias").sizes(), (std::vector<int64_t>{kMixtralHidden}));
}

// Output and every gradient equal the hand reference: 1e-12 relative in fp64, 1e-6 in fp32.
// Both layer paths (padded buffers and per-expert buffers) are checked.
TEST(MixtralLayerTest, MatchesHfsBlockByHand) {
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    for (bool per_expert : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c10::toString(dtype), per_expert ? ", per-expert buffers" : ", padded"));
      const double tolerance = dtype == at::kDouble ? 1e-12 : 1e-6;
      MoeOptions options = MixtralOptions();
      options.per_expert_capacity = per_expert;
      Built b = BuildMixtral(options, MixtralModel(), dtype);
      const at::Tensor x = at::randn({5, 3, kMixtralHidden}, dtype).set_requires_grad(true);  // [s, b, h]
      const at::Tensor weight = at::randn({5, 3, kMixtralHidden}, dtype);
      const at::Tensor out = b.block->Forward(x, ForwardContext{/*training=*/false, 1, 0});
      ASSERT_EQ(out.scalar_type(), dtype);
      (out * weight).sum().backward();
      const at::Tensor x_grad = x.grad().clone();
      x.mutable_grad() = at::Tensor();
      auto grads = TakeGrads(*b.unit);

      const at::Tensor tokens = x.view({-1, kMixtralHidden});
      const at::Tensor expected = HandMixtral(*b.unit, tokens, kTopK, Variant::kHf);
      EXPECT_LE(RelativeError(out.view({-1, kMixtralHidden}).detach(), expected.detach()), tolerance);
      (expected.view(x.sizes()) * weight).sum().backward();
      EXPECT_LE(RelativeError(x_grad, x.grad()), tolerance * 10);
      auto expected_grads = TakeGrads(*b.unit);
      for (const auto& [name, g] : grads) {
        if (expected_grads.count(name) == 0) {
          // An expert no token chose (the padded path still multiplies its zero rows).
          EXPECT_EQ(g.abs().max().item<double>(), 0.0) << name;
          continue;
        }
        EXPECT_LE(RelativeError(g, expected_grads[name]), tolerance * 10) << name;
      }
      for (const auto& [name, g] : expected_grads) EXPECT_TRUE(grads.count(name)) << name;
      // Negative controls: each deliberate mistake is far outside the tolerance.
      for (Variant broken : {Variant::kNoRenormalisation, Variant::kContiguousGateUp}) {
        at::NoGradGuard no_grad;
        EXPECT_GT(RelativeError(out.view({-1, kMixtralHidden}).detach(),
                                HandMixtral(*b.unit, tokens, kTopK, broken)),
                  1e-2)
            << "variant " << static_cast<int>(broken);
      }
    }
  }
}

// In training the layer adds router_aux_loss_coef · HF's aux_loss to the loss: its
// reported value is HF's formula by hand, and with loss_scale = 1/T (one micro-batch of T
// tokens is the global batch) the router's gradient from it is that formula's gradient.
// One MoE layer: exact (NOTE [Mixtral aux loss across layers] for more).
TEST(MixtralLayerTest, TrainingAddsHfsAuxLossForOneLayer) {
  Built b = BuildMixtral(MixtralOptions(), MixtralModel(), at::kDouble);
  at::Tensor& router = ParamOf(*b.unit, "mlp.router.weight");
  FavourExpertZero(router);
  const at::Tensor x = at::rand({4, 3, kMixtralHidden}, at::kDouble) + 0.1;
  const int64_t t = 12;
  ForwardContext ctx{/*training=*/true, 1, 0, /*loss_scale=*/1.0 / t};
  // Times 0: the router's whole gradient comes from the auxiliary loss.
  (b.block->Forward(x, ctx) * 0.0).sum().backward();
  const at::Tensor got_grad = router.grad().clone();
  b.unit->ZeroGrad();
  b.block->AfterOptimizerStep();
  double reported = -1;
  std::vector<double> loads;
  for (const BlockStatistic& s : b.block->Statistics()) {
    if (s.name == "load_balancing_loss") reported = s.values.at(0);
    if (s.name == "expert_tokens") loads = s.values;
  }
  ASSERT_EQ(loads.size(), static_cast<size_t>(kMixtralExperts));
  ASSERT_GT(*std::max_element(loads.begin(), loads.end()),
            *std::min_element(loads.begin(), loads.end()) + 2)
      << "unequal loads";
  const at::Tensor expected = HandHfAuxLoss(at::linear(x.view({-1, kMixtralHidden}), router), kTopK) * kAuxCoeff;
  EXPECT_NEAR(reported, expected.item<double>(), 1e-14);
  expected.backward();
  EXPECT_LE(RelativeError(got_grad, router.grad()), 1e-12);
}

// The dropless capacity drops nothing even when the routing is as unequal as it gets (every
// token's first choice is expert 0, its second expert 1).
TEST(MixtralLayerTest, DroplessKeepsEveryToken) {
  Built b = BuildMixtral(MixtralOptions(), MixtralModel(), at::kDouble);
  {
    at::NoGradGuard no_grad;
    at::Tensor& router = ParamOf(*b.unit, "mlp.router.weight");
    // Logits Σx·(1 − e/4): for x > 0 every token ranks the experts 0 > 1 > 2 > 3 (no ties).
    for (int64_t e = 0; e < kMixtralExperts; ++e) router[e].fill_(1.0 - 0.25 * e);
  }
  const at::Tensor x = at::rand({4, 3, kMixtralHidden}, at::kDouble) + 0.1;
  const at::Tensor out = b.block->Forward(x, ForwardContext{true, 1, 0, 1.0 / 12});
  b.block->AfterOptimizerStep();
  std::map<std::string, std::vector<double>> stats;
  for (const BlockStatistic& s : b.block->Statistics()) stats[s.name] = s.values;
  EXPECT_EQ(stats["expert_tokens"], (std::vector<double>{12, 12, 0, 0}));
  EXPECT_EQ(stats["dropped_tokens"].at(0), 0);
  EXPECT_LE(RelativeError(out.view({-1, kMixtralHidden}).detach(),
                          HandMixtral(*b.unit, x.view({-1, kMixtralHidden}), kTopK, Variant::kHf).detach()),
            1e-12);
}

}  // namespace
}  // namespace fulcrum::moe
