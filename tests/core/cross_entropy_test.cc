// core/tensor_parallel.h VocabParallelCrossEntropy on one rank (NOTE [cross-entropy backward
// in place]): per-token losses and logit gradients against LibTorch's log_softmax + nll_loss.
#include <torch/torch.h>

#include "core/tensor_parallel.h"
#include "gtest/gtest.h"

namespace fulcrum {
namespace {

struct LossResult {
  at::Tensor loss, grad;
};

// Loss [s, b] and d(Σ loss · weight)/d logits, by `fused` (ours) or LibTorch's own.
LossResult LossAndGrad(const at::Tensor& logits_value, const at::Tensor& targets, const at::Tensor& weight,
           bool fused) {
  at::Tensor logits = logits_value.clone().set_requires_grad(true);
  at::Tensor loss;
  if (fused) {
    loss = VocabParallelCrossEntropy(logits, targets, 0, nullptr);
  } else {
    const int64_t vocab = logits.size(-1);
    loss = at::cross_entropy_loss(logits.reshape({-1, vocab}), targets.reshape({-1}), {},
                                  at::Reduction::None)
               .view(targets.sizes());
  }
  (loss * weight).sum().backward();
  return {loss.detach(), logits.grad()};
}

TEST(CrossEntropyTest, MatchesLogSoftmaxAndNllLoss) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    SCOPED_TRACE(dtype);
    torch::manual_seed(3);
    const at::Tensor logits = (torch::randn({7, 3, 50}) * 4).to(dtype);
    const at::Tensor targets = torch::randint(50, {7, 3}, at::kLong);
    // Per-token weights as the trainer's loss mask and scale make them, zeros included.
    at::Tensor weight = torch::rand({7, 3}).to(dtype);
    weight[2][1] = 0;
    const LossResult ours = LossAndGrad(logits, targets, weight, true);
    const LossResult ref = LossAndGrad(logits, targets, weight, false);
    ASSERT_EQ(ours.loss.sizes(), ref.loss.sizes());
    ASSERT_EQ(ours.grad.sizes(), logits.sizes());
    const double tol = dtype == at::kFloat ? 1e-6 : 1e-13;
    EXPECT_LT((ours.loss - ref.loss).abs().max().item<double>(), tol);
    EXPECT_LT((ours.grad - ref.grad).abs().max().item<double>(), tol);
    // A token with weight 0 gets no gradient at all; the others' rows sum to 0 (softmax − one-hot).
    EXPECT_EQ(ours.grad[2][1].abs().max().item<double>(), 0.0);
    EXPECT_LT(ours.grad.sum(-1).abs().max().item<double>(), tol * 10);
    EXPECT_GT(ours.grad.abs().max().item<double>(), 0.01);
  }
}

TEST(CrossEntropyTest, ExtremeLogitsStayFinite) {
  // A target 200 below the maximum logit: its probability underflows, its loss must not.
  at::Tensor logits = at::zeros({1, 4});
  logits[0][0] = 200;
  const at::Tensor targets = at::tensor({1}, at::kLong);
  const LossResult ours = LossAndGrad(logits, targets, at::ones({1}), true);
  EXPECT_NEAR(ours.loss.item<double>(), 200.0, 1e-3);
  EXPECT_TRUE(at::isfinite(ours.grad).all().item<bool>());
  EXPECT_NEAR(ours.grad[0][1].item<double>(), -1.0, 1e-6);
  EXPECT_NEAR(ours.grad[0][0].item<double>(), 1.0, 1e-6);
}

TEST(CrossEntropyTest, TargetOutsideTheVocabularyIsNamed) {
  const at::Tensor logits = torch::randn({2, 5}, at::requires_grad());
  try {
    VocabParallelCrossEntropy(logits, at::tensor({1, 5}, at::kLong), 0, nullptr);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary [0, 5)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace fulcrum
