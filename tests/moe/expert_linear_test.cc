// ExpertLinear (moe/expert_linear.h): the per-expert path is the MoE layer's former loop of
// LinearForward bit for bit (fp32, and bf16 rows over fp32 masters), the batched path
// agrees within a measured tolerance, and under an active WeightGradStore both defer every
// expert's weight gradient into one tagged closure whose W action reproduces the fused
// gradients bit for bit. An expert with no rows gets zero gradients, as in the loop.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/linear.h"
#include "moe/expert_linear.h"

namespace fulcrum::moe {
namespace {

constexpr int64_t kIn = 12;
constexpr int64_t kOut = 20;
// Expert 1 has no rows; the others differ, so the batched path pads.
const std::vector<int64_t> kCounts = {3, 0, 7, 2};

struct Experts {
  std::vector<at::Tensor> weights, biases;
};

Experts MakeExperts(bool with_bias, uint64_t seed) {
  at::manual_seed(seed);
  Experts ex;
  for (size_t e = 0; e < kCounts.size(); ++e) {
    ex.weights.push_back(at::randn({kOut, kIn}).set_requires_grad(true));
    if (with_bias) ex.biases.push_back(at::randn({kOut}).set_requires_grad(true));
  }
  return ex;
}

// Everything one forward and backward produced: output, the rows' gradient, and each
// weight's and bias's .grad (undefined when it has none).
struct Result {
  at::Tensor out, rows_grad;
  std::vector<at::Tensor> weight_grads, bias_grads;
};

Result Collect(const at::Tensor& out, const at::Tensor& rows, const Experts& ex) {
  Result r;
  r.out = out.defined() ? out.detach() : at::Tensor();
  r.rows_grad = rows.grad().defined() ? rows.grad().clone() : at::Tensor();
  auto grad = [](const at::Tensor& p) { return p.grad().defined() ? p.grad().clone() : at::Tensor(); };
  for (const at::Tensor& w : ex.weights) r.weight_grads.push_back(grad(w));
  for (const at::Tensor& b : ex.biases) r.bias_grads.push_back(grad(b));
  return r;
}

void ClearGrads(const at::Tensor& rows, const Experts& ex) {
  const_cast<at::Tensor&>(rows).mutable_grad() = at::Tensor();
  for (const at::Tensor& w : ex.weights) const_cast<at::Tensor&>(w).mutable_grad() = at::Tensor();
  for (const at::Tensor& b : ex.biases) const_cast<at::Tensor&>(b).mutable_grad() = at::Tensor();
}

// The MoE layer's loop before ExpertLinear.
at::Tensor Loop(const at::Tensor& rows, const Experts& ex) {
  std::vector<at::Tensor> outputs;
  const std::vector<at::Tensor> inputs = rows.split_with_sizes(kCounts);
  for (size_t e = 0; e < kCounts.size(); ++e) {
    outputs.push_back(LinearForward(inputs[e], ex.weights[e],
                                    ex.biases.empty() ? at::Tensor() : ex.biases[e]));
  }
  return at::cat(outputs);
}

// A forward and backward of `f` on fresh rows (of `dtype`) against a fixed upstream gradient.
template <typename F>
Result ForwardBackward(const Experts& ex, at::ScalarType dtype, F f) {
  at::manual_seed(11);
  const int64_t total = 12;
  at::Tensor rows = at::randn({total, kIn}).to(dtype).set_requires_grad(true);
  const at::Tensor upstream = at::randn({total, kOut}).to(dtype);
  ClearGrads(rows, ex);
  at::Tensor out = f(rows);
  (out * upstream).sum().backward();
  Result r = Collect(out, rows, ex);
  ClearGrads(rows, ex);
  return r;
}

void ExpectBitIdentical(const Result& a, const Result& b) {
  EXPECT_TRUE(a.out.equal(b.out)) << "forward";
  EXPECT_TRUE(a.rows_grad.equal(b.rows_grad)) << "rows' gradient";
  ASSERT_EQ(a.weight_grads.size(), b.weight_grads.size());
  for (size_t e = 0; e < a.weight_grads.size(); ++e) {
    ASSERT_TRUE(a.weight_grads[e].defined() && b.weight_grads[e].defined()) << "expert " << e;
    EXPECT_EQ(a.weight_grads[e].scalar_type(), b.weight_grads[e].scalar_type());
    EXPECT_TRUE(a.weight_grads[e].equal(b.weight_grads[e])) << "weight of expert " << e;
  }
  ASSERT_EQ(a.bias_grads.size(), b.bias_grads.size());
  for (size_t e = 0; e < a.bias_grads.size(); ++e) {
    ASSERT_TRUE(a.bias_grads[e].defined() && b.bias_grads[e].defined()) << "expert " << e;
    EXPECT_TRUE(a.bias_grads[e].equal(b.bias_grads[e])) << "bias of expert " << e;
  }
}

TEST(ExpertLinearTest, PerExpertPathIsTheLoopOfLinearForwardBitForBit) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(absl::StrCat(c10::toString(dtype), with_bias ? " with biases" : " no biases"));
      const Experts ex = MakeExperts(with_bias, 3);
      const Result loop = ForwardBackward(ex, dtype, [&](const at::Tensor& rows) { return Loop(rows, ex); });
      const Result grouped = ForwardBackward(ex, dtype, [&](const at::Tensor& rows) {
        return ExpertLinear(rows, kCounts, ex.weights, ex.biases, ExpertGemmPath::kPerExpert);
      });
      ExpectBitIdentical(loop, grouped);
      // The expert without rows: a zero gradient, defined, as the loop gives it; fp32 like
      // its master (NOTE [mixed precision]).
      EXPECT_EQ(grouped.weight_grads[1].scalar_type(), at::kFloat);
      EXPECT_EQ(grouped.weight_grads[1].count_nonzero().item<int64_t>(), 0);
      EXPECT_GT(grouped.weight_grads[0].count_nonzero().item<int64_t>(), 0);
    }
  }
}

TEST(ExpertLinearTest, BatchedPathAgreesWithTheLoopWithinFloatRounding) {
  // Padding adds exact zero products, but the batched GEMM's row count differs from each
  // expert's, which may change its blocking and so the order of the fp32 sums.
  const Experts ex = MakeExperts(/*with_bias=*/true, 5);
  const Result loop = ForwardBackward(ex, at::kFloat, [&](const at::Tensor& rows) { return Loop(rows, ex); });
  const Result batched = ForwardBackward(ex, at::kFloat, [&](const at::Tensor& rows) {
    return ExpertLinear(rows, kCounts, ex.weights, ex.biases, ExpertGemmPath::kBatched);
  });
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
  };
  double worst = rel(batched.out, loop.out);
  worst = std::max(worst, rel(batched.rows_grad, loop.rows_grad));
  for (size_t e = 0; e < kCounts.size(); ++e) {
    if (kCounts[e] == 0) {
      EXPECT_EQ(batched.weight_grads[e].count_nonzero().item<int64_t>(), 0);
      EXPECT_EQ(batched.bias_grads[e].count_nonzero().item<int64_t>(), 0);
      continue;
    }
    worst = std::max(worst, rel(batched.weight_grads[e], loop.weight_grads[e]));
    worst = std::max(worst, rel(batched.bias_grads[e], loop.bias_grads[e]));
  }
  // A few fp32 ulps of the largest magnitude over sums of ≤ 12 terms.
  EXPECT_LE(worst, 1e-6);
}

// Under an active store: after B the weights have no gradient yet and the biases have
// theirs; the store holds one closure with the forward's tag and the bytes of dy and x;
// the W action then gives exactly the fused gradients — also accumulated over two
// micro-batches, with a closure from another tag interleaved and left queued.
TEST(ExpertLinearTest, DeferredWeightGradientsEqualTheFusedOnesBitForBit) {
  for (ExpertGemmPath path : {ExpertGemmPath::kPerExpert, ExpertGemmPath::kBatched}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(absl::StrCat(path == ExpertGemmPath::kBatched ? "batched " : "per expert ",
                                c10::toString(dtype)));
      const Experts ex = MakeExperts(/*with_bias=*/true, 7);
      at::manual_seed(13);
      std::vector<at::Tensor> rows, upstream;
      for (int mb = 0; mb < 2; ++mb) {
        rows.push_back(at::randn({12, kIn}).to(dtype).set_requires_grad(true));
        upstream.push_back(at::randn({12, kOut}).to(dtype));
      }
      // The tag is the forward's (NOTE [weight-gradient tags]): the backward runs outside it.
      auto backward = [&](int mb) {
        at::Tensor out;
        {
          WeightGradStore::TagScope tag(5);
          out = ExpertLinear(rows[mb], kCounts, ex.weights, ex.biases, path);
        }
        (out * upstream[mb]).sum().backward();
      };
      for (int mb = 0; mb < 2; ++mb) backward(mb);
      const Result fused = Collect(at::Tensor(), rows[1], ex);
      ClearGrads(rows[0], ex);
      ClearGrads(rows[1], ex);

      WeightGradStore store;
      bool other_ran = false;
      {
        WeightGradStore::Scope scope(&store);
        for (int mb = 0; mb < 2; ++mb) {
          backward(mb);
          store.Push([&other_ran] { other_ran = true; }, /*tag=*/6);
        }
      }
      ASSERT_EQ(store.size(), 4u);  // per micro-batch: one closure for all experts, one other
      const int64_t bytes_per_mb = 12 * (kIn + kOut) * at::elementSize(dtype);
      EXPECT_EQ(store.held_bytes(), 2 * bytes_per_mb);
      for (const at::Tensor& w : ex.weights) EXPECT_FALSE(w.grad().defined()) << "deferred";
      for (const at::Tensor& b : ex.biases) EXPECT_TRUE(b.grad().defined()) << "bias in B";
      store.FlushTag(5);
      EXPECT_FALSE(other_ran);
      EXPECT_EQ(store.size(), 2u);
      const Result deferred = Collect(at::Tensor(), rows[1], ex);
      ClearGrads(rows[0], ex);
      ClearGrads(rows[1], ex);
      for (size_t e = 0; e < kCounts.size(); ++e) {
        ASSERT_TRUE(deferred.weight_grads[e].defined()) << "expert " << e;
        EXPECT_EQ(deferred.weight_grads[e].scalar_type(), at::kFloat);
        EXPECT_TRUE(deferred.weight_grads[e].equal(fused.weight_grads[e])) << "expert " << e;
        EXPECT_TRUE(deferred.bias_grads[e].equal(fused.bias_grads[e])) << "expert " << e;
      }
      EXPECT_TRUE(deferred.rows_grad.equal(fused.rows_grad));
      EXPECT_EQ(deferred.weight_grads[1].count_nonzero().item<int64_t>(), 0);
    }
  }
}

// Frozen experts: no weight-gradient work, fused or deferred; the rows still get theirs.
TEST(ExpertLinearTest, FrozenExpertsQueueNoWeightGradient) {
  Experts ex = MakeExperts(/*with_bias=*/false, 9);
  for (at::Tensor& w : ex.weights) w.requires_grad_(false);
  at::Tensor rows = at::randn({12, kIn}).set_requires_grad(true);
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(&store);
    ExpertLinear(rows, kCounts, ex.weights, ex.biases, ExpertGemmPath::kBatched).sum().backward();
  }
  EXPECT_TRUE(store.empty());
  EXPECT_TRUE(rows.grad().defined());
}

TEST(ExpertLinearTest, RefusesMismatchedInput) {
  const Experts ex = MakeExperts(/*with_bias=*/true, 1);
  const at::Tensor rows = at::randn({12, kIn});
  auto message = [](auto f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { ExpertLinear(rows, {3, 0, 7}, ex.weights, ex.biases); })
                .find("3 row counts for 4 expert weights"),
            std::string::npos);
  EXPECT_NE(message([&] { ExpertLinear(rows, {3, 0, 7, 3}, ex.weights, ex.biases); })
                .find("row counts sum to 13 but rows has 12"),
            std::string::npos);
  EXPECT_NE(message([&] { ExpertLinear(rows, {3, -1, 8, 2}, ex.weights, ex.biases); })
                .find("expert 1 has -1 rows"),
            std::string::npos);
  EXPECT_NE(message([&] { ExpertLinear(rows, kCounts, ex.weights, {ex.biases[0]}); })
                .find("1 biases for 4 experts"),
            std::string::npos);
  std::vector<at::Tensor> odd = ex.weights;
  odd[2] = at::randn({kOut, kIn + 1});
  EXPECT_NE(message([&] { ExpertLinear(rows, kCounts, odd, ex.biases); }).find("expert 2's weight"),
            std::string::npos);
}

// On CUDA kAuto batches: it agrees with the CPU's per-expert result, and the deferred W
// pass equals the fused one bit for bit there too (the same batched GEMMs on the same
// operands), fp32 and bf16 over fp32 masters. Runs under tools/gpu_check.sh.
TEST(ExpertLinearCudaTest, BatchedMatchesTheCpuAndDefersExactly) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  at::globalContext().setAllowTF32CuBLAS(false);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Experts cpu = MakeExperts(/*with_bias=*/true, 21);
    Experts gpu;
    for (const at::Tensor& w : cpu.weights) gpu.weights.push_back(w.detach().cuda().requires_grad_());
    for (const at::Tensor& b : cpu.biases) gpu.biases.push_back(b.detach().cuda().requires_grad_());
    ASSERT_TRUE(BatchesExperts(gpu.weights[0]));
    const Result reference = ForwardBackward(cpu, dtype, [&](const at::Tensor& rows) {
      return ExpertLinear(rows, kCounts, cpu.weights, cpu.biases);
    });
    // The rows travel to the device and the output back, differentiably.
    const Result fused = ForwardBackward(gpu, dtype, [&](const at::Tensor& rows) {
      return ExpertLinear(rows.cuda(), kCounts, gpu.weights, gpu.biases).cpu();
    });
    const double tolerance = dtype == at::kFloat ? 1e-4 : 0.1;
    EXPECT_LT((fused.out.to(at::kFloat) - reference.out.to(at::kFloat)).abs().max().item<double>(),
              tolerance);
    for (size_t e = 0; e < kCounts.size(); ++e) {
      EXPECT_EQ(fused.weight_grads[e].scalar_type(), at::kFloat);
      EXPECT_LT((fused.weight_grads[e].cpu() - reference.weight_grads[e]).abs().max().item<double>(),
                tolerance) << "expert " << e;
    }
    // Deferred on the device: the store is active during the backward, then flushed.
    WeightGradStore store;
    at::manual_seed(11);
    at::Tensor rows = at::randn({12, kIn}).to(dtype).cuda().requires_grad_(true);
    const at::Tensor upstream = at::randn({12, kOut}).to(dtype).cuda();
    ClearGrads(rows, gpu);
    {
      WeightGradStore::Scope scope(&store);
      (ExpertLinear(rows, kCounts, gpu.weights, gpu.biases) * upstream).sum().backward();
    }
    ASSERT_EQ(store.size(), 1u);
    store.Flush();
    for (size_t e = 0; e < kCounts.size(); ++e) {
      EXPECT_TRUE(gpu.weights[e].grad().cpu().equal(fused.weight_grads[e].cpu())) << "expert " << e;
    }
  }
}

}  // namespace
}  // namespace fulcrum::moe
