// The cosine router (X-MoE / Tutel): cosine logits by hand, scale invariance, temperature
// initialisation and clamping.
#include <gtest/gtest.h>

#include <cmath>

#include "moe/router.h"
#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::Doubles;
using testing::Eval;
using testing::ExpectNear;
using testing::Longs;
using testing::MakeOrDie;
using testing::Param;
using testing::SetParam;
using testing::TinyOptions;
using testing::Training;

// D = 2, projection dimension 2 (identity projection), 3 experts with embeddings of
// different lengths (normalisation removes them): (1, 0), (0, 2), (−3, 0).
std::unique_ptr<Router> HandCosineRouter(int64_t k) {
  RouterOptions options = TinyOptions(3, 2, k);
  options.cosine_projection_dim = 2;
  options.init_temperature = 0.5;
  auto router = MakeOrDie("cosine", options);
  SetParam(*router, "router.projection.weight", at::eye(2));
  SetParam(*router, "router.expert_embeddings",
           at::tensor({1.0f, 0.0f, 0.0f, 2.0f, -3.0f, 0.0f}).reshape({3, 2}));
  return router;
}

// Tokens (3, 4) and (−4, −3): unit vectors (.6, .8) and (−.8, −.6).
at::Tensor HandTokens() { return at::tensor({3.0f, 4.0f, -4.0f, -3.0f}).reshape({2, 2}); }

std::vector<double> Softmax(std::vector<double> logits) {
  double sum = 0.0;
  for (double& l : logits) sum += (l = std::exp(l));
  for (double& l : logits) l /= sum;
  return logits;
}

TEST(CosineRouterTest, HandExample) {
  auto router = HandCosineRouter(1);
  // θ = log(1/τ) = log 2 at τ = 0.5.
  EXPECT_NEAR(Param(*router, "router.log_inv_temperature").item<double>(), std::log(2.0), 1e-7);
  Routing r = router->Route(HandTokens(), 1, Eval());
  // cos with the unit embeddings (1, 0), (0, 1), (−1, 0):
  //   t0 (.6, .8):   ( .6,  .8, −.6)  / τ -> logits ( 1.2,  1.6, −1.2)
  //   t1 (−.8, −.6): (−.8, −.6,  .8)  / τ -> logits (−1.6, −1.2,  1.6)
  const std::vector<double> p0 = Softmax({1.2, 1.6, -1.2});
  const std::vector<double> p1 = Softmax({-1.6, -1.2, 1.6});
  ExpectNear(Doubles(r.probs), {p0[0], p0[1], p0[2], p1[0], p1[1], p1[2]}, 1e-6);
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{1, 2}));
  ExpectNear(Doubles(r.gate), {p0[1], p1[2]}, 1e-6);  // k = 1: the probability itself
}

TEST(CosineRouterTest, LogitsIgnoreTheTokenNorm) {
  auto router = HandCosineRouter(2);
  Routing a = router->Route(HandTokens(), 2, Eval());
  Routing b = router->Route(HandTokens() * 7.5, 2, Eval());
  EXPECT_TRUE(a.probs.allclose(b.probs, 1e-6, 1e-7));
  EXPECT_TRUE(a.expert.equal(b.expert));
}

TEST(CosineRouterTest, TemperatureIsClampedAndThenGetsNoGradient) {
  auto router = HandCosineRouter(1);
  // θ = log 1000 asks for τ = 0.001; the clamp holds τ at 0.01: logits = 100·cos.
  SetParam(*router, "router.log_inv_temperature", at::full({}, std::log(1000.0)));
  Routing r = router->Route(HandTokens(), 1, Training(1));
  const std::vector<double> p0 = Softmax({60.0, 80.0, -60.0});
  ExpectNear(Doubles(r.probs[0]), p0, 1e-5);
  r.gate.sum().backward();
  at::Tensor& theta = Param(*router, "router.log_inv_temperature");
  ASSERT_TRUE(theta.grad().defined());
  EXPECT_EQ(theta.grad().item<double>(), 0.0);

  // Below the clamp the temperature learns: d gate_t / dθ = gate_t·(l_t,e − Σ_j p_t,j·l_t,j)
  // for the chosen expert e, since every logit scales with e^θ.
  SetParam(*router, "router.log_inv_temperature", at::full({}, std::log(2.0)));
  theta.mutable_grad() = at::Tensor();
  Routing unclamped = router->Route(HandTokens(), 1, Training(1));
  unclamped.gate.sum().backward();
  auto dgate = [](const std::vector<double>& logits, int chosen) {
    const std::vector<double> p = Softmax(logits);
    double mean = 0.0;
    for (size_t j = 0; j < p.size(); ++j) mean += p[j] * logits[j];
    return p[chosen] * (logits[chosen] - mean);
  };
  EXPECT_NEAR(theta.grad().item<double>(), dgate({1.2, 1.6, -1.2}, 1) + dgate({-1.6, -1.2, 1.6}, 2),
              1e-5);
}

TEST(CosineRouterTest, ProjectionDimensionAndNames) {
  RouterOptions options = TinyOptions(5, 12, 2);
  options.cosine_projection_dim = 3;
  auto router = MakeOrDie("cosine", options);
  EXPECT_EQ(Param(*router, "router.projection.weight").sizes(), at::IntArrayRef({3, 12}));
  EXPECT_EQ(Param(*router, "router.expert_embeddings").sizes(), at::IntArrayRef({5, 3}));
  for (const RouterParameter& p : router->Parameters()) {
    EXPECT_EQ(p.weight_decay, p.name != "router.log_inv_temperature") << p.name;
  }
}

}  // namespace
}  // namespace fulcrum::moe
