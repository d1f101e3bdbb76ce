// The early_exit plugin (plugins/early_exit.cc) against dense references: with a threshold
// no token reaches it equals the plain model bit for bit; an exited token's state passes
// later layers unchanged while the active ones get the plain layer's output; an exit
// marks exactly the tokens whose head confidence (recomputed here with the model's own
// head) reaches the threshold; and the exit losses' gradients reach the layers, the final
// norm and the tied word embeddings as autograd of the weighted loss says.
#include <gflags/gflags.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>

#include "core/gpt_model.h"
#include "core/plugin.h"
#include "core/transformer_layer.h"
#include "gtest/gtest.h"
#include "plugins/plugin_registry.h"
#include "tests/core/test_util.h"

DECLARE_string(early_exit_layers);
DECLARE_string(early_exit_loss_weights);
DECLARE_double(early_exit_threshold);
DECLARE_string(early_exit_confidence);

namespace fulcrum::plugins {
namespace {

ModelOptions Model() {
  ModelOptions m = testing::SmallModel();  // hidden 32, 4 heads, seq 16, vocab 64
  m.num_layers = 3;
  m.device_spec.master_dtype = m.device_spec.compute_dtype = at::kDouble;
  return m;
}

struct Flags {
  Flags(double threshold, const std::string& layers = "0,1", const std::string& weights = "") {
    FLAGS_early_exit_layers = layers;
    FLAGS_early_exit_loss_weights = weights;
    FLAGS_early_exit_threshold = threshold;
    FLAGS_early_exit_confidence = "softmax";
  }
  gflags::FlagSaver saver;
};

struct Built {
  std::shared_ptr<PluginSet> plugins;
  std::unique_ptr<GptModel> model;
};

Built WithEarlyExit(const ModelOptions& m) {
  PluginSetup setup;
  setup.model = m;
  auto plugins = MakePlugins({"early_exit"}, setup);
  EXPECT_TRUE(plugins.ok()) << plugins.status();
  Built built{*plugins, std::make_unique<GptModel>(m, StageSpec(), nullptr, *plugins)};
  PluginContext ctx(0, *built.model, nullptr, {});
  EXPECT_TRUE(built.plugins->BeforeIteration(ctx).ok());  // syncs the head copy
  return built;
}

at::Tensor Tokens(const ModelOptions& m, int64_t b, uint64_t seed) {
  at::manual_seed(seed);
  return at::randint(m.vocab_size, {b, m.seq_length + 1}, at::kLong);
}

TEST(EarlyExitTest, ThresholdAboveOneIsThePlainModelBitForBit) {
  Flags flags(/*threshold=*/1.5);
  const ModelOptions m = Model();
  Built ee = WithEarlyExit(m);
  GptModel plain(m);
  const at::Tensor tokens = Tokens(m, 3, 1);
  for (bool training : {false, true}) {
    ForwardContext ctx{training, 1, 0, training ? 1e-3 : 0.0};
    const LossSum a = ee.model->ForwardLoss(tokens, ctx);
    const LossSum b = plain.ForwardLoss(tokens, ctx);
    EXPECT_TRUE(at::equal(a.sum, b.sum)) << a.sum.item<double>() << " vs " << b.sum.item<double>();
  }
}

TEST(EarlyExitTest, ExitedTokensPassLaterLayersUnchangedActiveOnesGetThePlainLayer) {
  Flags flags(/*threshold=*/1.5, /*layers=*/"0");
  const ModelOptions m = Model();
  Built ee = WithEarlyExit(m);
  const int64_t s = m.seq_length, b = 2, h = m.hidden_size;
  at::manual_seed(3);
  const at::Tensor x = at::randn({s, b, h}, at::kDouble);
  // Tokens 2, 5, 6 of sequence 0 and 0..9 of sequence 1 exited at layer 0.
  at::Tensor state = at::full({s, b}, -1.0, at::kFloat);
  for (int64_t p : {2, 5, 6}) state[p][0] = 0;
  state.narrow(0, 0, 10).select(1, 1).fill_(0);
  ForwardContext ctx{false};
  ctx.token_state = state.clone();
  at::NoGradGuard no_grad;
  const TransformerLayer& layer = *ee.model->layers().at(2);
  const at::Tensor out = layer.Forward(x, ctx);
  const at::Tensor dense = layer.PlainForward(x, ForwardContext{false});
  const at::Tensor exited = state.ge(0);
  for (int64_t j = 0; j < b; ++j) {
    for (int64_t p = 0; p < s; ++p) {
      if (exited[p][j].item<bool>()) {
        EXPECT_TRUE(at::equal(out[p][j], x[p][j])) << "exited token " << p << "," << j << " propagated";
      } else {
        EXPECT_LT((out[p][j] - dense[p][j]).abs().max().item<double>(), 1e-12)
            << "active token " << p << "," << j << " as the plain layer (keys of every token)";
      }
    }
  }
  EXPECT_TRUE(at::equal(ctx.token_state, state)) << "a layer without a head decides nothing";
  // Its load: the fraction it computed, reported after the iteration's metrics.
  EXPECT_FALSE(at::equal(out, dense)) << "the exited tokens were really skipped";
}

TEST(EarlyExitTest, AnExitMarksTheTokensWhoseHeadConfidenceReachesTheThreshold) {
  const ModelOptions m = Model();
  const at::Tensor tokens = Tokens(m, 4, 5);
  const int64_t s = m.seq_length;
  // The exit head's confidence after layer 0, from the model's own head.
  at::Tensor confidence;
  {
    Flags flags(1.5, "0");
    Built ee = WithEarlyExit(m);
    at::NoGradGuard no_grad;
    ForwardContext ctx{false};
    const at::Tensor hidden = ee.model->layers().at(0)->PlainForward(
        ee.model->Embed(tokens.narrow(1, 0, s), ctx), ctx);
    const at::Tensor logits =
        ee.model->head()->Logits(hidden, ee.model->embedding()->word_embeddings());
    confidence = std::get<0>(at::softmax(logits, -1).max(-1)).to(at::kFloat);  // [s, b]
  }
  const double threshold = confidence.median().item<double>();
  Flags flags(threshold, "0");
  Built ee = WithEarlyExit(m);
  ForwardContext ctx{false};
  ctx.labels = tokens.narrow(1, 1, s).t();
  at::NoGradGuard no_grad;
  const at::Tensor hidden = ee.model->layers().at(0)->Forward(
      ee.model->Embed(tokens.narrow(1, 0, s), ctx), ctx);
  ASSERT_TRUE(ctx.token_state.defined());
  const at::Tensor want = at::where(confidence.ge(threshold), at::zeros_like(confidence),
                                    at::full_like(confidence, -1.0));
  // Confidences within rounding of the threshold may go either way.
  const at::Tensor clear = (confidence - threshold).abs().gt(1e-6);
  EXPECT_TRUE(at::equal(ctx.token_state.masked_select(clear), want.masked_select(clear)));
  const int64_t exited = ctx.token_state.ge(0).sum().item<int64_t>();
  EXPECT_GT(exited, 0);
  EXPECT_LT(exited, ctx.token_state.numel());
}

// The exit loss reaches the right parameters: training loss = Σ final CE + w · Σ exit CE
// (both over the micro-batch's tokens, scaled by loss_scale), reference by autograd on the
// plain model with its head applied after layer 0.
TEST(EarlyExitTest, ExitLossGradientsMatchAutogradOfTheWeightedLoss) {
  const double weight = 0.7;
  Flags flags(/*threshold=*/1.5, "0", "0.7");
  const ModelOptions m = Model();
  const at::Tensor tokens = Tokens(m, 2, 9);
  const int64_t s = m.seq_length;
  const double loss_scale = 1.0 / 32;
  Built ee = WithEarlyExit(m);
  {
    ForwardContext ctx{true, 1, 0, loss_scale};
    (ee.model->ForwardLoss(tokens, ctx).sum * loss_scale).backward();
    PluginContext pctx(1, *ee.model, nullptr, {});
    ASSERT_TRUE(ee.plugins->AfterBackward(pctx).ok());
  }
  GptModel plain(m);
  {
    ForwardContext ctx{true, 1, 0, loss_scale};
    const at::Tensor labels = tokens.narrow(1, 1, s);
    at::Tensor hidden = plain.Embed(tokens.narrow(1, 0, s), ctx);
    hidden = plain.layers().at(0)->Forward(hidden, ctx);
    const at::Tensor exit_loss = plain.HeadLoss(hidden, labels).sum;
    for (int64_t l = 1; l < m.num_layers; ++l) hidden = plain.layers().at(l)->Forward(hidden, ctx);
    ((plain.HeadLoss(hidden, labels).sum + weight * exit_loss) * loss_scale).backward();
  }
  const std::vector<Unit*> got = ee.model->Units(), want = plain.Units();
  ASSERT_EQ(got.size(), want.size());
  for (size_t u = 0; u < got.size(); ++u) {
    for (size_t i = 0; i < got[u]->parameters().size(); ++i) {
      const Parameter& g = got[u]->parameters()[i];
      const Parameter& w = want[u]->parameters()[i];
      ASSERT_TRUE(g.value.grad().defined()) << got[u]->name() << "." << g.name;
      EXPECT_LT((g.value.grad() - w.value.grad()).abs().max().item<double>(), 1e-12)
          << got[u]->name() << "." << g.name;
    }
  }
}

// With Mixture-of-Depths (listed first) early exit wraps mod's wrapper: without exits the
// model is the mod model bit for bit; with exits, the routed layer leaves exited tokens
// unchanged and gives the active ones mod's output. Listed the other way round, mod refuses.
TEST(EarlyExitTest, ComposesAroundModAndModRefusesTheOtherOrder) {
  gflags::FlagSaver saver;
  Flags flags(/*threshold=*/1.5, "0");
  ModelOptions m = Model();
  m.num_layers = 2;
  PluginSetup setup;
  setup.model = m;
  auto both = MakePlugins({"mod", "early_exit"}, setup);
  auto mod_only = MakePlugins({"mod"}, setup);
  ASSERT_TRUE(both.ok() && mod_only.ok());
  GptModel composed(m, StageSpec(), nullptr, *both);
  GptModel mod(m, StageSpec(), nullptr, *mod_only);
  PluginContext ctx(0, composed, nullptr, {});
  ASSERT_TRUE((*both)->BeforeIteration(ctx).ok());
  const at::Tensor tokens = Tokens(m, 2, 4);
  at::NoGradGuard no_grad;
  ForwardContext train{true, 1, 0, 0.0};
  EXPECT_TRUE(at::equal(composed.ForwardLoss(tokens, train).sum, mod.ForwardLoss(tokens, train).sum));

  // Layer 1 is mod-routed (every other layer); mark some tokens exited.
  const int64_t s = m.seq_length;
  at::manual_seed(8);
  const at::Tensor x = at::randn({s, 2, m.hidden_size}, at::kDouble);
  ForwardContext exits{true, 1, 0, 0.0};
  exits.token_state = at::full({s, 2}, -1.0, at::kFloat);
  exits.token_state.narrow(0, 0, 5).fill_(0);
  const at::Tensor out = composed.layers().at(1)->Forward(x, exits);
  const at::Tensor want = mod.layers().at(1)->Forward(x, ForwardContext{true, 1, 0, 0.0});
  EXPECT_TRUE(at::equal(out.narrow(0, 0, 5), x.narrow(0, 0, 5))) << "exited tokens unchanged";
  EXPECT_TRUE(at::equal(out.narrow(0, 5, s - 5), want.narrow(0, 5, s - 5))) << "the others: mod's";

  auto wrong_order = MakePlugins({"early_exit", "mod"}, setup);
  ASSERT_TRUE(wrong_order.ok());
  EXPECT_THROW(GptModel(m, StageSpec(), nullptr, *wrong_order), std::logic_error);
}

TEST(EarlyExitTest, BadFlagsAreRefusedNamingThem) {
  const ModelOptions m = Model();
  PluginSetup setup;
  setup.model = m;
  auto message = [&](const std::string& layers, const std::string& weights, double threshold,
                     const std::string& confidence = "softmax") {
    Flags flags(threshold, layers, weights);
    FLAGS_early_exit_confidence = confidence;
    return std::string(ValidatePlugins({"early_exit"}, setup).message());
  };
  EXPECT_NE(message("2", "", 0.9).find("last layer"), std::string::npos);
  EXPECT_NE(message("0,7", "", 0.9).find("--early_exit_layers"), std::string::npos);
  EXPECT_NE(message("0,1", "0.5", 0.9).find("1 weights for 2 exit layers"), std::string::npos);
  EXPECT_NE(message("0", "-1", 0.9).find("--early_exit_loss_weights"), std::string::npos);
  EXPECT_NE(message("0", "", 0).find("--early_exit_threshold"), std::string::npos);
  EXPECT_NE(message("0", "", 0.9, "entropy").find("--early_exit_confidence"), std::string::npos);
  EXPECT_EQ(message("0,1", "0.2,0.4", 0.9), "");
}

}  // namespace
}  // namespace fulcrum::plugins
