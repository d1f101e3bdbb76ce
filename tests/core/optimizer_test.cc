// AdamW against a hand-computed update, gradient clipping, and learning-rate schedules.
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <vector>

#include "core/linear.h"
#include "core/optimizer/adamw.h"
#include "core/optimizer/distributed_adamw.h"
#include "core/parallel_context.h"
#include "core/optimizer/lr_schedule.h"
#include "core/unit.h"
#include "gtest/gtest.h"

namespace fulcrum {
namespace {

class TwoParameterUnit : public Unit {
 public:
  TwoParameterUnit() : Unit("toy") {
    AddParameter("weight", at::tensor({1.0f, -2.0f, 0.5f}), /*weight_decay=*/true);
    AddParameter("bias", at::tensor({0.25f}), /*weight_decay=*/false);
  }
};

void SetGrads(Unit& unit, std::vector<float> w, std::vector<float> b) {
  unit.parameters()[0].value.mutable_grad() = at::tensor(w);
  unit.parameters()[1].value.mutable_grad() = at::tensor(b);
}

// A decayed weight, an undecayed bias, a parameter the tests freeze and one that gets no
// gradient.
class Layer : public Unit {
 public:
  Layer() : Unit("layer") {
    AddParameter("weight", at::zeros({33, 17}), true);
    AddParameter("bias", at::zeros({17}), false);
    AddParameter("frozen", at::zeros({5}), true);
    AddParameter("unused", at::zeros({4}), true);
  }
};

// The AdamW update written out in double precision, element by element.
struct ScalarAdamW {
  double p, m = 0, v = 0;
  void Step(double g, int t, double lr, double wd, double b1, double b2, double eps) {
    p = p * (1 - lr * wd);
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double m_hat = m / (1 - std::pow(b1, t));
    const double v_hat = v / (1 - std::pow(b2, t));
    p = p - lr * m_hat / (std::sqrt(v_hat) + eps);
  }
};

TEST(AdamWTest, TwoStepsMatchHandComputedUpdate) {
  OptimizerOptions options;
  options.weight_decay = 0.1;
  options.adam_beta1 = 0.9;
  options.adam_beta2 = 0.99;
  options.adam_eps = 1e-8;
  AdamW adamw(options);
  TwoParameterUnit unit;
  std::vector<ScalarAdamW> w_ref{{1.0}, {-2.0}, {0.5}};
  ScalarAdamW b_ref{0.25};
  const std::vector<std::vector<float>> w_grads{{0.5f, -0.25f, 2.0f}, {-1.0f, 0.75f, 0.125f}};
  const std::vector<float> b_grads{0.3f, -0.6f};
  const std::vector<double> lrs{0.01, 0.02};
  for (int step = 0; step < 2; ++step) {
    SetGrads(unit, w_grads[step], {b_grads[step]});
    adamw.Step({&unit}, lrs[step]);
    for (int i = 0; i < 3; ++i) {
      w_ref[i].Step(w_grads[step][i], step + 1, lrs[step], 0.1, 0.9, 0.99, 1e-8);
    }
    b_ref.Step(b_grads[step], step + 1, lrs[step], /*wd=*/0.0, 0.9, 0.99, 1e-8);
  }
  EXPECT_EQ(unit.optimizer_step(), 2);
  const at::Tensor w = unit.parameters()[0].value;
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(w[i].item<double>(), w_ref[i].p, 1e-6) << i;
  EXPECT_NEAR(unit.parameters()[1].value[0].item<double>(), b_ref.p, 1e-6);
  EXPECT_NEAR(unit.parameters()[0].OptimizerState("exp_avg")[2].item<double>(), w_ref[2].m, 1e-6);
  EXPECT_NEAR(unit.parameters()[0].OptimizerState("exp_avg_sq")[2].item<double>(), w_ref[2].v, 1e-6);
}

// First step, no decay: m̂ = g, v̂ = g², so every weight moves by lr·g/(|g|+eps) ≈ lr·sign(g).
TEST(AdamWTest, FirstStepMovesBySignOfGradient) {
  OptimizerOptions options;
  options.weight_decay = 0.0;
  TwoParameterUnit unit;
  SetGrads(unit, {3.0f, -0.001f, 0.0f}, {10.0f});
  AdamW(options).Step({&unit}, 0.1);
  const at::Tensor w = unit.parameters()[0].value;
  EXPECT_NEAR(w[0].item<double>(), 1.0 - 0.1, 1e-6);
  EXPECT_NEAR(w[1].item<double>(), -2.0 + 0.1, 1e-5);
  EXPECT_NEAR(w[2].item<double>(), 0.5, 1e-7) << "zero gradient, zero update";
}

TEST(AdamWTest, ParametersWithoutGradientsAreLeftAlone) {
  TwoParameterUnit unit;
  unit.parameters()[0].value.mutable_grad() = at::tensor({1.0f, 1.0f, 1.0f});
  AdamW(OptimizerOptions()).Step({&unit}, 0.1);
  EXPECT_FLOAT_EQ(unit.parameters()[1].value[0].item<float>(), 0.25f);
  EXPECT_FALSE(unit.parameters()[1].OptimizerState("exp_avg").defined());
}

TEST(AdamWTest, GradNormAndClipping) {
  TwoParameterUnit unit;
  SetGrads(unit, {3.0f, 0.0f, 0.0f}, {4.0f});
  EXPECT_DOUBLE_EQ(AdamW::GradSquaredSum({&unit}), 25.0);
  OptimizerOptions options;
  options.clip_grad = 1.0;
  AdamW adamw(options);
  const double factor = adamw.ClipFactor(5.0);
  EXPECT_NEAR(factor, 1.0 / (5.0 + 1e-6), 1e-12);
  AdamW::ScaleGradients({&unit}, factor);
  EXPECT_NEAR(std::sqrt(AdamW::GradSquaredSum({&unit})), 1.0, 1e-6);
  EXPECT_EQ(adamw.ClipFactor(0.5), 1.0) << "norms under the bound are not scaled";
  options.clip_grad = 0.0;
  EXPECT_EQ(AdamW(options).ClipFactor(1e9), 1.0) << "clip_grad=0 disables clipping";
}

// The one-pass fp32 sum (any length, not a multiple of its 8 running sums; a
// non-contiguous gradient) equals the fp64 sum of the squares, computed here by hand.
TEST(AdamWTest, GradSquaredSumIsFp64SumOfSquares) {
  class BigUnit : public Unit {
   public:
    BigUnit() : Unit("big") {
      AddParameter("a", at::zeros({1003}), true);
      AddParameter("b", at::zeros({7, 5}), true);
    }
  } unit;
  torch::manual_seed(3);
  unit.parameters()[0].value.mutable_grad() = torch::randn({1003}) * 1e3;
  unit.parameters()[1].value.mutable_grad() = torch::randn({5, 7}).t();  // non-contiguous
  double expected = 0.0;
  for (const Parameter& p : unit.parameters()) {
    const at::Tensor g = p.value.grad().contiguous();
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double x = g.data_ptr<float>()[i];
      expected += x * x;
    }
  }
  const double got = AdamW::GradSquaredSum({&unit});
  EXPECT_NEAR(got, expected, 1e-12 * expected);
  EXPECT_GT(got, 1e8) << "the gradients were summed";
}

// NOTE [fused AdamW on a device]: LibTorch's fused AdamW (the GPU's default; forced here
// on the CPU) gives the per-tensor update to fp32 rounding: over three steps of units with
// decayed and undecayed parameters, one unit further along (its own step count: a group of
// its own), a frozen parameter (left alone) and one without a gradient (no state made).
// The bound is 1e-6 relative to the weights' scale; decaying the undecayed group, or
// sharing one step count across the units, moves weights by ~1e-3 and fails it.
TEST(AdamWTest, FusedMatchesPerTensor) {
  OptimizerOptions options;
  options.weight_decay = 0.1;
  options.adam_beta2 = 0.95;
  auto run = [&](AdamW::Kernel kernel) {
    torch::manual_seed(11);
    std::vector<std::unique_ptr<Layer>> layers;
    for (int i = 0; i < 2; ++i) {
      layers.push_back(std::make_unique<Layer>());
      for (Parameter& p : layers.back()->parameters()) p.value.data().normal_();
      layers.back()->parameters()[2].value.requires_grad_(false);
    }
    layers[1]->set_optimizer_step(40);  // further along: its bias corrections are others
    AdamW adamw(options);
    adamw.set_kernel(kernel);
    for (int step = 0; step < 3; ++step) {
      for (auto& layer : layers) {
        for (int i = 0; i < 3; ++i) {
          at::Tensor& p = layer->parameters()[i].value;
          p.mutable_grad() = torch::randn(p.sizes());
        }
      }
      adamw.Step({layers[0].get(), layers[1].get()}, 0.05);
    }
    return layers;
  };
  const auto per_tensor = run(AdamW::Kernel::kPerTensor);
  const auto fused = run(AdamW::Kernel::kFused);
  double worst = 0.0, moved = 0.0;
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(fused[l]->optimizer_step(), per_tensor[l]->optimizer_step());
    for (size_t i = 0; i < 4; ++i) {
      const Parameter& a = per_tensor[l]->parameters()[i];
      const Parameter& b = fused[l]->parameters()[i];
      worst = std::max(worst, (a.value - b.value).abs().max().item<double>());
      if (a.OptimizerState("exp_avg").defined() || b.OptimizerState("exp_avg").defined()) {
        ASSERT_TRUE(a.OptimizerState("exp_avg").defined() && b.OptimizerState("exp_avg").defined()) << a.name;
        worst = std::max(worst, (a.OptimizerState("exp_avg") - b.OptimizerState("exp_avg")).abs().max().item<double>());
        worst = std::max(worst, (a.OptimizerState("exp_avg_sq") - b.OptimizerState("exp_avg_sq")).abs().max().item<double>());
      }
    }
    // The frozen parameter and the one without a gradient did not move, in either.
    torch::manual_seed(11);
    EXPECT_FALSE(fused[l]->parameters()[3].OptimizerState("exp_avg").defined());
  }
  // The update happened: the weights are far from where the same seed started them.
  {
    torch::manual_seed(11);
    Layer start;
    for (Parameter& p : start.parameters()) p.value.data().normal_();
    moved = (start.parameters()[0].value - fused[0]->parameters()[0].value).abs().max().item<double>();
    EXPECT_TRUE(at::equal(start.parameters()[2].value, fused[0]->parameters()[2].value))
        << "the frozen parameter moved";
  }
  EXPECT_GT(moved, 0.05);
  EXPECT_LT(worst, 1e-6) << "fused AdamW differs from the per-tensor update by " << worst;
}

// The fused kernel writes the weights behind autograd's back; Step bumps their version
// counters so that everything keyed on them sees the step: here the bf16 compute copy
// (NOTE [compute copies of the weights]) holds the stepped weight, as after a per-tensor
// step. Without the bump the copy keeps the weight before the step (the bug a GPU run found).
TEST(AdamWTest, StepsOfBothKernelsBumpTheWeightsVersion) {
  for (const AdamW::Kernel kernel : {AdamW::Kernel::kPerTensor, AdamW::Kernel::kFused}) {
    TwoParameterUnit unit;
    SetGrads(unit, {0.5f, -0.25f, 2.0f}, {0.3f});
    const at::Tensor& w = unit.parameters()[0].value;
    const at::Tensor before = ComputeCopyOf(w, at::kBFloat16).clone();
    const int64_t version = w._version();
    AdamW adamw(OptimizerOptions{});
    adamw.set_kernel(kernel);
    adamw.Step({&unit}, 0.5);
    EXPECT_GT(w._version(), version);
    const at::Tensor after = ComputeCopyOf(w, at::kBFloat16);
    EXPECT_TRUE(at::equal(after, w.detach().to(at::kBFloat16)));
    EXPECT_FALSE(at::equal(after, before)) << "the step moved nothing";
  }
}

// The distributed optimizer on one rank (every slice the whole bucket) against AdamW: the
// same reduce → norm → clip → step, so the same bits — weights, moments (made whole by
// GatherState) and step counters — with clipping active, several buckets, a frozen
// parameter and one without a gradient. Then a checkpoint-style hand-over: moments written
// into the Parameters (as a load does) are adopted, and the steps go on as AdamW's.
TEST(DistributedAdamWTest, OneRankStepsAsAdamWBitForBit) {
  OptimizerOptions options;
  options.weight_decay = 0.1;
  options.adam_beta2 = 0.95;
  options.clip_grad = 0.5;  // the random gradients' norm is ~25: clipping acts
  SingleProcessContext one;
  auto make = [] {
    torch::manual_seed(11);
    std::vector<std::unique_ptr<Layer>> layers;
    for (int i = 0; i < 2; ++i) {
      layers.push_back(std::make_unique<Layer>());
      for (Parameter& p : layers.back()->parameters()) p.value.data().normal_();
      layers.back()->parameters()[2].value.requires_grad_(false);
    }
    return layers;
  };
  auto grads = [](std::vector<std::unique_ptr<Layer>>& layers, int step) {
    torch::manual_seed(100 + step);
    for (auto& layer : layers) {
      for (int i = 0; i < 3; ++i) {
        at::Tensor& p = layer->parameters()[i].value;
        p.mutable_grad() = torch::randn(p.sizes());
      }
    }
  };
  auto reference = make();
  auto sharded = make();
  std::vector<Unit*> ref_units{reference[0].get(), reference[1].get()};
  std::vector<Unit*> units{sharded[0].get(), sharded[1].get()};
  AdamW adamw(options);
  adamw.set_kernel(AdamW::Kernel::kPerTensor);
  DistributedAdamW distributed(options, /*bucket_bytes=*/1024);
  auto expect_same = [&](const char* when) {
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(sharded[l]->optimizer_step(), reference[l]->optimizer_step()) << when;
      for (size_t i = 0; i < 4; ++i) {
        const Parameter& a = reference[l]->parameters()[i];
        const Parameter& b = sharded[l]->parameters()[i];
        EXPECT_TRUE(at::equal(a.value, b.value)) << when << ": " << a.name << " of layer " << l;
      }
    }
  };
  for (int step = 0; step < 3; ++step) {
    grads(reference, step);
    grads(sharded, step);
    StepRequest request;
    request.lr = 0.05;
    const auto want = adamw.ReduceAndStep(ref_units, one, request);
    const auto got = distributed.ReduceAndStep(units, one, request);
    ASSERT_TRUE(want.ok() && got.ok());
    EXPECT_TRUE(got->stepped);
    EXPECT_GT(got->grad_norm, 1.0) << "clipping must act in this test";
    EXPECT_DOUBLE_EQ(got->grad_norm, want->grad_norm);
    expect_same("after a step");
  }
  EXPECT_GT(distributed.num_buckets(), 2u) << "a 1 KiB budget cuts the 4.7 KiB of weights";
  // The moments the whole: no Parameter holds them until GatherState.
  EXPECT_FALSE(sharded[0]->parameters()[0].OptimizerState("exp_avg").defined());
  EXPECT_EQ(distributed.StateBytes(units), 2 * 2 * (33 * 17 + 17 + 5 + 4) * 4);
  ASSERT_TRUE(distributed.GatherState(units, one).ok());
  for (int l = 0; l < 2; ++l) {
    for (size_t i : {0, 1}) {
      const Parameter& a = reference[l]->parameters()[i];
      const Parameter& b = sharded[l]->parameters()[i];
      ASSERT_TRUE(b.OptimizerState("exp_avg").defined());
      EXPECT_TRUE(at::equal(a.OptimizerState("exp_avg"), b.OptimizerState("exp_avg"))) << a.name;
      EXPECT_TRUE(at::equal(a.OptimizerState("exp_avg_sq"), b.OptimizerState("exp_avg_sq"))) << a.name;
    }
    // Never stepped: zeros, where AdamW never made moments at all.
    EXPECT_FALSE(reference[l]->parameters()[3].OptimizerState("exp_avg").defined());
    EXPECT_EQ(sharded[l]->parameters()[3].OptimizerState("exp_avg").abs().sum().item<double>(), 0.0);
  }
  distributed.ReleaseState(units);
  EXPECT_FALSE(sharded[1]->parameters()[0].OptimizerState("exp_avg_sq").defined());
  // A load writes whole moments into the Parameters: here the reference's, scaled, into
  // both; the next step must start from them.
  for (int l = 0; l < 2; ++l) {
    for (size_t i : {0, 1}) {
      Parameter& a = reference[l]->parameters()[i];
      a.OptimizerState("exp_avg").mul_(0.5);
      sharded[l]->parameters()[i].OptimizerState("exp_avg") = a.OptimizerState("exp_avg").clone();
      sharded[l]->parameters()[i].OptimizerState("exp_avg_sq") = a.OptimizerState("exp_avg_sq").clone();
    }
  }
  grads(reference, 7);
  grads(sharded, 7);
  StepRequest request;
  request.lr = 0.05;
  ASSERT_TRUE(adamw.ReduceAndStep(ref_units, one, request).ok());
  ASSERT_TRUE(distributed.ReduceAndStep(units, one, request).ok());
  expect_same("after adopting written moments");
  EXPECT_FALSE(sharded[0]->parameters()[0].OptimizerState("exp_avg").defined()) << "adopted, then dropped";
}

// Layers that leave and arrive after GatherState (what the pipeline runner's hook does
// before layers move): the next step cuts a new layout and goes on as AdamW would with
// the same units, bit for bit — the staying unit's state from the gather, the arriving
// one's from what it carried.
TEST(DistributedAdamWTest, ReSlicesAfterLayersMoveWithTheirGatheredState) {
  SingleProcessContext one;
  OptimizerOptions options;
  options.clip_grad = 0;
  TwoParameterUnit ref_a, ref_b, a, b;
  AdamW adamw(options);
  adamw.set_kernel(AdamW::Kernel::kPerTensor);
  DistributedAdamW distributed(options, /*bucket_bytes=*/8);
  StepRequest request;
  request.lr = 0.01;
  for (int step = 0; step < 2; ++step) {
    for (Unit* u : std::vector<Unit*>{&ref_a, &ref_b, &a, &b}) SetGrads(*u, {1.0f + step, -2, 3}, {0.5});
    ASSERT_TRUE(adamw.ReduceAndStep({&ref_a, &ref_b}, one, request).ok());
    ASSERT_TRUE(distributed.ReduceAndStep({&a, &b}, one, request).ok());
  }
  // b leaves; c arrives carrying b's state (as a migration's payload would).
  ASSERT_TRUE(distributed.GatherState({&a, &b}, one).ok());
  TwoParameterUnit c;
  c.set_optimizer_step(b.optimizer_step());
  for (size_t i = 0; i < 2; ++i) {
    c.parameters()[i].value.data().copy_(b.parameters()[i].value);
    c.parameters()[i].OptimizerState("exp_avg") = b.parameters()[i].OptimizerState("exp_avg").clone();
    c.parameters()[i].OptimizerState("exp_avg_sq") = b.parameters()[i].OptimizerState("exp_avg_sq").clone();
  }
  for (Unit* u : std::vector<Unit*>{&ref_a, &ref_b, &a, &c}) SetGrads(*u, {4, 5, -6}, {0.25});
  ASSERT_TRUE(adamw.ReduceAndStep({&ref_a, &ref_b}, one, request).ok());
  ASSERT_TRUE(distributed.ReduceAndStep({&c, &a}, one, request).ok());
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(a.parameters()[i].value, ref_a.parameters()[i].value));
    EXPECT_TRUE(at::equal(c.parameters()[i].value, ref_b.parameters()[i].value));
  }
  EXPECT_EQ(c.optimizer_step(), 3);
}

// A layer that left (or joined) the optimizer's parameters without a gather first is
// refused, not stepped on slices cut for other parameters.
TEST(DistributedAdamWTest, RefusesAChangedSetOfParameters) {
  TwoParameterUnit a, b;
  SingleProcessContext one;
  DistributedAdamW distributed(OptimizerOptions{});
  SetGrads(a, {1, 2, 3}, {4});
  StepRequest request;
  request.lr = 0.01;
  ASSERT_TRUE(distributed.ReduceAndStep({&a}, one, request).ok());
  SetGrads(a, {1, 2, 3}, {4});
  SetGrads(b, {1, 2, 3}, {4});
  const auto moved = distributed.ReduceAndStep({&a, &b}, one, request);
  ASSERT_FALSE(moved.ok());
  EXPECT_NE(std::string(moved.status().message()).find("not supported yet"), std::string::npos)
      << moved.status();
}

TEST(LrScheduleTest, WarmupThenCosine) {
  LrScheduleOptions o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_iters = 10;
  o.decay_iters = 110;
  o.decay_style = LrDecayStyle::kCosine;
  LrSchedule schedule(o, /*train_iters=*/1000);
  EXPECT_DOUBLE_EQ(schedule.At(1), 0.1);
  EXPECT_DOUBLE_EQ(schedule.At(5), 0.5);
  EXPECT_DOUBLE_EQ(schedule.At(10), 1.0);
  EXPECT_NEAR(schedule.At(60), 0.55, 1e-12) << "half way: (max + min) / 2";
  EXPECT_NEAR(schedule.At(35), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
  EXPECT_DOUBLE_EQ(schedule.At(110), 0.1);
  EXPECT_DOUBLE_EQ(schedule.At(500), 0.1);
}

TEST(LrScheduleTest, LinearAndConstant) {
  LrScheduleOptions o;
  o.lr = 2.0;
  o.min_lr = 0.0;
  o.decay_style = LrDecayStyle::kLinear;
  LrSchedule linear(o, /*train_iters=*/100);  // decay_iters 0 → train_iters
  EXPECT_DOUBLE_EQ(linear.At(0), 2.0);
  EXPECT_DOUBLE_EQ(linear.At(25), 1.5);
  EXPECT_DOUBLE_EQ(linear.At(100), 0.0);
  o.decay_style = LrDecayStyle::kConstant;
  o.warmup_iters = 4;
  LrSchedule constant(o, 100);
  EXPECT_DOUBLE_EQ(constant.At(2), 1.0);
  EXPECT_DOUBLE_EQ(constant.At(4), 2.0);
  EXPECT_DOUBLE_EQ(constant.At(99), 2.0);
}

}  // namespace
}  // namespace fulcrum
