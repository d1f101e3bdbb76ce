// Expert choice, Sinkhorn and auxiliary-loss-free routers: balance by construction.
#include <gtest/gtest.h>

#include <cmath>

#include "core/random.h"
#include "moe/capacity.h"
#include "moe/router.h"
#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

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

// Identity-weight router: the hidden states are the logits.
std::unique_ptr<Router> IdentityRouter(const std::string& name, int64_t num_experts, int64_t k) {
  auto router = MakeOrDie(name, TinyOptions(num_experts, num_experts, k));
  SetParam(*router, "router.weight", at::eye(num_experts));
  return router;
}

// Logits that all favour expert 0 by `skew`.
at::Tensor SkewedLogits(int64_t tokens, int64_t experts, double skew, uint64_t seed) {
  at::Generator gen = MakeGenerator(seed, "skewed_logits");
  at::Tensor logits = at::empty({tokens, experts}, at::kFloat).normal_(0.0, 1.0, gen);
  logits.select(1, 0).add_(skew);
  return logits;
}

// ---- Expert choice. -----------------------------------------------------------------------

TEST(ExpertChoiceRouterTest, HandExample) {
  auto router = IdentityRouter("expert_choice", 3, 1);
  Routing r = router->Route(HandHidden(), 1, Eval());
  // C = ceil(1·k·T/E) = ceil(4/3) = 2. Each expert takes the 2 best tokens of its column
  // of p: e0 (.5, .1, .25, .7) -> t3, t0;  e1 (.3, .6, .1, .2) -> t1, t0;
  //       e2 (.2, .3, .65, .1) -> t2, t1.  Gates are those scores; t0 and t1 get two
  // experts, t2 and t3 one.
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(Longs(r.token), (std::vector<int64_t>{3, 0, 1, 0, 2, 1}));
  ExpectNear(Doubles(r.gate), {0.7, 0.5, 0.6, 0.3, 0.65, 0.3}, 1e-6);
  EXPECT_EQ(Longs(r.expert_load), (std::vector<int64_t>{2, 2, 2}));
  EXPECT_TRUE(r.aux_losses.empty());  // z-loss off, no balancing loss needed
}

TEST(ExpertChoiceRouterTest, EveryExpertTakesExactlyCDistinctTokens) {
  struct Case {
    int64_t k;
    double factor;
    int64_t capacity;
  };
  // T = 10, E = 4: C = ceil(c·k·10/4).
  for (const Case& c : {Case{2, 1.0, 5}, Case{1, 1.0, 3}, Case{2, 1.5, 8}, Case{4, 2.0, 10}}) {
    RouterOptions options = TinyOptions(4, 6, c.k);
    options.expert_choice_capacity_factor = c.factor;
    auto router = MakeOrDie("expert_choice", options);
    Routing r = router->Route(at::randn({10, 6}), c.k, Training(1));
    EXPECT_EQ(Longs(r.expert_load), std::vector<int64_t>(4, c.capacity));
    for (int64_t e = 0; e < 4; ++e) {
      at::Tensor tokens = r.token.masked_select(r.expert == e);
      EXPECT_EQ(std::get<0>(at::_unique(tokens)).numel(), c.capacity) << "expert " << e;
    }
    // Slots at that capacity drop nothing.
    EXPECT_EQ(AssignSlots(r, 4, c.capacity).dropped, 0);
  }
}

// ---- Sinkhorn. ----------------------------------------------------------------------------

TEST(SinkhornRouterTest, TwoByTwoByHand) {
  auto router = IdentityRouter("sinkhorn", 2, 1);
  // Both tokens prefer expert 0: p_0 = (.9, .1), p_1 = (.6, .4).
  at::Tensor hidden =
      at::tensor({std::log(0.9), std::log(0.1), std::log(0.6), std::log(0.4)}, at::kFloat)
          .reshape({2, 2});
  // Sinkhorn scaling keeps the cross ratio (.9·.4)/(.1·.6) = 6 and makes rows and columns sum
  // to 1/2: [[a, 1/2 − a], [1/2 − a, a]] with a/(1/2 − a) = √6, a ≈ .355. So token 0 keeps
  // expert 0 and token 1 moves to expert 1. Gates (k = 1): sigmoid(logit) = p/(1 + p).
  Routing r = router->Route(hidden, 1, Training(1));
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1}));
  ExpectNear(Doubles(r.gate), {0.9 / 1.9, 0.4 / 1.4}, 1e-6);
  // Outside training, plain top-1: both on expert 0.
  Routing eval = router->Route(hidden, 1, Eval());
  EXPECT_EQ(Longs(eval.expert), (std::vector<int64_t>{0, 0}));
  ExpectNear(Doubles(eval.gate), {0.9 / 1.9, 0.6 / 1.6}, 1e-6);
}

// Sinkhorn balances the soft assignment exactly; the top-k of it is balanced up to rounding
// effects that shrink with T (about ±15% at T = 128, against a collapse of plain top-k).
TEST(SinkhornRouterTest, BalancesWhereTopKCollapses) {
  constexpr int64_t kT = 128, kE = 4;
  for (int64_t k : {1, 2}) {
    auto router = IdentityRouter("sinkhorn", kE, k);
    at::Tensor logits = SkewedLogits(kT, kE, 3.0, 7);
    const std::vector<int64_t> plain = Longs(router->Route(logits, k, Eval()).expert_load);
    const std::vector<int64_t> balanced = Longs(router->Route(logits, k, Training(1)).expert_load);
    EXPECT_GE(plain[0], kT * 9 / 10) << "k=" << k;  // plain top-k piles onto expert 0
    const int64_t fair = kT * k / kE;
    for (int64_t e = 0; e < kE; ++e) {
      EXPECT_NEAR(balanced[e], fair, fair / 4) << "k=" << k << " expert " << e;
    }
  }
}

// For k > 1 the gates are the softmax probabilities of the chosen experts, not renormalised.
TEST(SinkhornRouterTest, TopTwoGatesAreSoftmaxProbabilities) {
  auto router = IdentityRouter("sinkhorn", 4, 2);
  at::Tensor logits = SkewedLogits(8, 4, 1.0, 3);
  Routing r = router->Route(logits, 2, Training(1));
  at::Tensor probs = at::softmax(logits, 1);
  EXPECT_TRUE(r.gate.allclose(probs.index({r.token, r.expert})));
}

// ---- Auxiliary-loss-free balancing. -------------------------------------------------------

// Affinities s = sigmoid(logit); the hidden states are logit(s).
//   s_0 = (.8, .6, .3)   s_1 = (.4, .9, .2)   s_2 = (.7, .1, .5)   s_3 = (.9, .3, .6)
at::Tensor AffinityHidden() {
  at::Tensor s =
      at::tensor({0.8, 0.6, 0.3, 0.4, 0.9, 0.2, 0.7, 0.1, 0.5, 0.9, 0.3, 0.6}, at::kDouble)
          .reshape({4, 3});
  return (s / (1 - s)).log().to(at::kFloat);
}

TEST(AuxFreeRouterTest, BiasChoosesButDoesNotGate) {
  auto router = IdentityRouter("aux_free", 3, 2);
  // b = 0: top-2 of s, gates renormalised over the chosen two:
  //   t0: e0 .8, e1 .6 -> 4/7, 3/7     t1: e1 .9, e0 .4 -> 9/13, 4/13
  //   t2: e0 .7, e2 .5 -> 7/12, 5/12   t3: e0 .9, e2 .6 -> 3/5, 2/5
  Routing r = router->Route(AffinityHidden(), 2, Eval());
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 0, 0, 1, 0, 2, 2}));
  ExpectNear(Doubles(r.gate),
             {4.0 / 7, 9.0 / 13, 7.0 / 12, 3.0 / 5, 3.0 / 7, 4.0 / 13, 5.0 / 12, 2.0 / 5}, 1e-6);
  EXPECT_EQ(Longs(r.expert_load), (std::vector<int64_t>{4, 2, 2}));
  // probs: the affinities normalised per token, e.g. t0 = (.8, .6, .3)/1.7.
  ExpectNear(Doubles(r.probs[0]), {0.8 / 1.7, 0.6 / 1.7, 0.3 / 1.7}, 1e-6);

  // b = (−.25, 0, 0): choose on s + b, gate on s:
  //   t0: (.55, .6, .3)  -> e1, e0; gates .6/1.4 = 3/7, .8/1.4 = 4/7
  //   t1: (.15, .9, .2)  -> e1, e2; gates .9/1.1 = 9/11, .2/1.1 = 2/11
  //   t2: (.45, .1, .5)  -> e2, e0; gates .5/1.2 = 5/12, .7/1.2 = 7/12
  //   t3: (.65, .3, .6)  -> e0, e2; gates .9/1.5 = 3/5, .6/1.5 = 2/5
  ASSERT_TRUE(router->LoadState({{"router.expert_bias", at::tensor({-0.25f, 0.0f, 0.0f})}}).ok());
  Routing biased = router->Route(AffinityHidden(), 2, Eval());
  EXPECT_EQ(Longs(biased.expert), (std::vector<int64_t>{1, 1, 2, 0, 0, 2, 0, 2}));
  ExpectNear(Doubles(biased.gate),
             {3.0 / 7, 9.0 / 11, 5.0 / 12, 3.0 / 5, 4.0 / 7, 2.0 / 11, 7.0 / 12, 2.0 / 5}, 1e-6);
  EXPECT_EQ(Longs(biased.expert_load), (std::vector<int64_t>{3, 2, 3}));
}

TEST(AuxFreeRouterTest, BiasUpdateIsSignOfTheLoadGap) {
  RouterOptions options = TinyOptions(3, 3, 2);
  options.bias_update_rate = 0.1;
  auto router = MakeOrDie("aux_free", options);
  // Loads (4, 2, 2), mean 8/3: overloaded e0 goes down by γ, the others up by γ.
  router->AfterOptimizerStep(at::tensor({4, 2, 2}));
  ExpectNear(Doubles(router->State()[0].second), {-0.1, 0.1, 0.1}, 1e-7);
  // Loads at the mean leave the bias alone: sign(0) = 0.
  router->AfterOptimizerStep(at::tensor({3, 3, 3}));
  ExpectNear(Doubles(router->State()[0].second), {-0.1, 0.1, 0.1}, 1e-7);
  EXPECT_THROW(router->AfterOptimizerStep(at::tensor({1, 2})), c10::Error);
}

// Simulated training: the bias pulls a skewed router towards balance, step by step.
TEST(AuxFreeRouterTest, BiasMovesLoadsTowardBalance) {
  constexpr int64_t kT = 64, kE = 4;
  RouterOptions options = TinyOptions(kE, kE, 1);
  options.bias_update_rate = 0.05;
  auto router = MakeOrDie("aux_free", options);
  SetParam(*router, "router.weight", at::eye(kE));
  const at::Tensor hidden = SkewedLogits(kT, kE, 2.0, 11);
  auto spread = [](const at::Tensor& load) { return (load.max() - load.min()).item<int64_t>(); };
  const int64_t initial_spread = spread(router->Route(hidden, 1, Training(0)).expert_load);
  EXPECT_GE(initial_spread, kT / 2);
  int64_t last_spread = initial_spread;
  for (int64_t step = 1; step <= 40; ++step) {
    Routing r = router->Route(hidden, 1, Training(step));
    last_spread = spread(r.expert_load);
    router->AfterOptimizerStep(r.expert_load);
  }
  EXPECT_LE(last_spread, 8) << "started at " << initial_spread;
  // Expert 0 was overloaded: its bias is the lowest.
  at::Tensor bias = router->State()[0].second;
  EXPECT_EQ(bias.argmin().item<int64_t>(), 0);
}

TEST(AuxFreeRouterTest, BiasNeverReceivesGradient) {
  auto router = IdentityRouter("aux_free", 3, 2);
  ASSERT_TRUE(router->LoadState({{"router.expert_bias", at::tensor({0.3f, -0.2f, 0.1f})}}).ok());
  Routing r = router->Route(AffinityHidden(), 2, Training(1));
  (r.gate * at::arange(1, r.size() + 1)).sum().backward();
  at::Tensor bias = router->State()[0].second;
  EXPECT_FALSE(bias.requires_grad());
  EXPECT_FALSE(bias.grad().defined());
  EXPECT_TRUE(Param(*router, "router.weight").grad().defined());
  for (const RouterParameter& p : router->Parameters()) EXPECT_NE(p.name, "router.expert_bias");
}

}  // namespace
}  // namespace fulcrum::moe
