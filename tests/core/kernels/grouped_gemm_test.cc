// The batched expert GEMM against moe/'s loop over experts (NOTE [grouped expert GEMM]).
#include "core/kernels/grouped_gemm.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "tests/core/kernels/random_tensor.h"

namespace fulcrum::kernels {
namespace {

using testing::Random;

// On one thread (how ctest runs every test here): with several, LibTorch's CPU bmm splits
// the batch differently from the loop's GEMMs and the sums differ in their last bits (NOTE
// [grouped expert GEMM]); the thread count is pinned so that running the binary directly
// checks the same thing.
TEST(GroupedExpertGemmTest, EqualsThePerExpertLoopBitForBit) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct Restore {
    int threads;
    ~Restore() { at::set_num_threads(threads); }
  } restore{threads};
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

// Padding by expert: zero rows after each expert's own, a view when no expert needs any,
// and UnpadByExpert takes the rows back exactly.
TEST(GroupedExpertGemmTest, PadByExpertRoundTrips) {
  const at::Tensor rows = Random({9, 5}, 4);
  const at::Tensor padded = PadByExpert(rows, {2, 0, 4, 3});
  ASSERT_EQ(padded.sizes(), (std::vector<int64_t>{4, 4, 5}));
  EXPECT_TRUE(at::equal(padded[0].narrow(0, 0, 2), rows.narrow(0, 0, 2)));
  EXPECT_EQ(padded[1].count_nonzero().item<int64_t>(), 0);
  EXPECT_TRUE(at::equal(padded[2], rows.narrow(0, 2, 4)));
  EXPECT_TRUE(at::equal(padded[3].narrow(0, 0, 3), rows.narrow(0, 6, 3)));
  EXPECT_EQ(padded[3][3].count_nonzero().item<int64_t>(), 0);
  EXPECT_TRUE(at::equal(UnpadByExpert(padded, {2, 0, 4, 3}), rows));
  const at::Tensor even = PadByExpert(rows, {3, 3, 3});
  EXPECT_EQ(even.data_ptr(), rows.data_ptr()) << "equal counts: a view, no copy";
  EXPECT_TRUE(at::equal(UnpadByExpert(even, {3, 3, 3}), rows));
  EXPECT_THROW(PadByExpert(rows, {2, 2}), c10::Error);
  EXPECT_THROW(PadByExpert(rows, {10, -1}), c10::Error);
}

// The batched weight gradient is each expert's dyᵀ·x (zero padding rows add nothing); with
// fp32 accumulation bf16 operands give the fp32 product of the widened operands.
TEST(GroupedExpertGemmTest, WeightGradIsEachExpertsProduct) {
  const std::vector<int64_t> counts = {3, 0, 6, 2};
  const at::Tensor dy = Random({11, 7}, 5);
  const at::Tensor x = Random({11, 5}, 6);
  const at::Tensor all = GroupedExpertWeightGrad(PadByExpert(dy, counts), PadByExpert(x, counts),
                                                 /*fp32_accumulate=*/false);
  ASSERT_EQ(all.sizes(), (std::vector<int64_t>{4, 7, 5}));
  int64_t start = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const at::Tensor expected =
        at::matmul(dy.narrow(0, start, counts[e]).t(), x.narrow(0, start, counts[e]));
    EXPECT_TRUE(at::allclose(all[e], expected, 1e-6, 1e-6)) << "expert " << e;
    start += counts[e];
  }
  EXPECT_EQ(all[1].count_nonzero().item<int64_t>(), 0);
  const at::Tensor dy16 = PadByExpert(dy.to(at::kBFloat16), counts);
  const at::Tensor x16 = PadByExpert(x.to(at::kBFloat16), counts);
  const at::Tensor wide = GroupedExpertWeightGrad(dy16, x16, /*fp32_accumulate=*/true);
  EXPECT_EQ(wide.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(wide, at::bmm(dy16.to(at::kFloat).transpose(1, 2), x16.to(at::kFloat))));
  EXPECT_EQ(GroupedExpertWeightGrad(dy16, x16, false).scalar_type(), at::kBFloat16);
  EXPECT_THROW(GroupedExpertWeightGrad(dy16, PadByExpert(x, counts), true), c10::Error);
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
