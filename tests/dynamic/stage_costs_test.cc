// PlacementStageCosts: the per-stage costs that re-packing and the simulator hand
// pipeline::Simulate, worked out by hand.
#include "dynamic/stage_costs.h"

#include "gtest/gtest.h"

namespace fulcrum::dynamic {
namespace {

pipeline::ActionCosts Pinned(double f, double b, double w) {
  pipeline::ActionCosts c;
  c.forward = f;
  c.backward_input = b;
  c.backward_weight = w;
  return c;
}

TEST(PlacementStageCostsTest, SumsEachRangeAndPinsTheEndsOnTheirStages) {
  const std::vector<double> forward = {1, 2, 3, 4, 5};
  const std::vector<double> backward = {10, 20, 30, 40, 50};
  const Placement placement = {{0, 1}, {1, 4}, {4, 5}};
  const std::vector<pipeline::ActionCosts> costs = PlacementStageCosts(
      forward, backward, /*weight=*/{}, Pinned(0.5, 0.25, 0.125), Pinned(7, 8, 9), placement, 0.75);
  ASSERT_EQ(costs.size(), 3u);
  EXPECT_DOUBLE_EQ(costs[0].forward, 1 + 0.5);
  EXPECT_DOUBLE_EQ(costs[0].backward_input, 10 + 0.25);
  EXPECT_DOUBLE_EQ(costs[0].backward_weight, 0.125);  // no per-layer W: zeros
  EXPECT_DOUBLE_EQ(costs[1].forward, 2 + 3 + 4);
  EXPECT_DOUBLE_EQ(costs[1].backward_input, 20 + 30 + 40);
  EXPECT_DOUBLE_EQ(costs[1].backward_weight, 0);
  EXPECT_DOUBLE_EQ(costs[2].forward, 5 + 7);
  EXPECT_DOUBLE_EQ(costs[2].backward_input, 50 + 8);
  EXPECT_DOUBLE_EQ(costs[2].backward_weight, 9);
  for (const pipeline::ActionCosts& c : costs) EXPECT_DOUBLE_EQ(c.p2p, 0.75);
}

TEST(PlacementStageCostsTest, OneStageCarriesBothEnds) {
  const std::vector<pipeline::ActionCosts> costs =
      PlacementStageCosts({1, 1}, {2, 2}, {3, 3}, Pinned(1, 0, 0), Pinned(0, 0, 4), {{0, 2}}, 0);
  ASSERT_EQ(costs.size(), 1u);
  EXPECT_DOUBLE_EQ(costs[0].forward, 3);
  EXPECT_DOUBLE_EQ(costs[0].backward_input, 4);
  EXPECT_DOUBLE_EQ(costs[0].backward_weight, 10);
}

}  // namespace
}  // namespace fulcrum::dynamic
