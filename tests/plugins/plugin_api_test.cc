// The plugin API (core/plugin.h, plugins/plugin_registry.h) through a plugin that lives in
// this file alone — registered here, selected by name like any plugin: it changes layers
// (replaces the MLP of odd layers, registers per-layer state), reports a load that reaches
// the rebalancer, and its state travels with a migrating layer. Composition rules and the
// hooks' order are checked too.
#include <nlohmann/json.hpp>

#include <algorithm>

#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/plugin.h"
#include "core/trainer.h"
#include "core/transformer_layer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "parallel/world_communicator.h"
#include "pipeline/pipeline_runner.h"
#include "plugins/plugin_registry.h"
#include "tests/core/test_util.h"

namespace fulcrum::plugins {
namespace {

// A block halving its input (an MLP replacement with no parameters).
class HalfBlock final : public FeedForward {
 public:
  at::Tensor Forward(const at::Tensor& x, const ForwardContext&) override { return x * 0.5; }
};

std::vector<std::string>* HookLog() {
  static auto* log = new std::vector<std::string>();
  return log;
}

// The plugin under test: odd layers get a HalfBlock; every layer a "test.visits" counter
// buffer and a load of 1000 + its index; every hook is logged.
class TestPlugin final : public Plugin {
 public:
  const char* name() const override { return "test_one_file"; }
  std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit&, bool) override {
    return layer % 2 == 1 ? std::make_unique<HalfBlock>() : nullptr;
  }
  void EditLayer(TransformerLayer& layer, bool) override {
    layer.AddBuffer("test.visits", at::zeros({1}, at::kFloat));
    const int64_t index = layer.layer_index();
    layer.SetLoadReporter([index] { return 1000.0 + static_cast<double>(index); });
  }
  absl::Status BeforeIteration(PluginContext& ctx) override { return Log("before", ctx); }
  absl::Status AfterBackward(PluginContext& ctx) override { return Log("backward", ctx); }
  absl::Status AfterOptimizerStep(PluginContext& ctx) override { return Log("step", ctx); }

 private:
  absl::Status Log(const char* what, PluginContext& ctx) {
    HookLog()->push_back(absl::StrCat(what, " ", ctx.iteration()));
    return absl::OkStatus();
  }
};

FULCRUM_REGISTER_PLUGIN(test_one_file, "a plugin defined in a test file",
                        (PluginEntry{nullptr, nullptr,
                                     [](const PluginSetup&) -> absl::StatusOr<std::unique_ptr<Plugin>> {
                                       return std::unique_ptr<Plugin>(new TestPlugin());
                                     }}));

ModelOptions SmallModel() { return testing::SmallModelOf(4, 8); }

std::shared_ptr<PluginSet> Build(const std::string& names) {
  auto selected = SelectPlugins(names);
  EXPECT_TRUE(selected.ok()) << selected.status();
  PluginSetup setup;
  setup.model = SmallModel();
  auto set = MakePlugins(*selected, setup);
  EXPECT_TRUE(set.ok()) << set.status();
  return *set;
}

TEST(PluginApiTest, APluginInOneFileIsFoundByNameAndChangesTheLayers) {
  // Registered from this file alone, and listed for --help.
  EXPECT_NE(PluginRegistry::Global().Find("test_one_file"), nullptr);
  EXPECT_THAT(PluginHelp(), ::testing::HasSubstr("test_one_file"));
  GptModel model(SmallModel(), StageSpec(), nullptr, Build("test_one_file"));
  for (const auto& [index, layer] : model.layers()) {
    EXPECT_EQ(layer->feed_forward() != nullptr, index % 2 == 1) << index;
    EXPECT_EQ(layer->FindParameter("mlp.linear_fc1.weight") == nullptr, index % 2 == 1) << index;
    EXPECT_EQ(layer->Load(), 1000.0 + index);
    ASSERT_EQ(layer->buffers().size(), 1u);
    EXPECT_EQ(layer->buffers()[0].first, "test.visits");
  }
  // Its state travels with a migrating layer (into a shell built through the plugins).
  {
    TransformerLayer& layer = *model.layers().at(2);
    layer.buffers()[0].second.fill_(7.0f);
    std::map<std::string, at::Tensor> wire;
    for (auto& [name, tensor] : layer.MigrationTensors()) wire.emplace(name, tensor.clone());
    ASSERT_TRUE(wire.count("layers.2.test.visits"));
    std::unique_ptr<TransformerLayer> shell = model.NewLayerShell(2);
    ASSERT_TRUE(shell->LoadMigrationTensors(wire).ok());
    EXPECT_EQ(shell->buffers()[0].second.item<float>(), 7.0f);
    EXPECT_EQ(shell->Load(), 1002.0);
  }
}

TEST(PluginApiTest, ThePluginsLoadReachesTheRebalancer) {
  class Recording final : public pipeline::Rebalancer {
   public:
    explicit Recording(std::vector<double>* seen) : seen_(seen) {}
    const char* name() const override { return "recording"; }
    pipeline::RebalanceDecision Plan(int64_t, const std::vector<pipeline::StageLoad>& loads) override {
      *seen_ = loads[0].layer_block_load;
      return {};
    }

   private:
    std::vector<double>* seen_;
  };
  auto world = parallel::CreateWorldCommunicator(parallel::WorldInfo{}, parallel::Backend::kGloo,
                                                 std::chrono::seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  GptModel model(SmallModel(), StageSpec(), nullptr, Build("test_one_file"));
  std::vector<double> seen;
  pipeline::PipelineRunner runner(world->get(), "zbh1", /*micro_batch_size=*/2,
                                  std::make_unique<Recording>(&seen));
  MicroBatchPlan plan;
  plan.count = 2;
  plan.first_sample = [](int m) { return int64_t{2} * m; };
  plan.tokens = [](int m) { return at::randint(64, {2, 9}, at::TensorOptions().dtype(at::kLong)); };
  ASSERT_TRUE(runner.Run(model, 1, plan, 1e-3).ok());
  EXPECT_EQ(seen, (std::vector<double>{1000, 1001, 1002, 1003}));
}

TEST(PluginApiTest, TwoPluginsCannotBothReplaceAnMlp) {
  class HalvesEveryMlp final : public Plugin {
   public:
    const char* name() const override { return "halves"; }
    std::unique_ptr<FeedForward> MakeFeedForward(int64_t, Unit&, bool) override {
      return std::make_unique<HalfBlock>();
    }
  };
  PluginSet set;
  set.Add(std::make_unique<HalvesEveryMlp>());
  set.Add(std::make_unique<HalvesEveryMlp>());
  EXPECT_THROW(GptModel(SmallModel(), StageSpec(), nullptr,
                        std::shared_ptr<LayerCustomizer>(&set, [](LayerCustomizer*) {})),
               std::logic_error);
}

TEST(PluginApiTest, SelectionRefusesUnknownAndRepeatedNames) {
  EXPECT_THAT(std::string(SelectPlugins("nope").status().message()),
              ::testing::HasSubstr("--plugins: 'nope' is not a plugin; plugins: "));
  EXPECT_THAT(std::string(SelectPlugins("test_one_file,test_one_file").status().message()),
              ::testing::HasSubstr("twice"));
  auto names = SelectPlugins(" test_one_file ");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"test_one_file"});
}

// A plugin whose layers would use the expert-parallel group (PluginEntry::
// uses_expert_parallel_group), as the MoE layers do.
FULCRUM_REGISTER_PLUGIN(test_expert_user, "a test plugin that uses the expert-parallel group",
                        (PluginEntry{nullptr, nullptr,
                                     [](const PluginSetup&) -> absl::StatusOr<std::unique_ptr<Plugin>> {
                                       return std::unique_ptr<Plugin>(new TestPlugin());
                                     },
                                     /*uses_expert_parallel_group=*/true}));

// --expert_model_parallel_size > 1 needs a selected plugin that uses the expert group; the
// check names no plugin, only the capability (and the flags a user reaches for).
TEST(PluginApiTest, AnExpertParallelLayoutNeedsAPluginThatUsesTheExpertGroup) {
  PluginSetup setup;
  setup.model = SmallModel();
  setup.layout.world_size = 2;
  setup.layout.ep_size = 2;
  const absl::Status refused = ValidatePlugins({"test_one_file"}, setup);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("--expert_model_parallel_size=2 needs MoE layers (--num_experts)"));
  EXPECT_TRUE(ValidatePlugins({"test_one_file", "test_expert_user"}, setup).ok());
  setup.layout.ep_size = 1;
  EXPECT_TRUE(ValidatePlugins({"test_one_file"}, setup).ok());
}

// bf16 is a capability a plugin declares (PluginEntry::supports_bf16, false by default):
// under --bf16 a selected plugin without it is refused before any work, by name, with the
// plugins that do run under --bf16 (every built-in one: tests/recipes/
// bf16_plugins_train_test.cc and bf16_moe_train_test.cc run them).
TEST(PluginApiTest, Bf16RefusesAPluginThatDoesNotDeclareIt) {
  PluginSetup setup;
  setup.model = SmallModel();
  setup.model.device_spec.compute_dtype = at::kBFloat16;
  const absl::Status refused = ValidatePlugins({"freeze", "test_one_file"}, setup);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()),
              ::testing::AllOf(
                  ::testing::HasSubstr("--bf16 does not combine with --plugins=test_one_file: "
                                       "their tensors are not yet written for bf16 activations"),
                  ::testing::HasSubstr("early_exit, freeze, mod, moe, prune, sparse_attention")));
  const absl::Status accepted =
      ValidatePlugins({"freeze", "prune", "mod", "early_exit", "sparse_attention"}, setup);
  EXPECT_TRUE(accepted.ok()) << accepted;
  setup.model.device_spec.compute_dtype = at::kFloat;
  EXPECT_TRUE(ValidatePlugins({"test_one_file"}, setup).ok()) << "fp32 takes every plugin";
}

// The Trainer hands the plugins the layout (Plugin::OnLayout) before it builds any layer,
// so what a plugin builds on the process groups is ready for the first layer.
TEST(PluginApiTest, TheTrainerGivesThePluginsTheLayoutBeforeBuildingLayers) {
  class LayoutFirst final : public Plugin {
   public:
    explicit LayoutFirst(std::vector<std::string>* log) : log_(log) {}
    const char* name() const override { return "layout_first"; }
    absl::Status OnLayout(ParallelContext* parallel) override {
      log_->push_back(parallel == nullptr ? "layout: one process" : "layout: parallel");
      return absl::OkStatus();
    }
    std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit&, bool) override {
      log_->push_back(absl::StrCat("layer ", layer));
      return nullptr;
    }

   private:
    std::vector<std::string>* log_;
  };
  std::vector<std::string> log;
  auto set = std::make_shared<PluginSet>();
  set->Add(std::make_unique<LayoutFirst>(&log));
  const TrainerConfig config = testing::SmallTrainerConfig();
  auto trainer = Trainer::Create(config, testing::SyntheticCorpus(20, 100, config.model.vocab_size),
                                 TrainerLayout(), DefaultFileSystem(), set);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  ASSERT_GE(log.size(), 2u);
  EXPECT_EQ(log[0], "layout: one process");
  EXPECT_EQ(log[1], "layer 0");
  EXPECT_EQ(std::count(log.begin(), log.end(), "layout: one process"), 1);
}

// A plugin that edits gradients only through the door (NOTE [reduced gradients]): it zeroes
// every part it is given and counts their elements.
class ZeroGradients final : public Plugin {
 public:
  explicit ZeroGradients(bool reads_parameter_grads) : reads_(reads_parameter_grads) {}
  const char* name() const override { return "zero_gradients"; }
  bool ReadsWholeGradients() const override { return reads_; }
  absl::Status AfterBackward(PluginContext& ctx) override {
    for (const GradientPart& part : ctx.gradients().parts()) {
      elements += part.end - part.begin;
      part.grad.zero_();
    }
    sliced = ctx.gradients().sliced();
    return absl::OkStatus();
  }
  int64_t elements = 0;
  bool sliced = false;

 private:
  bool reads_;
};

// The parts are what the step reads, under AdamW (whole gradients) and the distributed
// optimizer (its slices, here of a group of one): zeroed, the norm is 0 and, without weight
// decay, Adam's first update (0 / (0 + ε)) leaves every weight as it was. A part that was a
// copy would leave the real gradients, and the weights would move.
TEST(PluginApiTest, GradientPartsAreWhatTheStepReadsUnderEitherOptimizer) {
  for (const bool distributed : {false, true}) {
    TrainerConfig config = testing::SmallTrainerConfig();
    config.optimizer.use_distributed_optimizer = distributed;
    config.optimizer.weight_decay = 0;
    auto set = std::make_shared<PluginSet>();
    auto owned = std::make_unique<ZeroGradients>(false);
    ZeroGradients* plugin = owned.get();
    set->Add(std::move(owned));
    auto trainer = Trainer::Create(config, testing::SyntheticCorpus(20, 100, config.model.vocab_size),
                                   TrainerLayout(), DefaultFileSystem(), set);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    std::vector<at::Tensor> before;
    int64_t elements = 0;
    for (Unit* unit : (*trainer)->model().Units()) {
      for (const Parameter& p : unit->parameters()) {
        before.push_back(p.value.clone());
        elements += p.value.numel();
      }
    }
    auto stats = (*trainer)->TrainIteration();
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->grad_norm, 0.0) << distributed;
    EXPECT_EQ(plugin->sliced, distributed);
    EXPECT_EQ(plugin->elements, elements) << "every parameter's gradient, once";
    size_t i = 0;
    int64_t moved = 0;
    for (Unit* unit : (*trainer)->model().Units()) {
      for (const Parameter& p : unit->parameters()) moved += !at::equal(p.value, before[i++]);
    }
    EXPECT_EQ(moved, 0) << distributed;
  }
}

// A trainer's context outside AfterBackward has no reduced gradients: asking for them is a
// programming error, not Parameter grads that are unreduced or already cleared.
TEST(PluginApiTest, GradientsOutsideAfterBackwardAreAnError) {
  const TrainerConfig config = testing::SmallTrainerConfig();
  GptModel model(config.model);
  PluginContext ctx(1, model, nullptr, nullptr);
  ctx.set_optimizer_state_parts([] { return std::vector<MomentSlice>{}; });
  EXPECT_THROW(ctx.gradients(), std::logic_error);
  ReducedGradients none({});
  ctx.set_gradients(&none);
  EXPECT_EQ(&ctx.gradients(), &none);
}

// A plugin that reads Parameter grads (ReadsWholeGradients) is refused by the distributed
// optimizer, by name, before any work; AdamW takes it.
TEST(PluginApiTest, TheDistributedOptimizerRefusesAPluginThatReadsParameterGradients) {
  for (const bool distributed : {false, true}) {
    TrainerConfig config = testing::SmallTrainerConfig();
    config.optimizer.use_distributed_optimizer = distributed;
    auto set = std::make_shared<PluginSet>();
    set->Add(std::make_unique<ZeroGradients>(true));
    auto trainer = Trainer::Create(config, testing::SyntheticCorpus(20, 100, config.model.vocab_size),
                                   TrainerLayout(), DefaultFileSystem(), set);
    if (!distributed) {
      EXPECT_TRUE(trainer.ok()) << trainer.status();
      continue;
    }
    ASSERT_FALSE(trainer.ok());
    EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(trainer.status().message()),
                ::testing::HasSubstr("--use_distributed_optimizer: plugin 'zero_gradients' reads"));
  }
}

}  // namespace
}  // namespace fulcrum::plugins
