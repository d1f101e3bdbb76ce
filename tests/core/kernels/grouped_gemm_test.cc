// The batched expert GEMM against moe/'s loop over experts (NOTE [grouped expert GEMM]).
#include "core/kernels/grouped_gemm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace fulcrum::kernels {
namespace {

at::Tensor Random(at::IntArrayRef shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

TEST(GroupedExpertGemmTest, EqualsThePerExpertLoopBitForBit) {
  const at::Tensor x = Random({4, 6, 16}, 1);
  const at::Tensor w = Random({4, 24, 16}, 2);
  const at::Tensor b = Random({4, 24}, 3);
  std::vector<at::Tensor> with_bias, without_bias;
  for (int64_t e = 0; e < 4; ++e) {
    without_bias.push_back(at::matmul(x[e], w[e].t()));
    with_bias.push_back(without_bias.back() + b[e]);
  }
  EXPECT_TRUE(at::equal(GroupedExpertGemm(x, w, b), at::stack(with_bias)));
  EXPECT_TRUE(at::equal(GroupedExpertGemm(x, w, at::Tensor()), at::stack(without_bias)));
}

TEST(GroupedExpertGemmTest, RaggedIsMoesLoopWithGradientsPerExpert) {
  const std::vector<int64_t> sizes = {3, 0, 5, 1};  // an expert with no tokens included
  const at::Tensor rows0 = Random({9, 16}, 4);
  const at::Tensor dy = Random({9, 8}, 5);
  auto run = [&](bool grouped) {
    std::vector<at::Tensor> weights, biases;
    for (int64_t e = 0; e < 4; ++e) {
      weights.push_back(Random({8, 16}, 10 + e).requires_grad_(true));
      biases.push_back(Random({8}, 20 + e).requires_grad_(true));
    }
    at::Tensor rows = rows0.clone().requires_grad_(true);
    at::Tensor y;
    if (grouped) {
      y = RaggedExpertGemm(rows, sizes, weights, biases);
    } else {
      std::vector<at::Tensor> outputs;
      const std::vector<at::Tensor> inputs = rows.split_with_sizes(sizes);
      for (int64_t e = 0; e < 4; ++e) outputs.push_back(at::matmul(inputs[e], weights[e].t()) + biases[e]);
      y = at::cat(outputs);
    }
    y.backward(dy);
    std::vector<at::Tensor> result = {y.detach(), rows.grad()};
    for (int64_t e = 0; e < 4; ++e) {
      result.push_back(weights[e].grad().defined() ? weights[e].grad() : at::zeros({8, 16}));
      result.push_back(biases[e].grad().defined() ? biases[e].grad() : at::zeros({8}));
    }
    return result;
  };
  const std::vector<at::Tensor> grouped = run(true);
  const std::vector<at::Tensor> loop = run(false);
  ASSERT_EQ(grouped.size(), loop.size());
  // Not bit for bit: padding an expert's rows to the capacity changes the GEMM's row count,
  // and with it how LibTorch's CPU GEMM blocks the sums (the [E, C, D] tensors of
  // GroupedExpertGemm itself are bit-exact above). Differences are fp32 summation order:
  // held to 1e-5 absolute on values of size ~4 (max printed on failure).
  for (size_t i = 0; i < grouped.size(); ++i) {
    const double diff = (grouped[i] - loop[i]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5) << "tensor " << i;
  }
  // The empty expert's weight gets a zero gradient (the loop's gets none at all).
  EXPECT_EQ(grouped[4].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(grouped[5].abs().sum().item<double>(), 0.0);
}

TEST(GroupedExpertGemmTest, RefusesMismatchedShapes) {
  EXPECT_THROW(GroupedExpertGemm(Random({4, 6, 16}, 1), Random({3, 8, 16}, 2), at::Tensor()), c10::Error);
  EXPECT_THROW(GroupedExpertGemm(Random({4, 6, 16}, 1), Random({4, 8, 15}, 2), at::Tensor()), c10::Error);
  EXPECT_THROW(GroupedExpertGemm(Random({4, 6, 16}, 1), Random({4, 8, 16}, 2), Random({4, 7}, 3)), c10::Error);
  EXPECT_THROW(RaggedExpertGemm(Random({5, 16}, 1), {2, 2}, {Random({8, 16}, 2), Random({8, 16}, 3)}, {}),
               c10::Error);
}

TEST(GroupedExpertGemmCudaTest, MatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  at::globalContext().setAllowTF32CuBLAS(false);
  const at::Tensor x = Random({8, 64, 128}, 1);
  const at::Tensor w = Random({8, 256, 128}, 2);
  const at::Tensor b = Random({8, 256}, 3);
  const at::Tensor cpu = GroupedExpertGemm(x, w, b);
  EXPECT_LT((GroupedExpertGemm(x.cuda(), w.cuda(), b.cuda()).cpu() - cpu).abs().max().item<double>(), 1e-3);
  const at::Tensor bf16 = GroupedExpertGemm(x.to(at::kBFloat16).cuda(), w.to(at::kBFloat16).cuda(),
                                            b.to(at::kBFloat16).cuda());
  // 128-long dot products of N(0,1) values (|result| ~ 11) rounded to bf16: 2^-8 relative.
  EXPECT_LT((bf16.cpu().to(at::kFloat) - cpu).abs().max().item<double>(), 0.5);
}

}  // namespace
}  // namespace fulcrum::kernels
