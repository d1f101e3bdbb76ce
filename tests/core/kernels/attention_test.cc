// AttentionCore against the computation the layer did before it called it (NOTE [attention
// core contract]): bit for bit on the CPU. MaskedSoftmax against masked_fill + softmax.
#include "core/kernels/attention.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tests/core/kernels/random_tensor.h"

namespace fulcrum::kernels {
namespace {

using testing::Random;

at::Tensor Expand(const at::Tensor& kv, int64_t per_group) {
  return per_group == 1 ? kv : kv.repeat_interleave(per_group, 1);
}

// A per-head dropout with its own generator per head, standing in for the layer's
// Dropout(probs, p, seed, "attention_dropout", head, ctx).
at::Tensor DropHead(const at::Tensor& probs, int64_t head, double p) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + head);
  at::Tensor keep = at::empty(probs.sizes(), probs.options().requires_grad(false)).bernoulli_(1.0 - p, gen);
  return probs * keep.div_(1.0 - p);
}

TEST(AttentionCoreTest, WithoutDropoutIsTheLayersSdpaCallBitForBitGradientsIncluded) {
  const int64_t per_group = 2;
  const at::Tensor q0 = Random({2, 4, 9, 8}, 1);
  const at::Tensor k0 = Random({2, 2, 9, 8}, 2);  // 2 key/value groups for 4 query heads
  const at::Tensor v0 = Random({2, 2, 9, 8}, 3);
  const at::Tensor dy = Random({2, 4, 9, 8}, 4);
  auto grads = [&](bool ours) {
    at::Tensor q = q0.clone().requires_grad_(true);
    at::Tensor k = k0.clone().requires_grad_(true);
    at::Tensor v = v0.clone().requires_grad_(true);
    at::Tensor out = ours ? AttentionCore(q, k, v)
                          : at::scaled_dot_product_attention(q, Expand(k, per_group),
                                                             Expand(v, per_group), {}, 0.0, true);
    out.backward(dy);
    return std::vector<at::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  const std::vector<at::Tensor> ours = grads(true);
  const std::vector<at::Tensor> layer = grads(false);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(at::equal(ours[i], layer[i])) << i;
  // And it is attention: the plain masked softmax agrees to rounding.
  const at::Tensor scores = at::matmul(q0, Expand(k0, 2).transpose(-2, -1)) / std::sqrt(8.0);
  const at::Tensor future = at::ones({9, 9}, at::kBool).triu(1);
  const at::Tensor plain = at::matmul(
      at::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1),
      Expand(v0, 2));
  EXPECT_TRUE(at::allclose(ours[0], plain, 1e-5, 1e-6));
}

TEST(AttentionCoreTest, WithDropoutIsTheLayersWholeMatrixPathBitForBit) {
  const double p = 0.25;
  const at::Tensor q = Random({2, 3, 7, 4}, 5).requires_grad_(true);
  const at::Tensor k = Random({2, 3, 7, 4}, 6);
  const at::Tensor v = Random({2, 3, 7, 4}, 7);
  AttentionOptions options;
  options.dropout_p = p;
  options.drop_head = [p](const at::Tensor& probs, int64_t head) { return DropHead(probs, head, p); };
  const at::Tensor ours = AttentionCore(q, k, v, options);
  // The layer's former dropout branch (TransformerLayer::SoftmaxAttention), op for op.
  const at::Tensor scores = at::matmul(q * (1.0 / std::sqrt(4.0)), k.transpose(-2, -1));
  const at::Tensor future = at::ones({7, 7}, at::kBool).triu(1);
  const at::Tensor probs = at::softmax(scores.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  std::vector<at::Tensor> per_head;
  for (int64_t i = 0; i < 3; ++i) per_head.push_back(DropHead(probs.select(1, i), i, p));
  const at::Tensor layer = at::matmul(at::stack(per_head, 1), v);
  EXPECT_TRUE(at::equal(ours, layer));
  // Dropout happened (some weight was zeroed), and the gradient reaches q.
  EXPECT_FALSE(at::equal(ours, AttentionCore(q, k, v)));
  ours.sum().backward();
  ASSERT_TRUE(q.grad().defined());
  EXPECT_TRUE(q.grad().abs().sum().item<double>() > 0);
}

TEST(AttentionCoreTest, RefusesBadShapesAndDropoutWithoutMaskSource) {
  const at::Tensor q = Random({1, 4, 5, 8}, 8);
  EXPECT_THROW(AttentionCore(q, Random({1, 3, 5, 8}, 9), Random({1, 3, 5, 8}, 10)), c10::Error);
  EXPECT_THROW(AttentionCore(q, Random({1, 4, 6, 8}, 9), Random({1, 4, 6, 8}, 10)), c10::Error);
  AttentionOptions options;
  options.dropout_p = 0.1;
  try {
    AttentionCore(q, q, q, options);
    FAIL() << "dropout without drop_head accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("drop_head"), std::string::npos) << e.what();
  }
}

// MaskedSoftmax is masked_fill(−∞) + softmax, values and score gradients bit for bit, with
// a mask broadcast over batch and heads as ResidualAt's is ([b, 1, rows, keys]: each query
// row masks the keys after its own position); the masked probabilities are exactly 0.
TEST(MaskedSoftmaxTest, IsMaskedFillThenSoftmaxBitForBitWithABroadcastMask) {
  const at::Tensor scores0 = Random({2, 3, 5, 11}, 20);
  const at::Tensor positions = at::tensor({1, 4, 4, 7, 10, 0, 2, 3, 9, 10}, at::kLong).view({2, 1, 5, 1});
  const at::Tensor mask = at::arange(11, at::kLong).view({1, 1, 1, 11}) > positions;
  const at::Tensor dy = Random({2, 3, 5, 11}, 21);
  at::Tensor a = scores0.clone().requires_grad_(true);
  at::Tensor b = scores0.clone().requires_grad_(true);
  const at::Tensor ours = MaskedSoftmax(a, mask);
  const at::Tensor plain = at::softmax(b.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  ours.backward(dy);
  plain.backward(dy);
  EXPECT_TRUE(at::equal(ours, plain));
  EXPECT_TRUE(at::equal(a.grad(), b.grad()));
  const at::Tensor masked = ours.masked_select(mask.expand_as(ours));
  EXPECT_EQ(masked.numel(), 3 * (9 + 6 + 6 + 3 + 0 + 10 + 8 + 7 + 1 + 0));  // 3 heads × Σ (10 − p)
  EXPECT_EQ(masked.abs().max().item<double>(), 0.0);
  // The mask matters: without it the same scores give other probabilities.
  EXPECT_FALSE(at::equal(ours, at::softmax(scores0, -1)));
}

TEST(MaskedSoftmaxTest, RefusesANonBoolMask) {
  const at::Tensor scores = Random({2, 4}, 22);
  try {
    MaskedSoftmax(scores, at::ones({2, 4}, at::kLong).triu(1));
    FAIL() << "a long mask accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("MaskedSoftmax: the mask must be bool"), std::string::npos) << e.what();
  }
}

TEST(AttentionCoreCudaTest, FlashMatchesCpuInFp32AndBf16) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  at::globalContext().setAllowTF32CuBLAS(false);
  const at::Tensor q = Random({2, 8, 128, 64}, 11);
  const at::Tensor k = Random({2, 2, 128, 64}, 12);  // GQA: enable_gqa on CUDA
  const at::Tensor v = Random({2, 2, 128, 64}, 13);
  const at::Tensor cpu = AttentionCore(q, k, v);
  EXPECT_LT((AttentionCore(q.cuda(), k.cuda(), v.cuda()).cpu() - cpu).abs().max().item<double>(), 1e-4);
  const at::Tensor bf16 =
      AttentionCore(q.to(at::kBFloat16).cuda(), k.to(at::kBFloat16).cuda(), v.to(at::kBFloat16).cuda());
  // Outputs are convex combinations of v (|v| < ~4): bf16 rounding of q, k, v, p and out.
  EXPECT_LT((bf16.cpu().to(at::kFloat) - cpu).abs().max().item<double>(), 0.05);
}

}  // namespace
}  // namespace fulcrum::kernels
