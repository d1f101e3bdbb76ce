// --rebalance_script (pipeline/rebalancer.h): a script played through from a placement.
#include "pipeline/rebalancer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <vector>
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


// NOTE [rebalancing under chunks]: ZB-V on 2 ranks, virtual stages 0..3 on ranks 0, 1, 1, 0.
const std::vector<int> kVRanks = {0, 1, 1, 0};

TEST(ChunkRebalanceTest, MovesBetweenNamesRanksAndLocalMoves) {
  const LayerRanges from = {{0, 1}, {1, 2}, {2, 5}, {5, 6}};
  // Layer 4: virtual 2 → 3, rank 1 → 0 (a transfer); layer 2: virtual 2 → 1, both rank 1.
  const LayerRanges to = {{0, 1}, {1, 3}, {3, 4}, {4, 6}};
  const std::vector<PlannedMove> moves = MovesBetween(from, to, kVRanks);
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0], (PlannedMove{2, 2, 1, 1, 1}));
  EXPECT_TRUE(moves[0].local());
  EXPECT_EQ(moves[1], (PlannedMove{4, 2, 3, 1, 0}));
  EXPECT_FALSE(moves[1].local());
  // Without a map (v = 1) a stage is its rank: nothing is local.
  for (const PlannedMove& move : MovesBetween({{0, 2}, {2, 4}}, {{0, 3}, {3, 4}})) {
    EXPECT_EQ(move.from_rank, move.from_stage);
    EXPECT_EQ(move.to_rank, move.to_stage);
    EXPECT_FALSE(move.local());
  }
}

TEST(ChunkRebalanceTest, LoadsGiveThePlacementInModelOrderAndTheRankMap) {
  std::vector<StageLoad> loads(2);
  loads[0].stage = 0;
  loads[0].chunk_ranges = {{0, 2}, {6, 8}};  // Rank 0: virtual 0 and 3.
  loads[1].stage = 1;
  loads[1].chunk_ranges = {{2, 4}, {4, 6}};  // Rank 1: virtual 1 and 2.
  EXPECT_EQ(CurrentRanges(loads), (LayerRanges{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(ChunkRanks(loads), kVRanks);
  EXPECT_TRUE(ValidateRanges(CurrentRanges(loads), 8, 4).ok());
  EXPECT_THAT(std::string(ValidateRanges(CurrentRanges(loads), 8, 2).message()),
              HasSubstr("a placement of 4 ranges for 2 stages"));
  // v = 1: the loads' ranges, no map.
  std::vector<StageLoad> plain(2);
  plain[0].stage = 0;
  plain[0].layer_begin = 0;
  plain[0].layer_end = 3;
  plain[1].stage = 1;
  plain[1].layer_begin = 3;
  plain[1].layer_end = 8;
  EXPECT_EQ(CurrentRanges(plain), (LayerRanges{{0, 3}, {3, 8}}));
  EXPECT_TRUE(ChunkRanks(plain).empty());
}

TEST(ChunkRebalanceTest, PlanHashTellsVirtualPlacementsApart) {
  EXPECT_NE(PlanHash(3, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}), PlanHash(3, {{0, 4}, {4, 8}}));
  EXPECT_NE(PlanHash(3, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}),
            PlanHash(3, {{0, 2}, {2, 5}, {5, 6}, {6, 8}}));
  EXPECT_EQ(PlanHash(3, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}),
            PlanHash(3, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
}

TEST(ChunkRebalanceTest, ScriptMovesBetweenVirtualStages) {
  // With chunks a script's stages are virtual stages: "2:2->0" moves virtual 1's first
  // layer to virtual 0; "4:1,3,3,1" gives the four virtual stages 1, 3, 3 and 1 layers.
  const auto rebalancer = ScriptedRebalancer::Parse("2:2->0; 4:1,3,3,1");
  ASSERT_TRUE(rebalancer.ok()) << rebalancer.status();
  const auto placements = (*rebalancer)->Placements({{0, 2}, {2, 4}, {4, 6}, {6, 8}});
  ASSERT_TRUE(placements.ok()) << placements.status();
  const std::map<int64_t, LayerRanges> expected = {
      {2, {{0, 3}, {3, 4}, {4, 6}, {6, 8}}}, {4, {{0, 1}, {1, 4}, {4, 7}, {7, 8}}}};
  EXPECT_EQ(*placements, expected);
  std::vector<StageLoad> loads(2);
  loads[0].stage = 0;
  loads[0].chunk_ranges = {{0, 2}, {6, 8}};
  loads[1].stage = 1;
  loads[1].chunk_ranges = {{2, 4}, {4, 6}};
  EXPECT_EQ((*rebalancer)->Plan(2, loads).target, (LayerRanges{{0, 3}, {3, 4}, {4, 6}, {6, 8}}));
}

}  // namespace
}  // namespace fulcrum::pipeline
