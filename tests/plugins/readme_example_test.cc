// plugins/README.md's worked example is tests/plugins/grad_ema_example.cc, compiled into
// this test binary: the README shows it verbatim, and it does what the README says.
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/gpt_model.h"
#include "gtest/gtest.h"
#include "parallel/world_communicator.h"
#include "plugins/plugin_registry.h"
#include "tests/core/test_util.h"

namespace fulcrum::plugins {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(ReadmeExampleTest, TheReadmeShowsTheCompiledExampleVerbatim) {
  const std::string source = ReadFile(std::string(FULCRUM_SOURCE_DIR) + "/tests/plugins/grad_ema_example.cc");
  const size_t begin = source.find("// BEGIN EXAMPLE\n");
  const size_t end = source.find("// END EXAMPLE");
  ASSERT_NE(begin, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  const std::string code = source.substr(begin + 17, end - begin - 17);
  const std::string readme = ReadFile(std::string(FULCRUM_SOURCE_DIR) + "/plugins/README.md");
  EXPECT_NE(readme.find("```cpp\n" + code + "```"), std::string::npos)
      << "plugins/README.md must show tests/plugins/grad_ema_example.cc between the markers";
}

TEST(ReadmeExampleTest, TheExampleKeepsItsStateInTheLayersAndReportsIt) {
  auto names = SelectPlugins("grad_ema");
  ASSERT_TRUE(names.ok()) << names.status();
  PluginSetup setup;
  setup.model = testing::SmallModelOf(3, 8);
  auto set = MakePlugins(*names, setup);
  ASSERT_TRUE(set.ok()) << set.status();
  GptModel model(setup.model, StageSpec(), nullptr, *set);
  at::Tensor tokens = at::randint(64, {2, 9}, at::TensorOptions().dtype(at::kLong));
  model.ForwardLoss(tokens, ForwardContext{true, 1, 0, 1.0}).sum.backward();
  PluginContext ctx(1, model, nullptr, nullptr);
  ASSERT_TRUE((*set)->AfterBackward(ctx).ok());
  nlohmann::json record;
  std::string log;
  ASSERT_TRUE((*set)->Metrics(ctx, &record, &log).ok());
  double largest = 0;
  for (const auto& [index, layer] : model.layers()) {
    const at::Tensor ema = layer->FindBuffer("grad_ema.norm");
    ASSERT_TRUE(ema.defined());
    EXPECT_GT(ema.item<float>(), 0.0f);
    EXPECT_EQ(layer->Load(), ema.item<float>()) << "the layer's load is the plugin's report";
    double norm = 0;
    for (const Parameter& p : layer->parameters()) norm += p.value.grad().pow(2).sum().item<double>();
    // One step of the average from zero: (1 − decay) · norm.
    EXPECT_NEAR(ema.item<float>(), 0.1 * std::sqrt(norm), 1e-5 * std::sqrt(norm));
    largest = std::max(largest, std::sqrt(norm));
  }
  EXPECT_NEAR(record["largest_layer_grad_norm"].get<double>(), largest, 1e-6 * largest);
  // The state is checkpointed under the layer's global name.
  bool saved = false;
  for (const auto& [name, tensor] : model.layers().at(1)->StateTensors()) saved = saved || name == "layers.1.grad_ema.norm";
  EXPECT_TRUE(saved);
}

}  // namespace
}  // namespace fulcrum::plugins
