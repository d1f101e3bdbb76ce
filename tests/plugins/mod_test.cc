// The mod plugin (plugins/mod.cc) against dense references: a routed layer computes its
// chosen tokens exactly as a plain layer computes those tokens alone (scaled by the gate),
// leaves every other token bit-unchanged, chooses the top-k of each sequence by its router
// (recomputed here), decides causally outside training, trains its causal decision through
// the auxiliary loss, and has finite-difference gradients.
#include <gflags/gflags.h>
#include <torch/torch.h>

#include <memory>

#include "core/gpt_model.h"
#include "core/plugin.h"
#include "core/transformer_layer.h"
#include "gtest/gtest.h"
#include "plugins/plugin_registry.h"
#include "tests/core/test_util.h"

DECLARE_int64(mod_layer_freq);
DECLARE_double(mod_capacity);
DECLARE_string(mod_causal);
DECLARE_double(mod_aux_loss_coeff);
DECLARE_string(mod_layers);

namespace fulcrum::plugins {
namespace {

// testing::SmallModel: 2 layers, hidden 32, 4 heads, seq 16.
ModelOptions Small(bool fp64 = false) {
  ModelOptions m = testing::SmallModel();
  if (fp64) m.device_spec.master_dtype = m.device_spec.compute_dtype = at::kDouble;
  return m;
}

const StageSpec kLayersOnly{0, -1, /*has_embedding=*/false, /*has_head=*/false};

// The mod flags for one test; the previous values come back at the end of the scope.
struct ModFlags {
  explicit ModFlags(double capacity, const std::string& causal = "predictor", double coeff = 0.01) {
    FLAGS_mod_layer_freq = 2;  // layer 1 of 2 is routed
    FLAGS_mod_layers = "";
    FLAGS_mod_capacity = capacity;
    FLAGS_mod_causal = causal;
    FLAGS_mod_aux_loss_coeff = coeff;
  }
  gflags::FlagSaver saver;  // constructed before the body changes anything
};

std::unique_ptr<GptModel> WithMod(const ModelOptions& options) {
  PluginSetup setup;
  setup.model = options;
  auto plugins = MakePlugins({"mod"}, setup);
  EXPECT_TRUE(plugins.ok()) << plugins.status();
  return std::make_unique<GptModel>(options, kLayersOnly, nullptr, *plugins);
}

// The routed layer's router weight.
at::Tensor Router(const GptModel& model) {
  for (const Parameter& p : model.layers().at(1)->parameters()) {
    if (p.name == "mod.router.weight") return p.value;
  }
  ADD_FAILURE() << "no router";
  return at::Tensor();
}

ForwardContext Training() { return ForwardContext{true, 1, 0, 0.0, {}, 0}; }
ForwardContext Evaluation() { return ForwardContext{false, 1, 0, 0.0, {}, 0}; }

double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / (want.abs().max().item<double>() + 1e-30);
}

// Checks layer 1 of `mod` on input x [s, b, h] against the plain layer 1 of `plain`, where
// `chosen` [s, b] bool says which tokens the routed layer must have computed.
void ExpectRoutedLayerMatches(const GptModel& mod, const GptModel& plain, const at::Tensor& x,
                              const at::Tensor& chosen, const ForwardContext& ctx, double tol) {
  at::NoGradGuard no_grad;
  const at::Tensor out = mod.layers().at(1)->Forward(x, ctx);
  const at::Tensor gate = at::sigmoid(at::matmul(x, Router(mod)));
  for (int64_t j = 0; j < x.size(1); ++j) {
    const at::Tensor index = chosen.select(1, j).nonzero().squeeze(-1);
    const at::Tensor others = chosen.select(1, j).logical_not().nonzero().squeeze(-1);
    // Untouched tokens pass through bit for bit.
    EXPECT_TRUE(at::equal(out.select(1, j).index_select(0, others),
                          x.select(1, j).index_select(0, others)))
        << "sequence " << j;
    if (index.size(0) == 0) continue;
    // Chosen tokens: the plain layer run on those tokens alone, its addition gated; with
    // rotary positions, at their places in the sequence.
    const at::Tensor xs = x.select(1, j).index_select(0, index).unsqueeze(1);
    ForwardContext at_positions = ctx;
    at_positions.rotary_positions = index.unsqueeze(1);
    const at::Tensor dense = plain.layers().at(1)->Forward(xs, at_positions).squeeze(1);
    const at::Tensor g = gate.select(1, j).index_select(0, index).unsqueeze(-1);
    const at::Tensor want = xs.squeeze(1) + g * (dense - xs.squeeze(1));
    EXPECT_LE(RelativeError(out.select(1, j).index_select(0, index), want), tol) << "sequence " << j;
  }
}

TEST(ModPluginTest, FullCapacityIsTheDenseLayerScaledByTheGate) {
  ModFlags flags(1.0);
  const ModelOptions o = Small();
  auto mod = WithMod(o);
  GptModel plain(o, kLayersOnly);
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({o.seq_length, 3, o.hidden_size});
  ExpectRoutedLayerMatches(*mod, plain, x, at::ones({o.seq_length, 3}, at::kBool), Training(), 1e-5);
  // Layer 0 is not routed: it is the plain layer, bit for bit.
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(mod->layers().at(0)->Forward(x, Training()),
                        plain.layers().at(0)->Forward(x, Training())));
  EXPECT_DOUBLE_EQ(mod->layers().at(1)->Load(), 1.0);
}

TEST(ModPluginTest, TrainingComputesTheRouterTopKOfEachSequenceAndSkipsTheRest) {
  for (const bool rope : {false, true}) {
  SCOPED_TRACE(rope ? "rotary positions" : "learned positions");
  ModFlags flags(0.25);
  ModelOptions o = Small();
  if (rope) o.position_embedding = PositionEmbedding::kRotary;
  auto mod = WithMod(o);
  GptModel plain(o, kLayersOnly);
  torch::manual_seed(2);
  const at::Tensor x = torch::randn({o.seq_length, 3, o.hidden_size});
  // The top 4 of 16 by router logit, per sequence, computed here independently.
  const at::Tensor logits = at::matmul(x, Router(*mod));
  const at::Tensor top = std::get<1>(logits.topk(4, 0));
  const at::Tensor chosen = at::zeros({o.seq_length, 3}, at::kBool).scatter(0, top, true);
  ExpectRoutedLayerMatches(*mod, plain, x, chosen, Training(), 1e-5);
  EXPECT_DOUBLE_EQ(mod->layers().at(1)->Load(), 0.25) << "the layer computed 4 of 16 tokens";
  if (rope) {
    // The negative control: the routed tokens rotated to 0..3 instead of their positions.
    at::NoGradGuard no_grad;
    const at::Tensor out = mod->layers().at(1)->Forward(x, Training());
    const at::Tensor index = chosen.select(1, 0).nonzero().squeeze(-1);
    const at::Tensor xs = x.select(1, 0).index_select(0, index).unsqueeze(1);
    const at::Tensor gate = at::sigmoid(at::matmul(xs.squeeze(1), Router(*mod))).unsqueeze(-1);
    const at::Tensor wrong =
        xs.squeeze(1) + gate * (plain.layers().at(1)->Forward(xs, Training()).squeeze(1) - xs.squeeze(1));
    EXPECT_GT(RelativeError(out.select(1, 0).index_select(0, index), wrong), 1e-5);
  }
  }
}

// NOTE [MoD mixed precision]: under --bf16 the router scores bf16 tokens in fp32 (the
// tokens widened to its fp32 weight), so a layer routes the same tokens as its fp32 twin
// would for the same values; the update and the residual stream stay bf16 and the router's
// gradient is fp32. The check is sensitive: on these tokens the top-k of bf16 logits (the
// tokens times the router rounded to bf16, what a router computing in the activations'
// dtype gives) picks other tokens than the top-k of fp32 logits.
TEST(ModPluginTest, Bf16TokensAreRoutedByFp32Logits) {
  ModFlags flags(0.25);
  ModelOptions o = Small();
  o.device_spec.compute_dtype = at::kBFloat16;
  auto mod = WithMod(o);
  torch::manual_seed(5);
  const int64_t b = 256;  // sequences: many top-4 choices, some close to a tie
  const at::Tensor x = torch::randn({o.seq_length, b, o.hidden_size}).to(at::kBFloat16);
  const at::Tensor router = Router(*mod);
  ASSERT_EQ(router.scalar_type(), at::kFloat) << "the router's master is fp32";
  auto chosen_by = [&](const at::Tensor& logits) {
    const at::Tensor top = std::get<1>(logits.topk(4, 0));
    return at::zeros({o.seq_length, b}, at::kBool).scatter(0, top, true);
  };
  const at::Tensor fp32_rule = chosen_by(at::matmul(x.to(at::kFloat), router));
  const at::Tensor bf16_rule = chosen_by(at::matmul(x, router.to(at::kBFloat16)));
  ASSERT_FALSE(at::equal(fp32_rule, bf16_rule)) << "the data must tell the two rules apart";

  const at::Tensor input = x.clone().requires_grad_(true);
  const at::Tensor out = mod->layers().at(1)->Forward(input, Training());
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  // The computed tokens are those the layer changed; the others pass through bit for bit.
  const at::Tensor changed = out.detach().ne(x).any(-1);
  EXPECT_TRUE(at::equal(changed, fp32_rule));
  EXPECT_DOUBLE_EQ(mod->layers().at(1)->Load(), 0.25);
  out.to(at::kFloat).square().sum().backward();
  EXPECT_EQ(input.grad().scalar_type(), at::kBFloat16);
  ASSERT_TRUE(router.grad().defined());
  EXPECT_EQ(router.grad().scalar_type(), at::kFloat);
  EXPECT_GT(router.grad().abs().sum().item<double>(), 0) << "the gate trains the router";
}

TEST(ModPluginTest, EvaluationComputesTheTokensTheCausalDecisionPicks) {
  for (const bool rope : {false, true})
  for (const std::string causal : {"aux_loss", "predictor"}) {
    SCOPED_TRACE(causal);
    SCOPED_TRACE(rope ? "rotary positions" : "learned positions");
    ModFlags flags(0.25, causal);
    ModelOptions o = Small();
    if (rope) o.position_embedding = PositionEmbedding::kRotary;
    auto mod = WithMod(o);
    GptModel plain(o, kLayersOnly);
    torch::manual_seed(3);
    const at::Tensor x = torch::randn({o.seq_length, 3, o.hidden_size});
    at::Tensor decision = at::matmul(x, Router(*mod));
    if (causal == "predictor") {
      std::map<std::string, at::Tensor> p;
      for (const Parameter& q : mod->layers().at(1)->parameters()) p[q.name] = q.value;
      decision = at::linear(at::gelu(at::linear(x, p["mod.predictor.fc1.weight"], p["mod.predictor.fc1.bias"])),
                            p["mod.predictor.fc2.weight"], p["mod.predictor.fc2.bias"])
                     .squeeze(-1);
    }
    const at::Tensor chosen = decision.gt(0);
    // A decision that is about to flip would make the check flaky; the random draw has none.
    ASSERT_GT(decision.abs().min().item<double>(), 1e-6);
    ExpectRoutedLayerMatches(*mod, plain, x, chosen, Evaluation(), 1e-5);
    const double fraction = chosen.to(at::kDouble).mean().item<double>();
    EXPECT_DOUBLE_EQ(mod->layers().at(1)->Load(), fraction);
  }
}

TEST(ModPluginTest, TheCausalDecisionLearnsThroughTheAuxiliaryLoss) {
  for (const std::string causal : {"aux_loss", "predictor"}) {
    SCOPED_TRACE(causal);
    ModFlags flags(0.25, causal, /*coeff=*/1.0);
    const ModelOptions o = Small();
    auto with_aux = WithMod(o);
    ModFlags no_aux(0.25, causal, /*coeff=*/0.0);
    auto without = WithMod(o);
    torch::manual_seed(4);
    const at::Tensor x = torch::randn({o.seq_length, 2, o.hidden_size});
    ForwardContext ctx = Training();
    ctx.loss_scale = 1.0 / 32;
    for (GptModel* m : {with_aux.get(), without.get()}) {
      m->ZeroGrad();
      m->ForwardLayers(x.clone().requires_grad_(), ctx).sum().backward();
    }
    std::map<std::string, at::Tensor> a, b;
    for (const Parameter& p : with_aux->layers().at(1)->parameters()) a[p.name] = p.value.grad();
    for (const Parameter& p : without->layers().at(1)->parameters()) b[p.name] = p.value.grad();
    if (causal == "predictor") {
      // The predictor learns only from its loss; the router's gradient is the gate's alone.
      ASSERT_TRUE(a["mod.predictor.fc2.weight"].defined());
      EXPECT_GT(a["mod.predictor.fc2.weight"].abs().sum().item<double>(), 0);
      EXPECT_FALSE(b["mod.predictor.fc2.weight"].defined() &&
                   b["mod.predictor.fc2.weight"].abs().sum().item<double>() > 0);
      EXPECT_TRUE(at::allclose(a["mod.router.weight"], b["mod.router.weight"]));
    } else {
      // The router's logits are the decision: its loss changes the router's gradient.
      EXPECT_FALSE(at::allclose(a["mod.router.weight"], b["mod.router.weight"]));
    }
    // The block's own weights get the same gradients either way.
    EXPECT_TRUE(at::allclose(a["mlp.linear_fc1.weight"], b["mlp.linear_fc1.weight"]));
  }
}

TEST(ModPluginTest, GradientsMatchFiniteDifferences) {
  ModFlags flags(0.5, "aux_loss", 0.1);
  const ModelOptions o = Small(/*fp64=*/true);
  auto mod = WithMod(o);
  TransformerLayer& layer = *mod->layers().at(1);
  torch::manual_seed(5);
  const at::Tensor x0 = torch::randn({o.seq_length, 2, o.hidden_size}, at::kDouble);
  const at::Tensor direction = torch::randn_like(x0);
  ForwardContext ctx = Training();
  ctx.loss_scale = 1.0 / 32;
  // Loss: a fixed projection of the output, plus the auxiliary loss that rides along in the
  // backward (coefficient × BCE of the router logits against the chosen tokens, with
  // gradient scale loss_scale × tokens = 1, NOTE [auxiliary losses]).
  const at::Tensor probe = torch::randn_like(x0);
  at::Tensor w = Router(*mod);
  auto loss = [&](const at::Tensor& in) {
    at::NoGradGuard no_grad;
    const at::Tensor logits = at::matmul(in, w);
    const at::Tensor top = std::get<1>(logits.topk(o.seq_length / 2, 0));
    const at::Tensor chosen = at::zeros_like(logits).scatter(0, top, 1.0);
    return (layer.Forward(in, ctx) * probe).sum().item<double>() +
           0.1 * at::binary_cross_entropy_with_logits(logits, chosen).item<double>();
  };
  at::Tensor x = x0.clone().requires_grad_();
  (layer.Forward(x, ctx) * probe).sum().backward();
  at::Tensor router_grad = w.grad().clone();
  const double analytic = (x.grad() * direction).sum().item<double>();
  // The top-k choice is locally constant, so central differences see the same tokens.
  const double eps = 1e-6;
  const double numeric = (loss(x0 + eps * direction) - loss(x0 - eps * direction)) / (2 * eps);
  EXPECT_NEAR(analytic, numeric, 1e-6 * std::max(1.0, std::abs(numeric)));
  // The router weight: the gate's gradient plus the auxiliary loss's.
  const at::Tensor dw = torch::randn_like(w);
  auto g = [&](double t) {
    {
      at::NoGradGuard no_grad;
      w.add_(t * dw);
    }
    const double value = loss(x0);
    at::NoGradGuard no_grad;
    w.sub_(t * dw);
    return value;
  };
  const double numeric_w = (g(eps) - g(-eps)) / (2 * eps);
  EXPECT_NEAR((router_grad * dw).sum().item<double>(), numeric_w, 1e-6 * std::max(1.0, std::abs(numeric_w)));
}

TEST(ModPluginTest, ALayerListRoutesExactlyThoseLayers) {
  ModFlags flags(0.25);
  FLAGS_mod_layers = "0";
  const ModelOptions o = Small();
  auto mod = WithMod(o);
  GptModel plain(o, kLayersOnly);
  torch::manual_seed(6);
  const at::Tensor x = torch::randn({o.seq_length, 2, o.hidden_size});
  at::NoGradGuard no_grad;
  // Layer 1 is now the plain layer; layer 0 computes 4 of 16 tokens.
  EXPECT_TRUE(at::equal(mod->layers().at(1)->Forward(x, Training()), plain.layers().at(1)->Forward(x, Training())));
  mod->layers().at(0)->Forward(x, Training());
  EXPECT_DOUBLE_EQ(mod->layers().at(0)->Load(), 0.25);
}

TEST(ModPluginTest, BadFlagsAreRefusedNamingTheFlag) {
  PluginSetup setup;
  setup.model = Small();
  {
    ModFlags flags(0.0);
    auto status = ValidatePlugins({"mod"}, setup);
    EXPECT_NE(status.ToString().find("--mod_capacity"), std::string::npos) << status;
  }
  {
    ModFlags flags(0.5, "sometimes");
    EXPECT_NE(ValidatePlugins({"mod"}, setup).ToString().find("--mod_causal"), std::string::npos);
  }
  {
    ModFlags flags(0.5);
    FLAGS_mod_layers = "1-5";
    EXPECT_NE(ValidatePlugins({"mod"}, setup).ToString().find("--mod_layers: '1-5'"), std::string::npos);
  }
  {
    ModFlags flags(0.5);
    setup.model.position_embedding = PositionEmbedding::kRotary;
    EXPECT_TRUE(ValidatePlugins({"mod"}, setup).ok()) << "rotary positions work too";
  }
}

}  // namespace
}  // namespace fulcrum::plugins
