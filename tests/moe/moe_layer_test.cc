// The MoE layer in one process against a direct reference: every token's output is the
// gate-weighted sum of its experts' MLPs (computed here expert by expert from the layer's
// own parameters), with the same gradients; drops, the auxiliary-loss gradient scale, the
// step's statistics, router state as unit buffers, and which layers are MoE.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/linear.h"
#include "core/transformer_layer.h"
#include "core/unit.h"
#include "moe/capacity.h"
#include "moe/moe_layer.h"
#include "tests/moe/moe_layer_test_util.h"
#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

constexpr int64_t kExperts = 4;
constexpr int64_t kHidden = 8;
constexpr int64_t kFfn = 16;

ModelOptions Model() {
  ModelOptions m;
  m.hidden_size = kHidden;
  m.num_attention_heads = 2;
  m.ffn_hidden_size = 32;
  m.num_layers = 2;
  m.seed = 7;
  return m;
}

MoeOptions Options(const std::string& router = "topk", double capacity_factor = 0.0) {
  MoeOptions o;
  o.num_experts = kExperts;
  o.topk = 2;
  o.ffn_hidden_size = kFfn;
  o.router = router;
  o.capacity_factor = capacity_factor;
  o.router_options.aux_loss_coeff = 1e-2;
  o.router_options.z_loss_coeff = 1e-3;
  return o;
}

// A forward context with the given fields and the rest at their defaults (no aggregate
// initialisation with missing fields: -Wmissing-field-initializers).
ForwardContext Ctx(bool training, int64_t iteration, int64_t first_sample,
                   double loss_scale = 0.0) {
  ForwardContext ctx;
  ctx.training = training;
  ctx.iteration = iteration;
  ctx.first_sample = first_sample;
  ctx.loss_scale = loss_scale;
  return ctx;
}

using testing::ParamOf;
using testing::TakeGrads;
using Built = testing::BuiltMoe;

Built Build(const MoeOptions& options, int64_t layer = 0) {
  return testing::BuildMoe(options, Model(), layer);
}

// A router like the layer's, computing with the layer's own router weight (the same leaf).
std::unique_ptr<Router> MirrorRouter(const MoeOptions& options, Unit& unit) {
  RouterOptions r = options.router_options;
  r.num_experts = options.num_experts;
  r.topk = options.topk;
  r.hidden_size = kHidden;
  r.seed = Model().seed;
  r.init_scope = unit.GlobalName("mlp");
  std::unique_ptr<Router> router = testing::MakeOrDie(options.router, r);
  testing::Param(*router, "router.weight") = ParamOf(unit, "mlp.router.weight");
  return router;
}

// Σ over kept assignments of gate · expert(x), expert by expert, from the unit's parameters
// (GeLU experts; tanh-approximate with `tanh_gelu`).
at::Tensor Reference(Unit& unit, const Routing& routing, const at::Tensor& keep,
                     const at::Tensor& tokens, bool tanh_gelu = false) {
  at::Tensor out = at::zeros_like(tokens);
  for (int64_t a = 0; a < routing.size(); ++a) {
    if (!keep[a].item<bool>()) continue;
    const int64_t t = routing.token[a].item<int64_t>();
    const std::string e = absl::StrCat("mlp.experts.", routing.expert[a].item<int64_t>(), ".");
    at::Tensor h = at::gelu(at::linear(tokens[t], ParamOf(unit, e + "linear_fc1.weight"),
                                       ParamOf(unit, e + "linear_fc1.bias")),
                            tanh_gelu ? "tanh" : "none");
    at::Tensor y = at::linear(h, ParamOf(unit, e + "linear_fc2.weight"),
                              ParamOf(unit, e + "linear_fc2.bias"));
    out = out.index_add(0, routing.token.narrow(0, a, 1), (routing.gate[a] * y).unsqueeze(0));
  }
  return out;
}

TEST(MoeLayerTest, MatchesTheGateWeightedSumOfExpertsWithItsGradients) {
  for (double capacity_factor : {0.0, 0.5}) {  // dropless, then with drops
    SCOPED_TRACE(absl::StrCat("capacity factor ", capacity_factor));
    MoeOptions options = Options("topk", capacity_factor);
    Built b = Build(options);
    ASSERT_NE(b.block, nullptr);
    at::Tensor x = at::randn({5, 3, kHidden}).set_requires_grad(true);  // [s, b, h]
    at::Tensor weight = at::randn({5, 3, kHidden});
    ForwardContext ctx = Ctx(/*training=*/false, 1, 0);
    at::Tensor out = b.block->Forward(x, ctx);
    ASSERT_EQ(out.sizes(), x.sizes());
    (out * weight).sum().backward();
    at::Tensor x_grad = x.grad().clone();
    x.mutable_grad() = at::Tensor();
    auto grads = TakeGrads(*b.unit);

    std::unique_ptr<Router> router = MirrorRouter(options, *b.unit);
    at::Tensor tokens = x.view({-1, kHidden});
    Routing routing =
        router->Route(tokens, options.topk, RouteContext{false, 1, 0, 0, at::Tensor()});
    const int64_t capacity =
        ExpertCapacity(capacity_factor, options.topk, tokens.size(0), routing.expert_load);
    SlotAssignment slots = AssignSlots(routing, kExperts, capacity);
    if (capacity_factor > 0) {
      EXPECT_GT(slots.dropped, 0) << "the case must drop something";
    }
    at::Tensor expected = Reference(*b.unit, routing, slots.slot >= 0, tokens);
    EXPECT_TRUE(at::allclose(out.view({-1, kHidden}), expected, 1e-5, 1e-6));
    (expected.view(x.sizes()) * weight).sum().backward();
    EXPECT_TRUE(at::allclose(x_grad, x.grad(), 1e-5, 1e-6));
    auto expected_grads = TakeGrads(*b.unit);
    ASSERT_EQ(grads.size(), expected_grads.size());
    for (const auto& [name, g] : expected_grads) {
      ASSERT_TRUE(grads.count(name)) << name;
      EXPECT_TRUE(at::allclose(grads[name], g, 1e-5, 1e-6)) << name;
    }
  }
}

// The experts take the model's activation: --openai_gelu's tanh GeLU. fc1 is scaled up so
// that its outputs reach where the exact GeLU differs from the tanh one (negative control).
TEST(MoeLayerTest, ExpertsFollowOpenAiGelu) {
  ModelOptions model = Model();
  model.openai_gelu = true;
  MoeOptions options = Options("topk", 0.0);
  auto factory = MakeMoeFactory(options, model, MoeGroups());
  ASSERT_TRUE(factory.ok()) << factory.status();
  Unit unit("layers.0");
  std::unique_ptr<FeedForward> block = (*factory)(0, unit, /*initialize=*/true);
  {
    at::NoGradGuard no_grad;
    for (int64_t e = 0; e < kExperts; ++e) {
      ParamOf(unit, absl::StrCat("mlp.experts.", e, ".linear_fc1.weight")).mul_(50.0);
    }
  }
  const at::Tensor x = at::randn({5, 3, kHidden});
  const at::Tensor out = block->Forward(x, Ctx(false, 1, 0)).view({-1, kHidden}).detach();
  std::unique_ptr<Router> router = MirrorRouter(options, unit);
  const at::Tensor tokens = x.view({-1, kHidden});
  Routing routing = router->Route(tokens, options.topk, testing::Eval());
  const at::Tensor all = at::ones({routing.size()}, at::kBool);
  at::NoGradGuard no_grad;
  const double scale = out.abs().max().item<double>();
  const double tanh_error =
      (out - Reference(unit, routing, all, tokens, /*tanh_gelu=*/true)).abs().max().item<double>();
  const double exact_error = (out - Reference(unit, routing, all, tokens)).abs().max().item<double>();
  EXPECT_LE(tanh_error, 1e-6 * scale);
  EXPECT_GT(exact_error, 100 * tanh_error) << "the exact GeLU must be told apart";
}

TEST(MoeLayerTest, PerExpertCapacityGivesThePaddedLayersOutputsAndGradients) {
  for (double capacity_factor : {0.0, 0.5, -0.75, 2.0}) {
    SCOPED_TRACE(absl::StrCat("capacity factor ", capacity_factor));
    MoeOptions padded = Options("topk", capacity_factor);
    MoeOptions ragged = padded;
    ragged.per_expert_capacity = true;
    Built a = Build(padded);
    Built b = Build(ragged);
    at::Tensor x = at::randn({6, 2, kHidden});
    at::Tensor weight = at::randn({6, 2, kHidden});
    ForwardContext ctx = Ctx(/*training=*/false, 1, 0);
    at::Tensor out_a = a.block->Forward(x, ctx);
    at::Tensor out_b = b.block->Forward(x, ctx);
    // The two layouts sum the same terms in other orders: fp32 rounding, bounded relative
    // to each tensor's largest entry (an absolute 1e-7 failed about once in 40 runs on a
    // bias gradient whose terms cancel to near zero; a dropped or misrouted token is off by
    // the order of the entries themselves).
    auto same = [](const at::Tensor& x, const at::Tensor& y) {
      const double scale = std::max(x.abs().max().item<double>(), 1e-30);
      return (x - y).abs().max().item<double>() <= 2e-6 * scale;
    };
    EXPECT_TRUE(same(out_a, out_b));
    (out_a * weight).sum().backward();
    (out_b * weight).sum().backward();
    auto grads_a = TakeGrads(*a.unit);
    auto grads_b = TakeGrads(*b.unit);
    ASSERT_EQ(grads_a.size(), grads_b.size());
    for (const auto& [name, g] : grads_a) {
      EXPECT_TRUE(same(g, grads_b[name])) << name;
    }
  }
}

TEST(MoeLayerTest, AuxiliaryLossGradientIsScaledByTheMicroBatchShare) {
  MoeOptions options = Options();
  Built b = Build(options);
  at::Tensor x = at::randn({4, 2, kHidden});
  const double loss_scale = 1.0 / 64;  // 1 / tokens of the global batch
  ForwardContext ctx = Ctx(/*training=*/true, 1, 0, loss_scale);
  // The output is multiplied by 0: all the router's gradient comes from its aux losses.
  (b.block->Forward(x, ctx) * 0.0).sum().backward();
  at::Tensor got = ParamOf(*b.unit, "mlp.router.weight").grad().clone();
  b.unit->ZeroGrad();

  std::unique_ptr<Router> router = MirrorRouter(options, *b.unit);
  Routing routing = router->Route(x.view({-1, kHidden}), options.topk,
                                  RouteContext{true, 1, 0, 0, at::Tensor()});
  ASSERT_EQ(routing.aux_losses.size(), 2u);  // load balancing and z-loss
  at::Tensor total = routing.aux_losses[0].second + routing.aux_losses[1].second;
  (total * (loss_scale * 8)).backward();  // T = 8 tokens
  EXPECT_TRUE(at::allclose(got, ParamOf(*b.unit, "mlp.router.weight").grad(), 1e-5, 1e-9));
}

TEST(MoeLayerTest, StatisticsSumTheStepsMicroBatches) {
  Built b = Build(Options("topk", 0.5));
  EXPECT_TRUE(b.block->Statistics().empty()) << "nothing before the first step";
  for (int m = 0; m < 3; ++m) {
    ForwardContext ctx = Ctx(/*training=*/true, 1, m * 2, 1.0 / 48);
    b.block->Forward(at::randn({4, 2, kHidden}), ctx).sum().backward();
  }
  b.block->Forward(at::randn({4, 2, kHidden}), Ctx(false, 1, 0));  // eval: not counted
  b.block->AfterOptimizerStep();
  std::map<std::string, std::vector<double>> stats;
  for (const BlockStatistic& s : b.block->Statistics()) stats[s.name] = s.values;
  ASSERT_EQ(stats["expert_tokens"].size(), static_cast<size_t>(kExperts));
  double routed = 0;
  for (double t : stats["expert_tokens"]) routed += t;
  EXPECT_EQ(routed, 3 * 8 * 2) << "3 micro-batches × 8 tokens × k=2";
  ASSERT_EQ(stats["dropped_tokens"].size(), 1u);
  EXPECT_GT(stats["dropped_tokens"][0], 0) << "capacity 0.5 drops";
  EXPECT_GT(stats["load_balancing_loss"][0], 0);
  EXPECT_GT(stats["z_loss"][0], 0);
  EXPECT_EQ(stats.count("importance_loss"), 0u) << "only the losses the router reports";
  // Load: the rows the experts multiplied, 3 micro-batches of E·C (C = ceil(0.5·2·8/4) = 2).
  EXPECT_EQ(b.block->Load(), 3 * kExperts * 2);
}

TEST(MoeLayerTest, TopKFollowsItsSchedule) {
  MoeOptions options = Options();
  options.topk_schedule = {{3, 1}, {5, 3}};  // k = 2 for steps 1-2, 1 for 3-4, 3 from 5
  Built b = Build(options);
  for (int64_t step = 1; step <= 6; ++step) {
    b.block->Forward(at::randn({4, 2, kHidden}), Ctx(true, step, 0, 1.0 / 8));
    b.block->AfterOptimizerStep();
    double routed = 0;
    for (const BlockStatistic& s : b.block->Statistics()) {
      if (s.name == "expert_tokens") for (double t : s.values) routed += t;
    }
    const int64_t k = step < 3 ? 2 : step < 5 ? 1 : 3;
    EXPECT_EQ(routed, 8 * k) << "step " << step;
  }
  options.topk_schedule = {{2, 5}};
  EXPECT_NE(ValidateMoeOptions(options, Model(), 1, 1).message().find("--moe_router_topk_schedule"),
            std::string::npos);
}

TEST(MoeLayerTest, ParametersAreNamedByGlobalExpertAndMarkedExpertParallel) {
  Built b = Build(Options());
  int experts = 0;
  for (const Parameter& p : b.unit->parameters()) {
    if (p.name.rfind("mlp.experts.", 0) == 0) {
      ++experts;
      EXPECT_TRUE(p.sharding.expert_parallel) << p.name;
    } else {
      EXPECT_FALSE(p.sharding.expert_parallel) << p.name;
    }
  }
  EXPECT_EQ(experts, kExperts * 4);
  EXPECT_NE(b.unit->FindParameter("mlp.experts.3.linear_fc2.weight"), nullptr);
  EXPECT_EQ(b.unit->FindParameter("mlp.experts.3.linear_fc2.weight")->value.sizes(),
            (std::vector<int64_t>{kHidden, kFfn}));
  // Expert-parallel-only state: exactly the experts' tensors.
  for (const auto& [name, tensor] : b.unit->StateTensors(nullptr, /*expert_parallel_only=*/true)) {
    EXPECT_NE(name.find("mlp.experts."), std::string::npos) << name;
  }
}

TEST(MoeLayerTest, RouterStateIsAUnitBufferThatTravelsWithTheLayer) {
  Built b = Build(Options("aux_free"));
  ASSERT_EQ(b.unit->buffers().size(), 1u);
  EXPECT_EQ(b.unit->buffers()[0].first, "mlp.router.expert_bias");
  // A fixed input: an unseeded one gave every expert exactly the mean load now and then
  // (about 2 runs in 300), and equal loads leave the bias at zero.
  at::manual_seed(3);
  b.block->Forward(at::randn({4, 2, kHidden}), Ctx(true, 1, 0, 1.0 / 8));
  b.block->AfterOptimizerStep();  // unequal loads move the bias
  const at::Tensor bias = b.unit->buffers()[0].second;
  EXPECT_GT(bias.abs().sum().item<double>(), 0);
  bool saved = false;
  for (const auto& [name, tensor] : b.unit->StateTensors()) {
    if (name == "layers.0.mlp.router.expert_bias") saved = at::equal(tensor, bias);
  }
  EXPECT_TRUE(saved) << "checkpointed under its global name";
  // A fresh layer restored from that state routes with the same bias.
  Built other = Build(Options("aux_free"));
  std::map<std::string, at::Tensor> migrated;
  for (auto& [name, tensor] : b.unit->MigrationTensors()) migrated[name] = tensor;
  ASSERT_TRUE(other.unit->LoadMigrationTensors(migrated).ok());
  EXPECT_TRUE(at::equal(other.unit->buffers()[0].second, bias));
}

TEST(MoeLayerTest, OnlyEveryFreqthLayerIsMoe) {
  MoeOptions options = Options();
  options.layer_freq = 2;
  auto factory = MakeMoeFactory(options, Model(), MoeGroups());
  ASSERT_TRUE(factory.ok());
  Unit layer0("layers.0"), layer1("layers.1");
  EXPECT_NE((*factory)(0, layer0, true), nullptr);
  EXPECT_EQ((*factory)(1, layer1, true), nullptr);
  EXPECT_TRUE(layer1.parameters().empty()) << "a dense layer's factory call registers nothing";
  // And in a transformer layer: the dense MLP is replaced, nothing else.
  FeedForwardCustomizer f(*factory);
  TransformerLayer moe_layer(Model(), 0, nullptr, true, &f);
  TransformerLayer dense_layer(Model(), 1, nullptr, true, &f);
  EXPECT_NE(moe_layer.feed_forward(), nullptr);
  EXPECT_EQ(moe_layer.FindParameter("mlp.linear_fc1.weight"), nullptr);
  EXPECT_EQ(dense_layer.feed_forward(), nullptr);
  EXPECT_NE(dense_layer.FindParameter("mlp.linear_fc1.weight"), nullptr);
  at::Tensor out = moe_layer.Forward(at::randn({3, 2, kHidden}), Ctx(false, 0, 0));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 2, kHidden}));
}

// Megatron's list form of --moe_layer_freq places MoE layers anywhere (here: the first two
// of four), and is refused naming the flag when it does not fit the model.
TEST(MoeLayerTest, ListFormLayerFreqChoosesTheLayers) {
  MoeOptions options = Options();
  ASSERT_TRUE(ParseMoeLayerFreq("[1,1,0,0]", &options).ok());
  EXPECT_EQ(options.LayerFreqText(), "[1,1,0,0]");
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_EQ(options.IsMoeLayer(layer), layer < 2) << layer;
  ModelOptions model = Model();
  model.num_layers = 4;
  EXPECT_TRUE(ValidateMoeOptions(options, model, 1, 1).ok());
  model.num_layers = 6;
  EXPECT_NE(ValidateMoeOptions(options, model, 1, 1).message().find("has 4 entries but the model has --num_layers=6"),
            std::string::npos);
  ASSERT_TRUE(ParseMoeLayerFreq("3", &options).ok());
  EXPECT_TRUE(options.layer_pattern.empty());
  EXPECT_EQ(options.LayerFreqText(), "3");
  EXPECT_TRUE(options.IsMoeLayer(3));
  EXPECT_FALSE(options.IsMoeLayer(4));
  for (const char* bad : {"[1,2]", "[]", "0", "x", "[1,0"}) {
    EXPECT_NE(ParseMoeLayerFreq(bad, &options).message().find("--moe_layer_freq"), std::string::npos) << bad;
  }
}

TEST(MoeLayerTest, BadOptionsNameTheFlag) {
  MoeOptions options = Options();
  options.num_experts = 6;
  auto status = ValidateMoeOptions(options, Model(), /*expert_parallel_size=*/4, 1);
  EXPECT_NE(status.message().find("--num_experts=6"), std::string::npos) << status;
  options = Options("nope");
  status = ValidateMoeOptions(options, Model(), 1, 1);
  EXPECT_NE(status.message().find("--moe_router='nope'"), std::string::npos) << status;
  options = Options();
  options.ffn_hidden_size = 15;
  status = ValidateMoeOptions(options, Model(), 1, /*tensor_parallel_size=*/2);
  EXPECT_NE(status.message().find("--moe_ffn_hidden_size=15"), std::string::npos) << status;
  options = Options();
  options.num_experts = 0;
  status = ValidateMoeOptions(options, Model(), 2, 1);
  EXPECT_NE(status.message().find("--expert_model_parallel_size=2"), std::string::npos) << status;
  options = Options();
  options.assignment_cache_threshold = 1.5;
  status = ValidateMoeOptions(options, Model(), 1, 1);
  EXPECT_NE(status.message().find("--moe_assignment_cache_threshold"), std::string::npos) << status;
  options.assignment_cache_threshold = 0.1;
  options.topk_schedule = {{5, 1}};
  status = ValidateMoeOptions(options, Model(), 1, 1);
  EXPECT_NE(status.message().find("--moe_router_topk_schedule"), std::string::npos) << status;
  // Known only when the layers are built: the router kind and the split's size.
  options = Options("expert_choice");
  options.assignment_cache_threshold = 0.1;
  options.assignment_cache_positions = 64;
  EXPECT_TRUE(ValidateMoeOptions(options, Model(), 1, 1).ok());
  auto factory = MakeMoeFactory(options, Model(), MoeGroups());
  ASSERT_FALSE(factory.ok());
  EXPECT_NE(factory.status().message().find("--moe_router=expert_choice"), std::string::npos)
      << factory.status();
  options.router = "topk";
  options.assignment_cache_positions = 0;
  factory = MakeMoeFactory(options, Model(), MoeGroups());
  ASSERT_FALSE(factory.ok());
  EXPECT_NE(factory.status().message().find("token count"), std::string::npos) << factory.status();
}

// ---- Cached assignments (NOTE [assignment caching]). ------------------------------------

MoeOptions CachedOptions(double threshold) {
  MoeOptions o = Options("topk", /*capacity_factor=*/0.0);  // dropless: the reference has no drops
  o.assignment_cache_threshold = threshold;
  o.assignment_cache_positions = 64;
  return o;
}

// A training step of one micro-batch on `x` [4, 2, D] whose tokens sit at corpus positions
// 10..17, in data epoch `epoch`; no parameter update. Returns the output.
at::Tensor CachedStep(Built& b, const at::Tensor& x, int64_t epoch, const at::Tensor& weight) {
  ForwardContext ctx = Ctx(/*training=*/true, /*iteration=*/1, /*first_sample=*/0, 1.0 / 8);
  ctx.epoch = epoch;
  ctx.token_positions = at::arange(10, 18, at::kLong).view({4, 2});
  at::Tensor out = b.block->Forward(x, ctx);
  (out * weight).sum().backward();
  b.block->AfterOptimizerStep();
  return out.detach();
}

std::vector<double> CacheStatistic(const Built& b) {
  for (const BlockStatistic& s : b.block->Statistics()) {
    if (s.name == "assignment_cache") return s.values;
  }
  ADD_FAILURE() << "no assignment_cache statistic";
  return {};
}

// When the cache holds what the router would choose anyway, the cached path (experts
// before the router) gives the live path's outputs and gradients bit for bit.
TEST(MoeLayerTest, CachedRoutingThatAgreesWithTheRouterChangesNothing) {
  Built b = Build(CachedOptions(/*threshold=*/0.5));
  ASSERT_EQ(b.unit->buffers().size(), 2u) << "the table and its counters";
  const at::Tensor x = at::randn({4, 2, kHidden});
  const at::Tensor weight = at::randn({4, 2, kHidden});
  const at::Tensor live = CachedStep(b, x, /*epoch=*/0, weight);
  const auto live_grads = TakeGrads(*b.unit);
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 0, 0, 0}));
  CachedStep(b, x, 1, weight);
  b.unit->ZeroGrad();
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 8, 0, 0})) << "8 tokens met again, none changed";
  const at::Tensor cached = CachedStep(b, x, 2, weight);
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 8, 8, 1}))
      << "routed by the cache, experts before the router";
  EXPECT_TRUE(cached.equal(live));
  const auto cached_grads = TakeGrads(*b.unit);
  ASSERT_EQ(cached_grads.size(), live_grads.size());
  for (const auto& [name, g] : live_grads) EXPECT_TRUE(cached_grads.at(name).equal(g)) << name;
}

// When the router has moved on, the cached epoch still sends each token to its cached
// experts, with the router's gates for them: the reference routes with fixed experts.
TEST(MoeLayerTest, CachedRoutingOverridesTheRouterWithItsGates) {
  MoeOptions options = CachedOptions(/*threshold=*/0.5);
  Built b = Build(options);
  const at::Tensor x = at::randn({4, 2, kHidden}).set_requires_grad(true);
  const at::Tensor weight = at::randn({4, 2, kHidden});
  CachedStep(b, x, 0, weight);
  CachedStep(b, x, 1, weight);
  std::unique_ptr<Router> router = MirrorRouter(options, *b.unit);
  const at::Tensor tokens = x.detach().view({-1, kHidden});
  RouteContext route_ctx{true, 1, 0, 0, at::Tensor()};
  const at::Tensor remembered = router->Route(tokens, 2, route_ctx).choice;
  {
    at::NoGradGuard no_grad;
    ParamOf(*b.unit, "mlp.router.weight").neg_();  // now it prefers its least liked experts
  }
  b.unit->ZeroGrad();
  x.mutable_grad() = at::Tensor();
  const at::Tensor out = CachedStep(b, x, 2, weight);
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{8, 8, 8, 1})) << "all changed, all cached";
  const at::Tensor x_grad = x.grad().clone();
  x.mutable_grad() = at::Tensor();
  auto grads = TakeGrads(*b.unit);

  route_ctx.fixed_experts = remembered;
  Routing routing = router->Route(x.view({-1, kHidden}), 2, route_ctx);
  EXPECT_TRUE(routing.expert.equal(remembered.t().reshape({-1})));
  at::Tensor expected = Reference(*b.unit, routing, at::ones({16}, at::kBool), x.view({-1, kHidden}));
  EXPECT_TRUE(at::allclose(out.view({-1, kHidden}), expected.detach(), 1e-5, 1e-6));
  at::Tensor aux = routing.aux_losses[0].second + routing.aux_losses[1].second;
  ((expected.view(x.sizes()) * weight).sum() + aux * (8.0 / 8)).backward();
  EXPECT_TRUE(at::allclose(x_grad, x.grad(), 1e-5, 1e-6));
  auto expected_grads = TakeGrads(*b.unit);
  for (const auto& [name, g] : expected_grads) {
    EXPECT_TRUE(at::allclose(grads.at(name), g, 1e-5, 1e-6)) << name;
  }
  // Epoch 2 changed every token: epoch 3 routes live again, by the router's new choice.
  CachedStep(b, x.detach(), 3, weight);
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 8, 0, 0}));
}

// Batch-prioritized slots need the gates: the cached experts are used, the router runs
// first. Same outputs as without prioritizing when nothing drops.
TEST(MoeLayerTest, CachedRoutingWithBatchPrioritizedSlots) {
  MoeOptions options = CachedOptions(0.5);
  options.batch_prioritized = true;
  Built b = Build(options);
  Built plain = Build(CachedOptions(0.5));
  const at::Tensor x = at::randn({4, 2, kHidden});
  const at::Tensor weight = at::randn({4, 2, kHidden});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const at::Tensor out = CachedStep(b, x, epoch, weight);
    EXPECT_TRUE(at::allclose(out, CachedStep(plain, x, epoch, weight), 1e-6, 1e-7)) << epoch;
  }
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 8, 8, 0})) << "cached, router first";
}

// Evaluation neither needs positions nor touches the cache, even in a new epoch.
TEST(MoeLayerTest, EvaluationLeavesTheCacheAlone) {
  Built b = Build(CachedOptions(0.5));
  std::vector<at::Tensor> before;
  for (const auto& [name, tensor] : b.unit->buffers()) before.push_back(tensor.clone());
  ForwardContext eval = Ctx(/*training=*/false, 1, 0);
  eval.epoch = 5;
  b.block->Forward(at::randn({4, 2, kHidden}), eval);
  b.block->AfterOptimizerStep();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(b.unit->buffers()[i].second.equal(before[i])) << b.unit->buffers()[i].first;
  }
  EXPECT_EQ(CacheStatistic(b), (std::vector<double>{0, 0, 0, 0}));
  // Training without positions is refused, naming what is missing.
  EXPECT_THROW(b.block->Forward(at::randn({4, 2, kHidden}), Ctx(true, 1, 0, 1.0 / 8)),
               c10::Error);
}

}  // namespace
}  // namespace fulcrum::moe

namespace fulcrum::moe {
namespace {

// Evaluation (a no-grad guard) and a frozen layer (no parameter and no input needs a
// gradient) run the layer with no autograd graph; both give exactly the training-mode output
// of the same weights and tokens, and neither builds a graph.
TEST(MoeLayerTest, ForwardWithoutGradientsGivesTheSameOutput) {
  for (double capacity_factor : {0.0, 0.5}) {
    SCOPED_TRACE(absl::StrCat("capacity factor ", capacity_factor));
    Built b = Build(Options("topk", capacity_factor));
    const at::Tensor x = at::randn({5, 3, kHidden});
    const ForwardContext ctx = Ctx(/*training=*/false, 1, 0);
    const at::Tensor with_grad = b.block->Forward(x, ctx);
    ASSERT_TRUE(with_grad.requires_grad()) << "the reference must have built a graph";
    {
      at::NoGradGuard no_grad;
      const at::Tensor evaluated = b.block->Forward(x, ctx);
      EXPECT_FALSE(evaluated.requires_grad());
      EXPECT_TRUE(evaluated.equal(with_grad.detach()));
    }
    for (Parameter& p : b.unit->parameters()) p.value.requires_grad_(false);
    const at::Tensor frozen = b.block->Forward(x, ctx);
    EXPECT_FALSE(frozen.requires_grad());
    EXPECT_TRUE(frozen.equal(with_grad.detach()));
  }
}

}  // namespace
}  // namespace fulcrum::moe

namespace fulcrum::moe {
namespace {

// The zero-bubble W pass (NOTE [B/W split]): with a WeightGradStore active during the
// backward, the experts' weight gradients wait in the store under the layer's tag (one
// closure per projection: NOTE [grouped expert linear]) and, once flushed, equal the
// gradients of the same backward without a store bit for bit — GeLU and SwiGLU experts,
// padded and per-expert capacity, two micro-batches accumulating.
TEST(MoeLayerTest, DeferredExpertWeightGradientsEqualTheFusedOnes) {
  for (bool swiglu : {false, true}) {
    for (bool ragged : {false, true}) {
      SCOPED_TRACE(absl::StrCat(swiglu ? "swiglu" : "gelu", ragged ? ", per-expert capacity" : ""));
      ModelOptions model = Model();
      model.swiglu = swiglu;
      MoeOptions options = Options("topk", 1.0);
      options.per_expert_capacity = ragged;
      testing::BuiltMoe b = testing::BuildMoe(options, model);
      at::manual_seed(3);
      const std::vector<at::Tensor> xs = {at::randn({5, 3, kHidden}), at::randn({5, 3, kHidden})};
      const std::vector<at::Tensor> ws = {at::randn({5, 3, kHidden}), at::randn({5, 3, kHidden})};
      ForwardContext ctx;
      ctx.training = false;
      ctx.iteration = 1;
      auto backward = [&](size_t mb) { (b.block->Forward(xs[mb], ctx) * ws[mb]).sum().backward(); };
      for (size_t mb = 0; mb < xs.size(); ++mb) backward(mb);
      const auto fused = TakeGrads(*b.unit);

      WeightGradStore store;
      {
        WeightGradStore::Scope scope(&store);
        WeightGradStore::TagScope tag(0);
        for (size_t mb = 0; mb < xs.size(); ++mb) backward(mb);
      }
      EXPECT_EQ(store.size(), 2 * xs.size()) << "fc1 and fc2, per micro-batch";
      EXPECT_FALSE(ParamOf(*b.unit, "mlp.experts.0.linear_fc1.weight").grad().defined());
      store.FlushTag(0);
      EXPECT_TRUE(store.empty());
      const auto deferred = TakeGrads(*b.unit);
      ASSERT_EQ(fused.size(), deferred.size());
      for (const auto& [name, g] : fused) {
        ASSERT_TRUE(deferred.count(name)) << name;
        EXPECT_TRUE(g.equal(deferred.at(name))) << name;
      }
    }
  }
}

}  // namespace
}  // namespace fulcrum::moe
