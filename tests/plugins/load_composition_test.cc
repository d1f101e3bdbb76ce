// How the loads of several plugins on one layer compose (NOTE [layer load composition] in
// core/transformer_layer.h): fractions multiply, a block's measure replaces the dense base
// and already counts its tokens, a plugin's own prediction replaces both, and a second
// prediction for the same layer is refused.
#include <memory>
#include <stdexcept>
#include <string>

#include "core/gpt_model.h"
#include "core/plugin.h"
#include "core/transformer_layer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

// An MLP replacement that measures its own work (as an MoE block counts expert rows).
class MeasuringBlock final : public FeedForward {
 public:
  at::Tensor Forward(const at::Tensor& x, const ForwardContext&) override { return x; }
  double Load() const override { return 40.0; }
};

// Speaks for every layer in one way, chosen at construction.
class LoadPlugin final : public Plugin {
 public:
  enum class Does { kWeights, kTokens, kPredicts, kMeasuringBlock };
  LoadPlugin(Does does, double value) : does_(does), value_(value) {}
  const char* name() const override { return "load_test"; }
  std::unique_ptr<FeedForward> MakeFeedForward(int64_t, Unit&, bool) override {
    return does_ == Does::kMeasuringBlock ? std::make_unique<MeasuringBlock>() : nullptr;
  }
  void EditLayer(TransformerLayer& layer, bool) override {
    const double v = value_;
    switch (does_) {
      case Does::kWeights:
        layer.AddLoadFraction(TransformerLayer::LoadFraction::kWeights, [v] { return v; });
        break;
      case Does::kTokens:
        layer.AddLoadFraction(TransformerLayer::LoadFraction::kTokens, [v] { return v; });
        break;
      case Does::kPredicts:
        layer.SetLoadReporter([v] { return v; });
        break;
      case Does::kMeasuringBlock:
        break;
    }
  }

 private:
  Does does_;
  double value_;
};

// Layer 0's load with the plugins `does` (in order).
double LoadWith(std::initializer_list<std::pair<LoadPlugin::Does, double>> does) {
  auto set = std::make_shared<PluginSet>();
  for (const auto& [d, v] : does) set->Add(std::make_unique<LoadPlugin>(d, v));
  GptModel model(testing::SmallModelOf(2, 8), StageSpec(), nullptr, set);
  return model.layers().at(0)->Load();
}

using Does = LoadPlugin::Does;

TEST(LoadCompositionTest, FractionsMultiplyOnTheDenseLayer) {
  EXPECT_EQ(LoadWith({}), 0.0) << "a plain dense layer";
  EXPECT_EQ(LoadWith({{Does::kWeights, 0.5}}), 0.5);
  EXPECT_EQ(LoadWith({{Does::kTokens, 0.25}}), 0.25);
  // Pruning to half the weights and routing a quarter of the tokens: an eighth of the work,
  // in either order (not the later plugin's alone).
  EXPECT_EQ(LoadWith({{Does::kWeights, 0.5}, {Does::kTokens, 0.25}}), 0.125);
  EXPECT_EQ(LoadWith({{Does::kTokens, 0.25}, {Does::kWeights, 0.5}}), 0.125);
  EXPECT_EQ(LoadWith({{Does::kTokens, 0.5}, {Does::kTokens, 0.5}}), 0.25);
}

TEST(LoadCompositionTest, ABlocksMeasureIsTheBaseAndAlreadyCountsItsTokens) {
  EXPECT_EQ(LoadWith({{Does::kMeasuringBlock, 0}}), 40.0);
  EXPECT_EQ(LoadWith({{Does::kMeasuringBlock, 0}, {Does::kWeights, 0.5}}), 20.0);
  // The block was given the routed tokens only; their fraction is not applied twice.
  EXPECT_EQ(LoadWith({{Does::kMeasuringBlock, 0}, {Does::kTokens, 0.25}}), 40.0);
  EXPECT_EQ(LoadWith({{Does::kMeasuringBlock, 0}, {Does::kTokens, 0.25}, {Does::kWeights, 0.5}}),
            20.0);
}

TEST(LoadCompositionTest, APredictionIsTheBaseForEveryFraction) {
  EXPECT_EQ(LoadWith({{Does::kPredicts, 100}}), 100.0);
  EXPECT_EQ(LoadWith({{Does::kMeasuringBlock, 0}, {Does::kPredicts, 100}}), 100.0)
      << "the prediction replaces the block's measure";
  EXPECT_EQ(LoadWith({{Does::kPredicts, 100}, {Does::kTokens, 0.25}, {Does::kWeights, 0.5}}),
            12.5);
}

TEST(LoadCompositionTest, TwoPredictionsForOneLayerAreRefusedNamingIt) {
  try {
    LoadWith({{Does::kPredicts, 1}, {Does::kPredicts, 2}});
    FAIL() << "expected std::logic_error";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("layers.0"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("AddLoadFraction"));
  }
}

}  // namespace
}  // namespace fulcrum
