// --rebalance_script (pipeline/rebalancer.h): a script played through from a placement.
#include "pipeline/rebalancer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

namespace fulcrum::pipeline {
namespace {

using ::testing::HasSubstr;

TEST(ScriptedRebalancerTest, PlacementsPlayTheScriptThrough) {
  const auto rebalancer = ScriptedRebalancer::Parse("3:3->1; 5:1,7");
  ASSERT_TRUE(rebalancer.ok()) << rebalancer.status();
  const auto placements = (*rebalancer)->Placements({{0, 4}, {4, 8}});
  ASSERT_TRUE(placements.ok()) << placements.status();
  const std::map<int64_t, LayerRanges> expected = {{3, {{0, 3}, {3, 8}}}, {5, {{0, 1}, {1, 8}}}};
  EXPECT_EQ(*placements, expected);
}

// Layer counts whose sum overflows 64 bits wrapped around to "places -2 layers" (signed
// overflow: UBSan reports it on this input in tests/fuzz/schedule_scripts_fuzz.cc).
TEST(ScriptedRebalancerTest, LayerCountsBeyondTheModelAreRefused) {
  const auto rebalancer = ScriptedRebalancer::Parse("5:9223372036854775807,9223372036854775807");
  ASSERT_TRUE(rebalancer.ok()) << rebalancer.status();
  const auto placements = (*rebalancer)->Placements({{0, 4}, {4, 8}});
  ASSERT_FALSE(placements.ok());
  EXPECT_THAT(
      std::string(placements.status().message()),
      HasSubstr("--rebalance_script at iteration 5: places more than the model's 8 layers"));
  // A sum that fits but is not the layer count keeps its message.
  const auto short_script = ScriptedRebalancer::Parse("5:1,2");
  ASSERT_TRUE(short_script.ok());
  EXPECT_THAT(std::string((*short_script)->Placements({{0, 4}, {4, 8}}).status().message()),
              HasSubstr("places 3 layers; the model has 8"));
}

}  // namespace
}  // namespace fulcrum::pipeline
