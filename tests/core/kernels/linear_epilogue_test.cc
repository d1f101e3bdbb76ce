// The fused linear+GeLU kernels against the unfused LibTorch computation (NOTE [fused
// epilogues] in core/kernels/linear_epilogue.h), and the B/W split's deferred weight
// gradient against the fused backward's.
#include "core/kernels/linear_epilogue.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/linear.h"

#include "tests/core/kernels/random_tensor.h"

namespace fulcrum::kernels {
namespace {

using testing::Random;

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble).cpu() - b.to(at::kDouble).cpu()).abs().max().item<double>();
}

// The model's unfused forward: LinearForward's matmul, + b, MlpActivation's gelu.
at::Tensor UnfusedPre(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor pre = at::matmul(x, w.t());
  return b.defined() ? pre + b : pre;
}

TEST(LinearEpilogueTest, ForwardOnCpuIsTheUnfusedComputationBitForBit) {
  const at::Tensor x = Random({5, 3, 16}, 1);  // [s, b, in]
  const at::Tensor w = Random({24, 16}, 2);
  const at::Tensor b = Random({24}, 3);
  for (bool tanh_approx : {false, true}) {
    const LinearGeluOutput out = LinearBiasGeluForward(x, w, b, tanh_approx);
    const at::Tensor pre = UnfusedPre(x, w, b);
    EXPECT_TRUE(at::equal(out.pre_activation, pre));
    EXPECT_TRUE(at::equal(out.output, at::gelu(pre, tanh_approx ? "tanh" : "none")));
    EXPECT_EQ(out.output.sizes(), (std::vector<int64_t>{5, 3, 24}));
  }
  // No bias (--disable_bias_linear).
  const LinearGeluOutput no_bias = LinearBiasGeluForward(x, w, at::Tensor(), false);
  EXPECT_TRUE(at::equal(no_bias.output, at::gelu(at::matmul(x, w.t()))));
}

TEST(LinearEpilogueTest, ForwardInBf16TracksFp32WithinMeasuredTolerance) {
  // bf16 operands (the same values in both runs): the bf16 path rounds its GEMM result and
  // the GeLU to bf16 (8 bits of mantissa), so each element is held to one bf16 ulp
  // relative (2^-7) plus 0.01; measured max |diff| 0.086 on values up to ~20.
  const at::Tensor x = Random({64, 32}, 4, at::kBFloat16);
  const at::Tensor w = Random({48, 32}, 5, at::kBFloat16);
  const at::Tensor b = Random({48}, 6, at::kBFloat16);
  const LinearGeluOutput half = LinearBiasGeluForward(x, w, b, true);
  EXPECT_EQ(half.output.scalar_type(), at::kBFloat16);
  const LinearGeluOutput full = LinearBiasGeluForward(x.to(at::kFloat), w.to(at::kFloat),
                                                      b.to(at::kFloat), true);
  auto within_one_ulp = [](const at::Tensor& bf16, const at::Tensor& fp32) {
    return ((bf16.to(at::kFloat) - fp32).abs() <= fp32.abs() / 128 + 0.01).all().item<bool>();
  };
  EXPECT_TRUE(within_one_ulp(half.output, full.output)) << MaxAbsDiff(half.output, full.output);
  EXPECT_TRUE(within_one_ulp(half.pre_activation, full.pre_activation))
      << MaxAbsDiff(half.pre_activation, full.pre_activation);
}

TEST(LinearEpilogueTest, InputGradIsAutogradsGeluBackwardThroughTheNextGemm) {
  for (bool tanh_approx : {false, true}) {
    const at::Tensor pre = Random({7, 2, 24}, 7).requires_grad_(true);
    const at::Tensor w2 = Random({16, 24}, 8);  // the next layer: [out, in]
    const at::Tensor dy = Random({7, 2, 16}, 9);
    at::matmul(at::gelu(pre, tanh_approx ? "tanh" : "none"), w2.t()).backward(dy);
    const GeluInputGrad grad = LinearGeluInputGrad(dy, w2, pre.detach(), tanh_approx, true);
    EXPECT_TRUE(at::equal(grad.grad_pre_activation, pre.grad()));
    EXPECT_TRUE(at::equal(grad.grad_bias, pre.grad().reshape({-1, 24}).sum(0)));
    EXPECT_FALSE(LinearGeluInputGrad(dy, w2, pre.detach(), tanh_approx, false).grad_bias.defined());
  }
}

// NOTE [B/W split]: the deferred pass's dW must equal what the fused backward gives, and
// LinearWeightGrad is the GEMM the deferred pass runs.
TEST(LinearEpilogueTest, WeightGradEqualsFusedAndDeferredBackwardBitForBit) {
  const at::Tensor x = Random({6, 4, 16}, 10);
  const at::Tensor dy = Random({6, 4, 24}, 11);
  auto run = [&](bool deferred) {
    at::Tensor w = Random({24, 16}, 12).requires_grad_(true);
    at::Tensor b = Random({24}, 13).requires_grad_(true);
    WeightGradStore store;
    {
      std::optional<WeightGradStore::Scope> scope;
      if (deferred) scope.emplace(&store);
      LinearForward(x, w, b).backward(dy);
    }
    EXPECT_EQ(store.size(), deferred ? 1u : 0u);
    store.Flush();
    return std::make_pair(w.grad(), b.grad());
  };
  const auto [fused_w, fused_b] = run(false);
  const auto [deferred_w, deferred_b] = run(true);
  const WeightGrad kernel = LinearWeightGrad(dy, x, true, false);
  EXPECT_TRUE(at::equal(fused_w, deferred_w));
  EXPECT_TRUE(at::equal(kernel.grad_weight, fused_w));
  EXPECT_TRUE(at::equal(kernel.grad_weight, deferred_w));
  // Autograd reduces the broadcast bias's gradient over (s, b); ours over the folded rows.
  EXPECT_TRUE(at::allclose(kernel.grad_bias, fused_b, 0, 1e-5));
  EXPECT_TRUE(at::equal(fused_b, deferred_b));
  EXPECT_FALSE(LinearWeightGrad(dy, x, false, false).grad_bias.defined());
}

TEST(LinearEpilogueTest, WeightGradAccumulatesBf16OperandsInFp32) {
  const at::Tensor x = Random({256, 32}, 14, at::kBFloat16);
  const at::Tensor dy = Random({256, 16}, 15, at::kBFloat16);
  const WeightGrad fp32 = LinearWeightGrad(dy, x, true, true);
  EXPECT_EQ(fp32.grad_weight.scalar_type(), at::kFloat);
  EXPECT_EQ(fp32.grad_bias.scalar_type(), at::kFloat);
  // bf16 products are exact in fp32, so the only error is fp32 summation over 256 rows
  // (measured 5e-6 on entries up to 51).
  const at::Tensor exact = at::matmul(dy.to(at::kDouble).t(), x.to(at::kDouble));
  EXPECT_LT(MaxAbsDiff(fp32.grad_weight, exact), 1e-4);
  // The bf16-result GEMM rounds to 8 bits of mantissa: far coarser (measured 0.12 on
  // entries up to 51), which is why main_grad accumulates in fp32.
  const WeightGrad bf16 = LinearWeightGrad(dy, x, false, false);
  EXPECT_EQ(bf16.grad_weight.scalar_type(), at::kBFloat16);
  EXPECT_LT(MaxAbsDiff(bf16.grad_weight, exact), 0.25);
}

TEST(LinearEpilogueTest, AccumulateWeightGradAddsIntoMainGrad) {
  const at::Tensor x = Random({3, 5, 16}, 24);
  const at::Tensor dy = Random({3, 5, 8}, 25);
  const at::Tensor before = Random({8, 16}, 26);
  at::Tensor main_grad = before.clone();
  AccumulateWeightGrad(dy, x, main_grad);
  // What AccumulateInto does with the deferred GEMM's result: bit for bit.
  EXPECT_TRUE(at::equal(main_grad, before + LinearWeightGrad(dy, x, false, false).grad_weight));
  // bf16 operands into an fp32 main_grad: accumulated in fp32.
  at::Tensor fp32_grad = at::zeros({8, 16});
  AccumulateWeightGrad(dy.to(at::kBFloat16), x.to(at::kBFloat16), fp32_grad);
  EXPECT_TRUE(at::equal(fp32_grad,
                        LinearWeightGrad(dy.to(at::kBFloat16), x.to(at::kBFloat16), false, true).grad_weight));
  at::Tensor wrong = at::zeros({16, 8});
  EXPECT_THROW(AccumulateWeightGrad(dy, x, wrong), c10::Error);
}

TEST(LinearEpilogueTest, MismatchedShapesAreRefusedByName) {
  const at::Tensor x = Random({4, 16}, 16);
  EXPECT_THROW(
      {
        try {
          LinearBiasGeluForward(x, Random({8, 15}, 17), at::Tensor(), false);
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("LinearBiasGeluForward"), std::string::npos);
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(LinearBiasGeluForward(x, Random({8, 16}, 18), Random({7}, 19), false), c10::Error);
  EXPECT_THROW(LinearWeightGrad(Random({5, 8}, 20), x, true, false), c10::Error);
  EXPECT_THROW(LinearGeluInputGrad(Random({4, 8}, 21), Random({8, 16}, 22), Random({3, 16}, 23),
                                   false, false),
               c10::Error);
}

// --- CUDA: the cuBLASLt epilogues against the CPU computation -------------------------

class LinearEpilogueCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
    // fp32 comparisons are against fp32 math, not TF32's 10-bit mantissa.
    at::globalContext().setAllowTF32CuBLAS(false);
  }
};

TEST_F(LinearEpilogueCudaTest, FusedForwardMatchesCpu) {
  const at::Tensor x = Random({128, 64}, 30);
  const at::Tensor w = Random({96, 64}, 31);
  const at::Tensor b = Random({96}, 32);
  const LinearGeluOutput cpu = LinearBiasGeluForward(x, w, b, true);
  const LinearGeluOutput fp32 = LinearBiasGeluForward(x.cuda(), w.cuda(), b.cuda(), true);
  EXPECT_LT(MaxAbsDiff(fp32.output, cpu.output), 1e-4);
  EXPECT_LT(MaxAbsDiff(fp32.pre_activation, cpu.pre_activation), 1e-4);
  const LinearGeluOutput bf16 = LinearBiasGeluForward(
      x.to(at::kBFloat16).cuda(), w.to(at::kBFloat16).cuda(), b.to(at::kBFloat16).cuda(), true);
  EXPECT_EQ(bf16.output.scalar_type(), at::kBFloat16);
  // bf16 inputs of a 64-long dot product of N(0,1) values (|result| ~ 8): 2^-8 relative.
  EXPECT_LT(MaxAbsDiff(bf16.output, cpu.output), 0.25);
  // Exact GeLU is not fused (cuBLASLt's is tanh), but must agree too.
  EXPECT_LT(MaxAbsDiff(LinearBiasGeluForward(x.cuda(), w.cuda(), b.cuda(), false).output,
                       LinearBiasGeluForward(x, w, b, false).output),
            1e-4);
}

TEST_F(LinearEpilogueCudaTest, FusedInputGradMatchesCpu) {
  const at::Tensor pre = Random({128, 64}, 33);
  const at::Tensor w2 = Random({32, 64}, 34);
  const at::Tensor dy = Random({128, 32}, 35);
  const GeluInputGrad cpu = LinearGeluInputGrad(dy, w2, pre, true, true);
  const GeluInputGrad gpu = LinearGeluInputGrad(dy.cuda(), w2.cuda(), pre.cuda(), true, true);
  // dy·w2 is a 32-long fp32 dot product (|value| up to ~15) times cuBLASLt's tanh-GeLU
  // derivative: an H100 measured 1.1e-4 from the CPU. Using the exact (erf) derivative
  // instead would move each value by up to 9e-4 × |dy·w2|, several times the tolerance.
  EXPECT_LT(MaxAbsDiff(gpu.grad_pre_activation, cpu.grad_pre_activation), 3e-4);
  EXPECT_LT(MaxAbsDiff(gpu.grad_bias, cpu.grad_bias), 1e-3);
}

TEST_F(LinearEpilogueCudaTest, FusedWeightGradMatchesCpuAndAccumulatesInFp32) {
  const at::Tensor x = Random({512, 64}, 36, at::kBFloat16);
  const at::Tensor dy = Random({512, 32}, 37, at::kBFloat16);
  const WeightGrad cpu = LinearWeightGrad(dy, x, true, true);
  const WeightGrad gpu = LinearWeightGrad(dy.cuda(), x.cuda(), true, true);
  EXPECT_EQ(gpu.grad_weight.scalar_type(), at::kFloat);
  EXPECT_LT(MaxAbsDiff(gpu.grad_weight, cpu.grad_weight), 1e-3);
  EXPECT_LT(MaxAbsDiff(gpu.grad_bias, cpu.grad_bias), 1e-3);
  at::Tensor main_grad = at::ones({32, 64}, at::TensorOptions().device(at::kCUDA));
  AccumulateWeightGrad(dy.cuda(), x.cuda(), main_grad);  // beta = 1 into fp32
  EXPECT_LT(MaxAbsDiff(main_grad, cpu.grad_weight + 1), 1e-3);
  // The deferred pass on CUDA is this same call: run twice, the result is identical.
  EXPECT_TRUE(at::equal(gpu.grad_weight, LinearWeightGrad(dy.cuda(), x.cuda(), true, true).grad_weight));
}

}  // namespace
}  // namespace fulcrum::kernels
