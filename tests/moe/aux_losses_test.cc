// The auxiliary losses against closed forms, values and gradients.
#include "moe/aux_losses.h"

#include <gtest/gtest.h>

#include <cmath>

#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::Doubles;
using testing::ExpectNear;

double Phi(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }
double NormalPdf(double z) { return std::exp(-0.5 * z * z) / std::sqrt(2.0 * M_PI); }

at::Tensor Row(std::initializer_list<double> values) {
  return at::tensor(std::vector<double>(values), at::kDouble).unsqueeze(0);
}

TEST(LoadBalancingLossTest, OneAtBalanceAndEAtCollapse) {
  // Balanced: f = P = 1/E, E·Σ 1/E² = 1.
  at::Tensor uniform = at::full({6, 3}, 1.0 / 3, at::kDouble);
  EXPECT_NEAR(LoadBalancingLoss(uniform, at::tensor({4, 4, 4}), 2).item<double>(), 1.0, 1e-12);
  // Collapsed: every token to expert 0 with probability 1: f = P = (1, 0, 0), loss = E.
  at::Tensor collapsed = at::zeros({6, 3}, at::kDouble);
  collapsed.select(1, 0).fill_(1.0);
  EXPECT_NEAR(LoadBalancingLoss(collapsed, at::tensor({6, 0, 0}), 1).item<double>(), 3.0, 1e-12);
}

// Only P carries the gradient: d/dprobs[t, i] = E·fᵢ/T.
TEST(LoadBalancingLossTest, GradientFlowsThroughTheMeanProbability) {
  at::Tensor probs = testing::HandProbs().requires_grad_(true);
  at::Tensor load = at::tensor({3, 3, 2});
  LoadBalancingLoss(probs, load, 2).backward();
  // E·f/T = 3·(3, 3, 2)/8/4.
  at::Tensor expected = (3.0 * at::tensor({3.0, 3.0, 2.0}, at::kDouble) / 8.0 / 4.0).expand({4, 3});
  EXPECT_TRUE(at::allclose(probs.grad(), expected));
}

TEST(ZLossTest, ClosedFormValueAndGradient) {
  // Rows (0, 0) and (log 3, 0): logsumexp = log 2 and log 4 = 2 log 2;
  // mean of squares = (1 + 4)/2 · log²2.
  at::Tensor logits = at::cat({Row({0.0, 0.0}), Row({std::log(3.0), 0.0})}).requires_grad_(true);
  at::Tensor z = ZLoss(logits);
  EXPECT_NEAR(z.item<double>(), 2.5 * std::log(2.0) * std::log(2.0), 1e-12);
  z.backward();
  // d/dlogits[t] = 2·lse_t·softmax(logits[t]) / T.
  const double l2 = std::log(2.0);
  ExpectNear(Doubles(logits.grad()), {l2 * 0.5, l2 * 0.5, 2 * l2 * 0.75, 2 * l2 * 0.25}, 1e-12);
}

TEST(CvSquaredTest, PopulationVarianceOverMeanSquared) {
  // (1, 2, 3): mean 2, population variance 2/3, CV² = (2/3)/4 = 1/6.
  EXPECT_NEAR(CvSquared(at::tensor({1.0, 2.0, 3.0}, at::kDouble)).item<double>(), 1.0 / 6, 1e-9);
  EXPECT_EQ(CvSquared(at::tensor({2.0, 2.0}, at::kDouble)).item<double>(), 0.0);
  EXPECT_EQ(CvSquared(at::tensor({5.0}, at::kDouble)).item<double>(), 0.0);
}

TEST(ImportanceTest, SumsTheGatesPerExpert) {
  at::Tensor gate = at::tensor({0.5, 0.25, 0.125}, at::kDouble).requires_grad_(true);
  at::Tensor importance = Importance(at::tensor({0, 2, 0}), gate, 3);
  ExpectNear(Doubles(importance), {0.625, 0.0, 0.25}, 1e-12);
  importance[0].backward();
  ExpectNear(Doubles(gate.grad()), {1.0, 0.0, 1.0}, 0.0);
}

// Shazeer et al. 2017, App. A: P(x, i) = Φ((clean_i − kth_excluding(H, k, i)) / σ_i).
TEST(NoisyTopKLoadTest, TopOneByHand) {
  // H = (1.5, 0.2, −0.3): the top-1 is e0.
  //   e0 (in):  best of H without e0 = 0.2   -> Φ((1 − 0.2)/1) = Φ(0.8)
  //   e1 (out): best of H without e1 = 1.5   -> Φ((0 − 1.5)/1) = Φ(−1.5)
  //   e2 (out): best of H without e2 = 1.5   -> Φ(−1.5)
  at::Tensor clean = Row({1.0, 0.0, 0.0}).requires_grad_(true);
  at::Tensor noisy = Row({1.5, 0.2, -0.3}).requires_grad_(true);
  at::Tensor stddev = at::ones({1, 3}, at::kDouble);
  at::Tensor load = NoisyTopKLoad(clean, noisy, stddev, 1);
  ExpectNear(Doubles(load), {Phi(0.8), Phi(-1.5), Phi(-1.5)}, 1e-12);
  // Gradients: through the clean logit, and through the threshold, which is a noisy logit.
  load[0].backward();
  ExpectNear(Doubles(clean.grad()), {NormalPdf(0.8), 0.0, 0.0}, 1e-12);
  ExpectNear(Doubles(noisy.grad()), {0.0, -NormalPdf(0.8), 0.0}, 1e-12);
}

TEST(NoisyTopKLoadTest, TopTwoByHandSummedOverTokens) {
  // Token 0: H = (1.5, 0.2, −0.3), top-2 = {e0, e1}, σ = (1, 2, 0.5):
  //   e0 (in):  2nd best without e0 of (0.2, −0.3) = −0.3  -> Φ((1 + 0.3)/1)   = Φ(1.3)
  //   e1 (in):  2nd best without e1 of (1.5, −0.3) = −0.3  -> Φ((0 + 0.3)/2)   = Φ(0.15)
  //   e2 (out): 2nd best without e2 of (1.5, 0.2)  = 0.2   -> Φ((0.5 − 0.2)/.5) = Φ(0.6)
  // Token 1: H = (0, 3, 1), top-2 = {e1, e2}, σ = 1, clean = (0, 0, 0):
  //   e0 (out): 2nd best of (3, 1) = 1  -> Φ(−1);  e1 (in): 2nd best of (0, 1) = 0 -> Φ(0);
  //   e2 (in):  2nd best of (0, 3) = 0  -> Φ(0).
  at::Tensor clean = at::cat({Row({1.0, 0.0, 0.5}), Row({0.0, 0.0, 0.0})});
  at::Tensor noisy = at::cat({Row({1.5, 0.2, -0.3}), Row({0.0, 3.0, 1.0})});
  at::Tensor stddev = at::cat({Row({1.0, 2.0, 0.5}), Row({1.0, 1.0, 1.0})});
  ExpectNear(Doubles(NoisyTopKLoad(clean, noisy, stddev, 2)),
             {Phi(1.3) + Phi(-1.0), Phi(0.15) + Phi(0.0), Phi(0.6) + Phi(0.0)}, 1e-12);
}

TEST(NoisyTopKLoadTest, AllExpertsChosenMeansLoadT) {
  at::Tensor x = at::randn({5, 3}, at::kDouble);
  ExpectNear(Doubles(NoisyTopKLoad(x, x, at::ones_like(x), 3)), {5.0, 5.0, 5.0}, 0.0);
}

}  // namespace
}  // namespace fulcrum::moe
