// Noisy top-k gating (Shazeer et al. 2017): noise off in eval, keyed in training, the
// importance and load losses by hand and against an independent reference, and the load
// loss gradient against finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/random.h"
#include "moe/internal/router_common.h"
#include "moe/router.h"
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
using testing::Param;
using testing::SetParam;
using testing::TinyOptions;
using testing::Training;

double CvSquaredOf(const std::vector<double>& x) {
  const double mean = std::accumulate(x.begin(), x.end(), 0.0) / x.size();
  double var = 0.0;
  for (double v : x) var += (v - mean) * (v - mean) / x.size();
  return var / (mean * mean + 1e-10);
}

std::unique_ptr<Router> HandNoisyRouter(int64_t k) {
  RouterOptions options = TinyOptions(3, 3, k);
  options.aux_loss_coeff = 0.01;
  auto router = MakeOrDie("noisy_topk", options);
  SetParam(*router, "router.weight", at::eye(3));              // x·W_g = x
  SetParam(*router, "router.noise_weight", 0.5 * at::eye(3));  // x·W_noise = x/2
  return router;
}

TEST(NoisyTopKRouterTest, EvalHasNoNoiseAndHandLosses) {
  auto router = HandNoisyRouter(2);
  Routing r = router->Route(HandHidden(), 2, Eval());
  // Without noise H = x·W_g and softmax over the kept two equals the renormalised top-2 of
  // p (the topk router's hand example).
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  ExpectNear(Doubles(r.gate),
             {5.0 / 8, 2.0 / 3, 13.0 / 18, 7.0 / 9, 3.0 / 8, 1.0 / 3, 5.0 / 18, 2.0 / 9}, 1e-6);
  // Importance = Σ gates per expert: e0 = 5/8 + 5/18 + 7/9, e1 = 3/8 + 2/3 + 2/9,
  // e2 = 1/3 + 13/18 (they sum to T = 4).
  const double importance_cv2 =
      CvSquaredOf({5.0 / 8 + 5.0 / 18 + 7.0 / 9, 3.0 / 8 + 2.0 / 3 + 2.0 / 9, 1.0 / 3 + 13.0 / 18});
  EXPECT_NEAR(AuxLoss(r, "importance_loss"), 0.01 * importance_cv2, 1e-8);
  // Eval load = counts (3, 3, 2): mean 8/3, variance ((1/3)²·2 + (2/3)²)/3 = 2/9,
  // CV² = (2/9)/(64/9) = 1/32.
  EXPECT_NEAR(AuxLoss(r, "load_loss"), 0.01 / 32, 1e-8);
  // No noise: the context does not matter.
  RouteContext later = Eval();
  later.iteration = 9;
  EXPECT_TRUE(r.gate.equal(router->Route(HandHidden(), 2, later).gate));
}

TEST(NoisyTopKRouterTest, TrainingNoiseIsKeyedAndReproducible) {
  auto router = HandNoisyRouter(2);
  at::Tensor hidden = HandHidden();
  Routing a = router->Route(hidden, 2, Training(4, 32, 1));
  EXPECT_FALSE(a.probs.allclose(router->Route(hidden, 2, Eval()).probs));
  EXPECT_TRUE(a.probs.equal(router->Route(hidden, 2, Training(4, 32, 1)).probs));
  EXPECT_TRUE(a.probs.equal(HandNoisyRouter(2)->Route(hidden, 2, Training(4, 32, 1)).probs));
  EXPECT_FALSE(a.probs.equal(router->Route(hidden, 2, Training(5, 32, 1)).probs));
  EXPECT_FALSE(a.probs.equal(router->Route(hidden, 2, Training(4, 40, 1)).probs));
  EXPECT_FALSE(a.probs.equal(router->Route(hidden, 2, Training(4, 32, 2)).probs));
}

// The whole training computation redone independently, in double, with the paper's
// definitions taken literally (kth_excluding by removing expert i and sorting).
TEST(NoisyTopKRouterTest, TrainingMatchesAReferenceImplementation) {
  constexpr int64_t kT = 4, kE = 3, kK = 2;
  auto router = HandNoisyRouter(kK);
  const RouteContext ctx = Training(7, 3, 5);
  Routing r = router->Route(HandHidden(), kK, ctx);

  const std::vector<double> x = Doubles(HandHidden());
  const std::vector<double> noise = Doubles(internal::KeyedStandardNormal(
      router->options(), "moe_router_noise", ctx, kT, kE, at::TensorOptions().dtype(at::kFloat)));
  std::vector<double> importance(kE, 0.0), load(kE, 0.0);
  std::vector<int64_t> first_choices, second_choices;
  for (int64_t t = 0; t < kT; ++t) {
    std::vector<double> clean(kE), sigma(kE), h(kE);
    for (int64_t i = 0; i < kE; ++i) {
      clean[i] = x[t * kE + i];
      sigma[i] = std::log1p(std::exp(0.5 * clean[i])) + 0.01;  // Softplus(x·W_noise) + ε
      h[i] = clean[i] + noise[t * kE + i] * sigma[i];
    }
    std::vector<int64_t> order = {0, 1, 2};
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return h[a] > h[b]; });
    first_choices.push_back(order[0]);
    second_choices.push_back(order[1]);
    const double denominator = std::exp(h[order[0]]) + std::exp(h[order[1]]);
    for (int j = 0; j < kK; ++j) importance[order[j]] += std::exp(h[order[j]]) / denominator;
    for (int64_t i = 0; i < kE; ++i) {
      std::vector<double> others;
      for (int64_t j = 0; j < kE; ++j) {
        if (j != i) others.push_back(h[j]);
      }
      std::sort(others.rbegin(), others.rend());
      const double kth_excluding = others[kK - 1];
      load[i] += 0.5 * std::erfc(-(clean[i] - kth_excluding) / sigma[i] / std::sqrt(2.0));
    }
  }
  std::vector<int64_t> expected_experts = first_choices;
  expected_experts.insert(expected_experts.end(), second_choices.begin(), second_choices.end());
  EXPECT_EQ(Longs(r.expert), expected_experts);
  EXPECT_NEAR(AuxLoss(r, "importance_loss"), 0.01 * CvSquaredOf(importance), 1e-7);
  EXPECT_NEAR(AuxLoss(r, "load_loss"), 0.01 * CvSquaredOf(load), 1e-7);
}

// The load loss is differentiable w.r.t. W_g and W_noise (App. A): autograd against
// central differences, in double.
TEST(NoisyTopKRouterTest, LossGradientsMatchFiniteDifferences) {
  RouterOptions options = TinyOptions(4, 3, 2);
  options.aux_loss_coeff = 1.0;
  auto router = MakeOrDie("noisy_topk", options);
  testing::ToDouble(*router);
  at::Generator gen = MakeGenerator(42, "test");
  {
    at::NoGradGuard no_grad;
    Param(*router, "router.weight").normal_(0.0, 1.0, gen);
    Param(*router, "router.noise_weight").normal_(0.0, 1.0, gen);
  }
  const at::Tensor hidden = at::empty({5, 3}, at::kDouble).normal_(0.0, 1.0, gen);
  const RouteContext ctx = Training(2);
  for (const char* loss_name : {"load_loss", "importance_loss"}) {
    auto loss = [&] { return AuxLoss(router->Route(hidden, 2, ctx), loss_name); };
    for (const char* param_name : {"router.weight", "router.noise_weight"}) {
      at::Tensor& w = Param(*router, param_name);
      w.mutable_grad() = at::Tensor();
      Routing r = router->Route(hidden, 2, ctx);
      for (const auto& [name, value] : r.aux_losses) {
        if (name == loss_name) value.backward();
      }
      const std::vector<double> analytic = Doubles(w.grad());
      EXPECT_GT(w.grad().abs().sum().item<double>(), 1e-6) << loss_name << " " << param_name;
      constexpr double kH = 1e-6;
      at::Tensor flat = w.detach().view({-1});  // shares storage with w
      for (int64_t j = 0; j < flat.numel(); ++j) {
        const double saved = flat[j].item<double>();
        flat[j].fill_(saved + kH);
        const double up = loss();
        flat[j].fill_(saved - kH);
        const double down = loss();
        flat[j].fill_(saved);
        EXPECT_NEAR(analytic[j], (up - down) / (2 * kH), 1e-6 + 1e-5 * std::abs(analytic[j]))
            << loss_name << " d/d" << param_name << "[" << j << "]";
      }
    }
  }
}

TEST(NoisyTopKRouterTest, StartsFromZeroWeights) {
  auto router = MakeOrDie("noisy_topk", TinyOptions(4, 6, 2));
  EXPECT_TRUE(Param(*router, "router.weight").eq(0).all().item<bool>());
  EXPECT_TRUE(Param(*router, "router.noise_weight").eq(0).all().item<bool>());
  // Eval with zero weights: uniform probabilities.
  Routing r = router->Route(at::randn({3, 6}), 2, Eval());
  EXPECT_TRUE(r.probs.allclose(at::full({3, 4}, 0.25)));
}

}  // namespace
}  // namespace fulcrum::moe
