// The router registry, option checks, the properties every router shares, and the softmax
// top-k and Switch routers on the hand example of moe_test_util.h.
#include "moe/router.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::AuxLoss;
using testing::Doubles;
using testing::Eval;
using testing::ExpectNear;
using testing::HandHidden;
using testing::HasAuxLoss;
using testing::Longs;
using testing::MakeOrDie;
using testing::Param;
using testing::SetParam;
using testing::TinyOptions;
using testing::Training;

const std::vector<std::string> kAllRouters = {"aux_free", "cosine",   "expert_choice", "mixtral",
                                              "noisy_topk", "sinkhorn", "switch",        "topk"};

// ---- Registry and option checks. ---------------------------------------------------------

TEST(MakeRouterTest, UnknownNameListsTheKnownRouters) {
  absl::StatusOr<std::unique_ptr<Router>> router = MakeRouter("nope", TinyOptions(4, 8, 2));
  ASSERT_FALSE(router.ok());
  EXPECT_EQ(router.status().code(), absl::StatusCode::kNotFound);
  const std::string message(router.status().message());
  EXPECT_NE(message.find("--moe_router='nope'"), std::string::npos) << message;
  EXPECT_NE(message.find("aux_free, cosine, expert_choice, mixtral, noisy_topk, sinkhorn, switch, topk"),
            std::string::npos)
      << message;
}

TEST(MakeRouterTest, HelpHasOneLinePerRouter) {
  EXPECT_EQ(RouterNames(), "aux_free, cosine, expert_choice, mixtral, noisy_topk, sinkhorn, switch, topk");
  const std::string help = RouterHelp();
  for (const std::string& name : kAllRouters) {
    EXPECT_NE(help.find("  " + name + "  "), std::string::npos) << help;
  }
  EXPECT_EQ(std::count(help.begin(), help.end(), '\n'), 8);
}

// Each bad option is refused with a message that names its flag.
TEST(MakeRouterTest, BadOptionsNameTheirFlag) {
  struct Case {
    std::string flag;
    std::function<void(RouterOptions&)> spoil;
  };
  const std::vector<Case> cases = {
      {"--moe_router_topk", [](RouterOptions& o) { o.topk = 5; }},  // k > E = 4
      {"--moe_router_topk", [](RouterOptions& o) { o.topk = 0; }},
      {"--num_experts", [](RouterOptions& o) { o.num_experts = 0; }},
      {"--hidden_size", [](RouterOptions& o) { o.hidden_size = 0; }},
      {"--moe_aux_loss_coeff", [](RouterOptions& o) { o.aux_loss_coeff = -0.1; }},
      {"--moe_aux_loss_coeff", [](RouterOptions& o) { o.aux_loss_coeff = INFINITY; }},
      {"--moe_z_loss_coeff", [](RouterOptions& o) { o.z_loss_coeff = NAN; }},
      {"--moe_input_jitter_eps", [](RouterOptions& o) { o.input_jitter_eps = 1.0; }},
      {"--moe_router_init_std", [](RouterOptions& o) { o.init_std = 0.0; }},
      {"--moe_noise_epsilon", [](RouterOptions& o) { o.noise_epsilon = -1.0; }},
      {"--moe_router_bias_update_rate", [](RouterOptions& o) { o.bias_update_rate = -1e-3; }},
      {"--moe_sinkhorn_iterations", [](RouterOptions& o) { o.sinkhorn_iterations = 0; }},
      {"--moe_expert_choice_capacity_factor",
       [](RouterOptions& o) { o.expert_choice_capacity_factor = 0.0; }},
      {"--moe_cosine_projection_dim", [](RouterOptions& o) { o.cosine_projection_dim = 0; }},
      {"--moe_cosine_init_temperature", [](RouterOptions& o) { o.init_temperature = 0.001; }},
      {"--moe_cosine_min_temperature", [](RouterOptions& o) { o.cosine_min_temperature = 0; }},
  };
  for (const Case& c : cases) {
    RouterOptions options = TinyOptions(4, 8, 2);
    c.spoil(options);
    absl::StatusOr<std::unique_ptr<Router>> router = MakeRouter("topk", options);
    ASSERT_FALSE(router.ok()) << c.flag;
    EXPECT_EQ(router.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(router.status().message().find(c.flag), std::string::npos) << router.status();
  }
}

TEST(MakeRouterTest, SwitchNeedsTopOne) {
  absl::StatusOr<std::unique_ptr<Router>> router = MakeRouter("switch", TinyOptions(4, 8, 2));
  ASSERT_FALSE(router.ok());
  EXPECT_NE(router.status().message().find("--moe_router_topk must be 1"), std::string::npos)
      << router.status();
  auto top1 = MakeOrDie("switch", TinyOptions(4, 8, 1));
  EXPECT_THROW(top1->Route(at::randn({3, 8}), 2, Eval()), c10::Error);
}

TEST(MakeRouterTest, RouteChecksItsArguments) {
  auto router = MakeOrDie("topk", TinyOptions(4, 8, 2));
  EXPECT_THROW(router->Route(at::randn({3, 7}), 2, Eval()), c10::Error);  // wrong D
  EXPECT_THROW(router->Route(at::randn({0, 8}), 2, Eval()), c10::Error);  // no tokens
  EXPECT_THROW(router->Route(at::randn({3, 8}), 5, Eval()), c10::Error);  // k > E
  EXPECT_THROW(router->Route(at::randn({3, 8}), 0, Eval()), c10::Error);
}

// ---- Properties every router has. --------------------------------------------------------

class EveryRouterTest : public ::testing::TestWithParam<std::string> {
 protected:
  // 4 experts, hidden 6; top-2 except for switch.
  RouterOptions Options() const {
    RouterOptions options = TinyOptions(4, 6, GetParam() == "switch" ? 1 : 2);
    options.z_loss_coeff = 1e-3;
    return options;
  }
  int64_t K() const { return Options().topk; }
};

TEST_P(EveryRouterTest, RoutingIsAConsistentFlatList) {
  auto router = MakeOrDie(GetParam(), Options());
  EXPECT_EQ(router->name(), GetParam());
  at::Tensor hidden = at::randn({10, 6}, at::TensorOptions().dtype(at::kFloat));
  for (const RouteContext& ctx : {Eval(), Training(3)}) {
    Routing r = router->Route(hidden, K(), ctx);
    const int64_t n = r.size();
    EXPECT_EQ(n, GetParam() == "expert_choice" ? 4 * 5 : 10 * K());  // expert choice: C=10·2/4
    EXPECT_EQ(r.expert.sizes(), at::IntArrayRef({n}));
    EXPECT_EQ(r.gate.sizes(), at::IntArrayRef({n}));
    EXPECT_EQ(r.token.scalar_type(), at::kLong);
    EXPECT_EQ(r.expert.scalar_type(), at::kLong);
    EXPECT_EQ(r.gate.scalar_type(), at::kFloat);
    EXPECT_EQ(r.probs.sizes(), at::IntArrayRef({10, 4}));
    EXPECT_TRUE(at::allclose(r.probs.sum(1), at::ones({10})));
    EXPECT_TRUE(r.expert_load.equal(at::bincount(r.expert, {}, 4)));
    EXPECT_TRUE(HasAuxLoss(r, "z_loss"));
    // No token gets the same expert twice.
    EXPECT_EQ(std::get<0>(at::_unique(r.token * 4 + r.expert)).numel(), n);
  }
}

// The gates and aux losses reach every trainable parameter.
TEST_P(EveryRouterTest, EveryParameterGetsAGradient) {
  auto router = MakeOrDie(GetParam(), Options());
  at::Tensor hidden = at::randn({10, 6});
  Routing r = router->Route(hidden, K(), Training(1));
  at::Tensor loss = (r.gate * at::linspace(1.0, 2.0, r.size())).sum();
  for (const auto& [name, value] : r.aux_losses) loss = loss + value;
  loss.backward();
  for (RouterParameter& p : router->Parameters()) {
    ASSERT_TRUE(p.value->grad().defined()) << p.name;
    EXPECT_GT(p.value->grad().abs().sum().item<double>(), 0.0) << p.name;
  }
}

// NOTE [layout-independent randomness]: initial values are a function of (seed, key).
TEST_P(EveryRouterTest, InitialisationIsKeyedBySeedAndScope) {
  RouterOptions options = Options();
  auto a = MakeOrDie(GetParam(), options);
  auto b = MakeOrDie(GetParam(), options);
  options.init_scope = "layers.7.mlp";
  auto c = MakeOrDie(GetParam(), options);
  for (RouterParameter& p : a->Parameters()) {
    EXPECT_TRUE(p.value->is_leaf() && p.value->requires_grad()) << p.name;
    EXPECT_EQ(p.value->scalar_type(), at::kFloat);
    EXPECT_TRUE(p.value->equal(Param(*b, p.name))) << p.name;
    // noisy_topk starts at zero (Shazeer et al. 2017, App. A); the temperature is a constant.
    const bool constant_init = GetParam() == "noisy_topk" || p.name == "router.log_inv_temperature";
    EXPECT_EQ(p.value->equal(Param(*c, p.name)), constant_init) << p.name;
  }
}

// NOTE [router precision]: bf16 hidden states are routed in fp32.
TEST_P(EveryRouterTest, LowPrecisionInputIsRoutedInFloat) {
  auto router = MakeOrDie(GetParam(), Options());
  at::Tensor hidden = at::randn({8, 6});
  Routing r = router->Route(hidden.to(at::kBFloat16), K(), Eval());
  EXPECT_EQ(r.gate.scalar_type(), at::kFloat);
  EXPECT_EQ(r.probs.scalar_type(), at::kFloat);
}

TEST_P(EveryRouterTest, LoadStateRoundTripsAndRejectsStrangers) {
  auto router = MakeOrDie(GetParam(), Options());
  NamedTensors state = router->State();
  for (auto& [name, tensor] : state) tensor = tensor.clone().fill_(0.25);
  EXPECT_TRUE(router->LoadState(state).ok());
  for (const auto& [name, tensor] : router->State()) {
    EXPECT_TRUE(tensor.eq(0.25).all().item<bool>()) << name;
  }
  NamedTensors stranger = state;
  stranger.emplace_back("router.unknown", at::zeros({1}));
  absl::Status status = router->LoadState(stranger);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("router.unknown"), std::string::npos) << status;
}

// Cached assignments (RouteContext::fixed_experts): fixing each token to the router's own
// choice changes nothing; rows of −1 keep the own choice; Routing::choice is always the
// router's own preference.
TEST_P(EveryRouterTest, FixedExpertsEqualToTheOwnChoiceChangeNothing) {
  auto router = MakeOrDie(GetParam(), Options());
  at::Tensor hidden = at::randn({10, 6});
  RouteContext ctx = Training(2, /*first_sample=*/4);
  if (!router->token_choice()) {
    EXPECT_EQ(GetParam(), "expert_choice");
    ctx.fixed_experts = at::zeros({10, K()}, at::kLong);
    EXPECT_THROW(router->Route(hidden, K(), ctx), c10::Error);
    return;
  }
  Routing own = router->Route(hidden, K(), ctx);
  ASSERT_TRUE(own.choice.defined());
  EXPECT_EQ(own.choice.sizes(), at::IntArrayRef({10, K()}));
  EXPECT_TRUE(own.expert.equal(own.choice.t().reshape({-1})));
  at::Tensor fixed = own.choice.clone();
  fixed.narrow(0, 3, 4).fill_(-1);  // tokens 3..6 route themselves
  ctx.fixed_experts = fixed;
  Routing r = router->Route(hidden, K(), ctx);
  EXPECT_TRUE(r.expert.equal(own.expert));
  EXPECT_TRUE(r.gate.equal(own.gate));
  EXPECT_TRUE(r.choice.equal(own.choice));
  ASSERT_EQ(r.aux_losses.size(), own.aux_losses.size());
  for (size_t i = 0; i < r.aux_losses.size(); ++i) {
    EXPECT_TRUE(r.aux_losses[i].second.equal(own.aux_losses[i].second)) << r.aux_losses[i].first;
  }
}

// A token fixed to other experts goes to them; its choice still reports the preference.
TEST_P(EveryRouterTest, FixedExpertsOverrideTheChoice) {
  auto router = MakeOrDie(GetParam(), Options());
  if (!router->token_choice()) return;
  at::Tensor hidden = at::randn({10, 6});
  Routing own = router->Route(hidden, K(), Training(1));
  // Every token to the experts it likes least, in increasing preference.
  RouteContext ctx = Training(1);
  ctx.fixed_experts = std::get<1>(at::topk(own.probs, K(), 1, /*largest=*/false));
  Routing r = router->Route(hidden, K(), ctx);
  EXPECT_TRUE(r.expert.equal(ctx.fixed_experts.t().reshape({-1})));
  EXPECT_TRUE(r.choice.equal(own.choice));
  EXPECT_TRUE(r.expert_load.equal(at::bincount(r.expert, {}, 4)));
  EXPECT_FALSE(r.gate.equal(own.gate));
  // Out-of-range experts and a wrong shape are refused.
  ctx.fixed_experts = at::full({10, K()}, 4, at::kLong);
  EXPECT_THROW(router->Route(hidden, K(), ctx), c10::Error);
  ctx.fixed_experts = at::zeros({9, K()}, at::kLong);
  EXPECT_THROW(router->Route(hidden, K(), ctx), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(AllRouters, EveryRouterTest, ::testing::ValuesIn(kAllRouters),
                         [](const auto& info) { return info.param; });

// ---- Softmax top-k and Switch on the hand example. ---------------------------------------

std::unique_ptr<Router> HandRouter(const std::string& name, int64_t k) {
  RouterOptions options = TinyOptions(3, 3, k);
  options.aux_loss_coeff = 0.01;
  options.z_loss_coeff = 0.1;
  auto router = MakeOrDie(name, options);
  SetParam(*router, "router.weight", at::eye(3));  // logits = hidden
  return router;
}

TEST(TopKRouterTest, HandExample) {
  auto router = HandRouter("topk", 2);
  Routing r = router->Route(HandHidden(), 2, Eval());
  // Top 2 of each p_t, best first; gates renormalised over the two:
  //   t0: e0 .5, e1 .3  -> 5/8, 3/8        t1: e1 .6, e2 .3  -> 2/3, 1/3
  //   t2: e2 .65, e0 .25 -> 13/18, 5/18    t3: e0 .7, e1 .2  -> 7/9, 2/9
  // GShard order: all first choices (t0..t3), then all second choices.
  EXPECT_EQ(Longs(r.token), (std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  ExpectNear(Doubles(r.gate),
             {5.0 / 8, 2.0 / 3, 13.0 / 18, 7.0 / 9, 3.0 / 8, 1.0 / 3, 5.0 / 18, 2.0 / 9}, 1e-6);
  ExpectNear(Doubles(r.probs), Doubles(testing::HandProbs()), 1e-6);
  EXPECT_EQ(Longs(r.expert_load), (std::vector<int64_t>{3, 3, 2}));
  // Load balancing: f = load/(T·k) = (3, 3, 2)/8; P = column means of p =
  // (1.55, 1.2, 1.25)/4 = (.3875, .3, .3125); E·Σ f·P = 3·(3·.3875 + 3·.3 + 2·.3125)/8
  // = 3·2.6875/8 = 1.0078125; times 0.01.
  EXPECT_NEAR(AuxLoss(r, "load_balancing_loss"), 0.01 * 1.0078125, 1e-8);
  // z-loss: logsumexp(logits_t) = c_t = (1, 2, 0, -1); mean c² = 6/4 = 1.5; times 0.1.
  EXPECT_NEAR(AuxLoss(r, "z_loss"), 0.1 * 1.5, 1e-6);
}

// Fixed experts get the router's gate rule: the top-k softmax renormalised over them, and
// the balancing loss counts them.
TEST(TopKRouterTest, FixedExpertsHandExample) {
  auto router = HandRouter("topk", 2);
  RouteContext ctx = Eval();
  // t0 fixed to (e2, e1), t1 to (e0, e2); t2, t3 route themselves.
  ctx.fixed_experts = at::tensor({2, 1, 0, 2, -1, -1, -1, -1}, at::kLong).reshape({4, 2});
  Routing r = router->Route(HandHidden(), 2, ctx);
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{2, 0, 2, 0, 1, 2, 0, 1}));
  //   t0: e2 .2, e1 .3 -> 2/5, 3/5        t1: e0 .1, e2 .3 -> 1/4, 3/4
  ExpectNear(Doubles(r.gate),
             {2.0 / 5, 1.0 / 4, 13.0 / 18, 7.0 / 9, 3.0 / 5, 3.0 / 4, 5.0 / 18, 2.0 / 9}, 1e-6);
  EXPECT_EQ(Longs(r.choice), (std::vector<int64_t>{0, 1, 1, 2, 2, 0, 0, 1}));
  EXPECT_EQ(Longs(r.expert_load), (std::vector<int64_t>{3, 2, 3}));
  // f = (3, 2, 3)/8, P = (.3875, .3, .3125): 3·(3·.3875 + 2·.3 + 3·.3125)/8 = 1.0125.
  EXPECT_NEAR(AuxLoss(r, "load_balancing_loss"), 0.01 * 1.0125, 1e-8);
}

TEST(TopKRouterTest, ZeroCoefficientsEmitNoLosses) {
  RouterOptions options = TinyOptions(3, 3, 2);
  options.aux_loss_coeff = 0.0;
  options.z_loss_coeff = 0.0;
  auto router = MakeOrDie("topk", options);
  EXPECT_TRUE(router->Route(HandHidden(), 2, Eval()).aux_losses.empty());
}

// Top-any: k is per call.
TEST(TopKRouterTest, KMayChangeFromCallToCall) {
  auto router = HandRouter("topk", 2);
  Routing r1 = router->Route(HandHidden(), 1, Eval());
  Routing r3 = router->Route(HandHidden(), 3, Eval());
  EXPECT_EQ(r1.size(), 4);
  EXPECT_EQ(r3.size(), 12);
  EXPECT_EQ(Longs(r1.expert), (std::vector<int64_t>{0, 1, 2, 0}));
  // k = E: every expert, gates = p itself (renormalised over all = unchanged).
  EXPECT_TRUE(at::allclose(r3.gate.reshape({3, 4}).t(),
                           std::get<0>(r3.probs.sort(1, /*descending=*/true)), 1e-6));
}

TEST(SwitchRouterTest, HandExample) {
  auto router = HandRouter("switch", 1);
  Routing r = router->Route(HandHidden(), 1, Eval());
  // Top 1: t0 -> e0 (.5), t1 -> e1 (.6), t2 -> e2 (.65), t3 -> e0 (.7); the gate is the
  // probability itself (Switch §2.1).
  EXPECT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 2, 0}));
  ExpectNear(Doubles(r.gate), {0.5, 0.6, 0.65, 0.7}, 1e-6);
  EXPECT_EQ(Longs(r.expert_load), (std::vector<int64_t>{2, 1, 1}));
  // f = (2, 1, 1)/4, P = (.3875, .3, .3125): α·E·Σ f·P = .01·3·(.19375 + .075 + .078125)
  // = .01·3·.346875 = .01·1.040625.
  EXPECT_NEAR(AuxLoss(r, "load_balancing_loss"), 0.01 * 1.040625, 1e-8);
}

// The gate p_i(x) carries the task gradient to the router (Switch §2.1): d gate_t / d W
// for gate = softmax(W x)_e is p_e (δ_ej − p_j) x_i. Checked for token 0, expert 0.
TEST(SwitchRouterTest, GateGradientIsTheSoftmaxJacobian) {
  auto router = HandRouter("switch", 1);
  at::Tensor hidden = HandHidden();
  Routing r = router->Route(hidden, 1, Eval());
  r.gate[0].backward();
  at::Tensor p = testing::HandProbs()[0];  // token 0 chose expert 0
  at::Tensor d_logits = -p[0] * p;
  d_logits[0] += p[0];
  at::Tensor expected = at::outer(d_logits, hidden[0].to(at::kDouble));
  EXPECT_TRUE(
      at::allclose(Param(*router, "router.weight").grad().to(at::kDouble), expected, 1e-5, 1e-6));
}

// Switch-style router jitter: off in eval, keyed by the context in training.
TEST(TopKRouterTest, InputJitterIsKeyedAndTrainingOnly) {
  RouterOptions options = TinyOptions(3, 3, 2);
  options.input_jitter_eps = 0.1;
  auto router = MakeOrDie("topk", options);
  SetParam(*router, "router.weight", at::eye(3));
  at::Tensor hidden = HandHidden();
  EXPECT_TRUE(router->Route(hidden, 2, Eval()).probs.allclose(testing::HandProbs().to(at::kFloat)));
  at::Tensor a = router->Route(hidden, 2, Training(5, 64, 2)).probs;
  EXPECT_TRUE(a.equal(router->Route(hidden, 2, Training(5, 64, 2)).probs));
  EXPECT_FALSE(a.equal(router->Route(hidden, 2, Training(6, 64, 2)).probs));
  EXPECT_FALSE(a.equal(router->Route(hidden, 2, Training(5, 65, 2)).probs));
  EXPECT_FALSE(a.equal(router->Route(hidden, 2, Training(5, 64, 3)).probs));
  // Multiplicative noise within 1 ± 0.1 of logits below 2.7 in magnitude moves no
  // probability by more than about 0.2.
  EXPECT_TRUE(a.allclose(testing::HandProbs().to(at::kFloat), 0.0, 0.2));
}

}  // namespace
}  // namespace fulcrum::moe
