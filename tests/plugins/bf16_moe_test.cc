// bf16 mixed precision in the MoE layers (NOTE [MoE mixed precision] in moe/moe_layer.cc),
// proven on the CPU in one process: the router computes in fp32 from bf16 tokens (its gates
// and losses are exactly those of the widened tokens); the layer's experts compute in bf16
// over fp32 masters and hand back fp32 gradients; a small MoE GPT's bf16 loss curve tracks
// its fp32 one, and bf16 masters are caught by the tolerance. The two-process ep=2 run is
// tests/recipes/bf16_moe_train_test.cc.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/trainer.h"
#include "gtest/gtest.h"
#include "moe/moe_layer.h"
#include "moe/router.h"
#include "tests/core/test_util.h"
#include "tests/moe/moe_layer_test_util.h"

namespace fulcrum {
namespace {

ModelOptions Bf16(ModelOptions m) {
  m.device_spec.compute_dtype = at::kBFloat16;
  return m;
}

moe::MoeOptions SmallMoe() {
  moe::MoeOptions options;
  options.num_experts = 4;
  options.topk = 2;
  options.router_options.aux_loss_coeff = 1e-2;
  options.router_options.z_loss_coeff = 1e-3;
  return options;
}

// The router widens bf16 tokens to its fp32 weights' dtype before anything else: the
// routing of bf16 tokens is exactly the routing of the same values in fp32 — logits,
// softmax, top-k, gates, balancing and z losses all fp32. A router computing in the tokens'
// bf16 (the broken variant tried: LinearRouter::Logits widening to the hidden dtype and
// casting the weight down) gives bf16 gates that differ in their low bits, and fails here.
TEST(Bf16MoeTest, RouterComputesInFp32FromBf16Tokens) {
  for (const char* name : {"topk", "mixtral", "noisy_topk", "cosine"}) {
    SCOPED_TRACE(name);
    moe::RouterOptions options;
    options.num_experts = 4;
    options.topk = 2;
    options.hidden_size = 32;
    options.aux_loss_coeff = 1e-2;
    options.z_loss_coeff = 1e-3;
    options.seed = 5;
    options.init_scope = "layers.0.mlp";
    auto router = moe::MakeRouter(name, options);
    ASSERT_TRUE(router.ok()) << router.status();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
    const at::Tensor tokens = at::randn({24, 32}, gen).to(at::kBFloat16);
    moe::RouteContext ctx;
    ctx.iteration = 3;
    const moe::Routing from_bf16 = (*router)->Route(tokens, 2, ctx);
    const moe::Routing from_fp32 = (*router)->Route(tokens.to(at::kFloat), 2, ctx);
    EXPECT_EQ(from_bf16.gate.scalar_type(), at::kFloat);
    EXPECT_EQ(from_bf16.probs.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(from_bf16.expert, from_fp32.expert));
    EXPECT_TRUE(at::equal(from_bf16.gate, from_fp32.gate));
    EXPECT_TRUE(at::equal(from_bf16.probs, from_fp32.probs));
    ASSERT_EQ(from_bf16.aux_losses.size(), from_fp32.aux_losses.size());
    ASSERT_FALSE(from_bf16.aux_losses.empty());
    for (size_t i = 0; i < from_bf16.aux_losses.size(); ++i) {
      EXPECT_EQ(from_bf16.aux_losses[i].second.scalar_type(), at::kFloat)
          << from_bf16.aux_losses[i].first;
      EXPECT_TRUE(at::equal(from_bf16.aux_losses[i].second, from_fp32.aux_losses[i].second))
          << from_bf16.aux_losses[i].first;
    }
  }
}

// The layer on bf16 tokens: bf16 out (dispatch, experts and combine keep the tokens'
// dtype), bf16 input gradient, fp32 masters with fp32 gradients for every expert and router
// parameter; and its output is the fp32 layer's on the same tokens up to bf16 rounding
// (measured 8.0e-5 at most on outputs up to 1.06e-2 — bf16's 2^-8 relative step; bound
// 4e-4, 5× that).
TEST(Bf16MoeTest, LayerComputesInBf16OverFp32Masters) {
  ModelOptions model = testing::SmallModel();
  model.add_bias_linear = true;
  moe::MoeOptions options = SmallMoe();
  options.capacity_factor = 0;  // dropless: both runs keep every assignment
  auto bf16 = moe::testing::BuildMoe(options, Bf16(model));
  auto fp32 = moe::testing::BuildMoe(options, model);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor x = at::randn({2, 8, 32}, gen).to(at::kBFloat16).requires_grad_(true);
  ForwardContext ctx(true, 1, 0);
  const at::Tensor y = bf16.block->Forward(x, ctx);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16) << "the layer hands on the tokens' dtype";
  y.to(at::kFloat).square().sum().backward();
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
  int experts_seen = 0, router_seen = 0;
  for (const Parameter& p : bf16.unit->parameters()) {
    EXPECT_EQ(p.value.scalar_type(), at::kFloat) << p.name << ": masters are fp32";
    ASSERT_TRUE(p.value.grad().defined()) << p.name;
    EXPECT_EQ(p.value.grad().scalar_type(), at::kFloat) << p.name << ": gradients are fp32";
    experts_seen += p.name.find("experts.") != std::string::npos;
    router_seen += p.name.find("router.") != std::string::npos;
  }
  EXPECT_EQ(experts_seen, 4 * 4) << "fc1/fc2 weight and bias of 4 experts";
  EXPECT_EQ(router_seen, 1);
  const at::Tensor reference = fp32.block->Forward(x.detach().to(at::kFloat), ctx);
  const double worst = (y.to(at::kFloat) - reference).abs().max().item<double>();
  std::cout << "bf16 vs fp32 MoE layer output: max |Δ| " << worst << " (max |y| "
            << reference.abs().max().item<double>() << ")" << std::endl;
  EXPECT_LE(worst, 4e-4);
}

std::vector<double> MoeLosses(const TrainerConfig& config,
                              std::shared_ptr<const data::IndexedDataset> corpus,
                              int64_t iterations, bool round_masters_to_bf16 = false) {
  auto factory = moe::MakeMoeFactory(SmallMoe(), config.model, moe::MoeGroups());
  EXPECT_TRUE(factory.ok()) << factory.status();
  auto trainer = Trainer::Create(config, corpus, TrainerLayout(), DefaultFileSystem(), *factory);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  std::vector<double> losses;
  for (int64_t i = 0; i < iterations; ++i) {
    auto stats = (*trainer)->TrainIteration();
    EXPECT_TRUE(stats.ok()) << stats.status();
    losses.push_back(stats->loss);
    if (round_masters_to_bf16) {
      // The broken variant: masters (experts' and router's included) kept only to bf16
      // precision, so updates below half a bf16 step are lost.
      at::NoGradGuard no_grad;
      for (Unit* unit : (*trainer)->model().Units()) {
        for (Parameter& p : unit->parameters()) p.value.copy_(p.value.to(at::kBFloat16));
      }
    }
  }
  for (Unit* unit : (*trainer)->model().Units()) {
    for (const Parameter& p : unit->parameters()) {
      EXPECT_EQ(p.value.scalar_type(), at::kFloat) << unit->GlobalName(p.name);
      EXPECT_EQ(p.OptimizerState("exp_avg").scalar_type(), at::kFloat) << unit->GlobalName(p.name);
    }
  }
  return losses;
}

// The mean of a[i] − b[i] over the iterations from `from` on: how far, on average, one loss
// curve lags the other.
double MeanLag(const std::vector<double>& a, const std::vector<double>& b, size_t from) {
  double sum = 0;
  for (size_t i = from; i < a.size(); ++i) sum += a[i] - b[i];
  return sum / static_cast<double>(a.size() - from);
}

// A 2-layer MoE GPT (4 experts, top-2, aux and z losses) trained 20 iterations in bf16
// tracks its fp32 loss curve; the same run with bf16 masters does not. bf16 compute over
// fp32 masters scatters the loss around the fp32 curve, both ways, by as much as the CPU's
// bf16 GEMMs round (max |Δ| 1.12e-3 on an AVX2 CPU, 2.49e-3 on an AMX Xeon, losses near 4);
// masters rounded to bf16 after every step lose every update below half a bf16 step, so that
// run learns more slowly and its loss lags the fp32 curve, growing over the run (2.39e-3 at
// most). So the test looks at the lag, the mean of bf16 − fp32 over iterations 11-20:
// measured on the AMX Xeon -1.5e-4 with fp32 masters, +1.38e-3 with bf16 masters. The bound,
// 6e-4, sits 4× above the first and 2.3× below the second; the scatter is bounded apart, by
// 2× the larger measured maximum. The runs are deterministic on the CPU. (The dense model's
// bound is 1e-3, tests/core/mixed_precision_test.cc; a router computing in bf16 is
// RouterComputesInFp32FromBf16Tokens' broken variant.)
constexpr double kMoeLagTolerance = 6e-4;
constexpr double kMoeScatterTolerance = 5e-3;

TEST(Bf16MoeTest, Bf16MoeGptTracksTheFp32LossCurve) {
  TrainerConfig config = testing::SmallTrainerConfig();
  config.train.train_iters = 20;
  config.schedule.min_lr = 1e-4;
  config.optimizer.lr = config.schedule.lr = 1e-3;
  config.optimizer.min_lr = config.schedule.min_lr;
  auto corpus = testing::SyntheticCorpus(40, 200, config.model.vocab_size);
  const std::vector<double> fp32 = MoeLosses(config, corpus, 20);
  config.model = Bf16(config.model);
  const std::vector<double> bf16 = MoeLosses(config, corpus, 20);
  const std::vector<double> broken = MoeLosses(config, corpus, 20, /*round_masters_to_bf16=*/true);
  ASSERT_EQ(bf16.size(), 20u);
  ASSERT_EQ(broken.size(), 20u);
  const double scatter = testing::MaxAbsDiff(bf16, fp32);
  const double lag = MeanLag(bf16, fp32, 10);
  const double broken_lag = MeanLag(broken, fp32, 10);
  std::cout << "MoE bf16 vs fp32 over 20 iterations: max |Δloss| " << scatter
            << ", mean lag over the last 10 " << lag << "; with bf16 masters: max |Δloss| "
            << testing::MaxAbsDiff(broken, fp32) << ", mean lag " << broken_lag << " (first loss "
            << fp32.front() << ", last " << fp32.back() << " / " << bf16.back() << " / "
            << broken.back() << ")" << std::endl;
  EXPECT_LE(std::abs(lag), kMoeLagTolerance);
  EXPECT_LE(scatter, kMoeScatterTolerance);
  EXPECT_GT(broken_lag, kMoeLagTolerance) << "the lag must catch bf16 masters";
  EXPECT_LT(bf16.back(), bf16.front()) << "it learns";
}

// Every micro-batch's backward through a bf16 MoE GPT leaves fp32 gradients on every
// parameter, the experts' and the router's among them.
TEST(Bf16MoeTest, MoeGptGradientsAreFp32) {
  TrainerConfig config = testing::SmallTrainerConfig();
  config.model = Bf16(config.model);
  auto factory = moe::MakeMoeFactory(SmallMoe(), config.model, moe::MoeGroups());
  ASSERT_TRUE(factory.ok()) << factory.status();
  auto trainer = Trainer::Create(config, testing::SyntheticCorpus(20, 100, config.model.vocab_size),
                                 TrainerLayout(), DefaultFileSystem(), *factory);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  GptModel& model = (*trainer)->model();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor tokens =
      at::randint(0, config.model.vocab_size, {2, config.model.seq_length + 1}, gen, at::kLong);
  ForwardContext ctx(true, 1, 0);
  LossSum loss = model.ForwardLoss(tokens, ctx);
  EXPECT_EQ(loss.sum.scalar_type(), at::kFloat);
  loss.sum.backward();
  int experts = 0;
  for (Unit* unit : model.Units()) {
    for (const Parameter& p : unit->parameters()) {
      const std::string name = unit->GlobalName(p.name);
      EXPECT_EQ(p.value.scalar_type(), at::kFloat) << name;
      ASSERT_TRUE(p.value.grad().defined()) << name;
      EXPECT_EQ(p.value.grad().scalar_type(), at::kFloat) << name;
      experts += name.find(".mlp.experts.") != std::string::npos;
    }
  }
  EXPECT_GT(experts, 0) << "the model has MoE layers";
}

}  // namespace
}  // namespace fulcrum
