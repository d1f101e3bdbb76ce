// Tests of the live shrink's arithmetic (pipeline/shrink.h): who survives, the layout after
// the shrink, each rank's new rank and which rank sends each unit to which; the state
// exchange itself runs in the multi-process SlowRepackTrainTest
// (tests/recipes/repack_train_test.cc).
#include "pipeline/shrink.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fulcrum::pipeline {
namespace {

using ::testing::HasSubstr;

ShrinkPlan Plan(int world, int pp, LayerRanges old_ranges, LayerRanges new_ranges) {
  ShrinkPlan plan;
  plan.old_config.world_size = world;
  plan.old_config.pp = pp;
  plan.old_ranges = std::move(old_ranges);
  plan.new_ranges = std::move(new_ranges);
  return plan;
}

TEST(ShrinkTest, FourStagesOntoTwoKeepTheFirstStageOfEachGroup) {
  const ShrinkPlan plan =
      Plan(4, 4, {{0, 1}, {1, 2}, {2, 3}, {3, 4}}, {{0, 2}, {2, 4}});
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(SurvivingStages(plan), (std::vector<int>{0, 2}));
  EXPECT_EQ(SurvivingRanks(plan), (std::vector<int>{0, 2}));
  EXPECT_EQ(NewRank(plan, 0), 0);
  EXPECT_EQ(NewRank(plan, 1), -1);
  EXPECT_EQ(NewRank(plan, 2), 1);
  EXPECT_EQ(NewRank(plan, 3), -1);
  const parallel::ParallelConfig shrunk = ShrunkConfig(plan);
  EXPECT_EQ(shrunk.pp, 2);
  EXPECT_EQ(shrunk.world_size, 2);
  EXPECT_EQ(shrunk.dp(), 1);
}

// Under dp = 2 every replica shrinks alike, and the survivors' new ranks follow the new
// layout's rank order (Megatron: dp before pp).
TEST(ShrinkTest, EveryReplicaShrinksAlikeInTheNewRankOrder) {
  const ShrinkPlan plan = Plan(8, 4, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}, {{0, 4}, {4, 6}, {6, 8}});
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(SurvivingStages(plan), (std::vector<int>{0, 2, 3}));
  const parallel::ParallelConfig& old = plan.old_config;
  const parallel::ParallelConfig shrunk = ShrunkConfig(plan);
  EXPECT_EQ(shrunk.world_size, 6);
  EXPECT_EQ(shrunk.dp(), 2);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(NewRank(plan, old.Rank(0, d, 1)), -1) << "stage 1 of replica " << d;
    const int stages[] = {0, 2, 3};
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(NewRank(plan, old.Rank(0, d, stages[j])), shrunk.Rank(0, d, j))
          << "replica " << d << ", new stage " << j;
    }
  }
}

TEST(ShrinkTest, RefusesWhatCannotShrinkLive) {
  ShrinkPlan plan = Plan(4, 4, {{0, 1}, {1, 2}, {2, 3}, {3, 4}}, {{0, 3}, {3, 4}});
  EXPECT_TRUE(ValidateShrinkPlan(plan).ok());
  plan.new_ranges = {{0, 1}, {1, 3}, {3, 4}};
  EXPECT_TRUE(ValidateShrinkPlan(plan).ok());
  plan.new_ranges = {{0, 2}, {2, 4}};
  plan.old_ranges = {{0, 1}, {1, 3}, {3, 4}, {4, 4}};
  EXPECT_FALSE(ValidateShrinkPlan(plan).ok()) << "an empty old stage";
  plan.old_ranges = {{0, 1}, {1, 3}, {3, 4}};
  EXPECT_FALSE(ValidateShrinkPlan(plan).ok()) << "3 ranges for pp=4";
  plan = Plan(3, 3, {{0, 1}, {1, 3}, {3, 4}}, {{0, 2}, {2, 4}});
  EXPECT_THAT(std::string(ValidateShrinkPlan(plan).message()),
              HasSubstr("is not a coarsening of [0,1) [1,3) [3,4)"));
  plan = Plan(4, 2, {{0, 2}, {2, 4}}, {{0, 2}, {2, 4}});
  EXPECT_THAT(std::string(ValidateShrinkPlan(plan).message()), HasSubstr("is no shrink"));
  plan = Plan(4, 2, {{0, 2}, {2, 4}}, {{0, 4}});
  plan.old_config.tp = 3;
  EXPECT_THAT(std::string(ValidateShrinkPlan(plan).message()), HasSubstr("not divisible"))
      << "the old layout itself is checked";
}

// Tensor and expert parallelism shrink live too (NOTE [live shrink]): only the pipeline
// size changes.
TEST(ShrinkTest, TensorAndExpertParallelLayoutsShrinkLive) {
  ShrinkPlan plan = Plan(4, 2, {{0, 2}, {2, 4}}, {{0, 4}});
  plan.old_config.tp = 2;
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(SurvivingRanks(plan), (std::vector<int>{0, 1}));
  EXPECT_EQ(ShrunkConfig(plan).tp, 2);
  plan.old_config.tp = 1;
  plan.old_config.ep = 2;
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(SurvivingRanks(plan), (std::vector<int>{0, 1}));
  EXPECT_EQ(ShrunkConfig(plan).ep, 2);
}

// NOTE [re-packing under chunks]: ZB-V on 4 ranks (virtual stages 0..7 on ranks
// 0 1 2 3 3 2 1 0, one layer each) onto 2 (a V of 0 1 1 0): ranks 0 and 2 survive, each
// new rank takes its chunks' layers from the old ranks that held them, the head stays with
// the embedding on rank 0 (no mirror to fill).
TEST(ShrinkTest, AVShrinksChunkByChunk) {
  ShrinkPlan plan = Plan(4, 4, {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}, {7, 8}},
                         {{0, 2}, {2, 4}, {4, 6}, {6, 8}});
  plan.old_owner = {0, 1, 2, 3, 3, 2, 1, 0};
  plan.new_owner = {0, 1, 1, 0};
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(plan.old_stages(), 4);
  EXPECT_EQ(plan.new_stages(), 2);
  EXPECT_EQ(SurvivingStages(plan), (std::vector<int>{0, 2}));
  EXPECT_EQ(NewRank(plan, 2), 1);
  EXPECT_EQ(NewRank(plan, 3), -1);
  std::vector<std::string> got;
  for (const ShrinkTransfer& t : ShrinkTransfers(plan)) {
    got.push_back(absl::StrCat(t.unit, " ", t.src, "->", t.dst));
  }
  EXPECT_EQ(got, (std::vector<std::string>{
                     "embedding 0->0", "layers.0 0->0", "layers.1 1->0", "layers.6 1->0",
                     "layers.7 0->0", "head 0->0",  //
                     "layers.2 2->2", "layers.3 3->2", "layers.4 3->2", "layers.5 2->2"}));
  // Onto one rank: one range, every layer to rank 0.
  plan.new_ranges = {{0, 8}};
  plan.new_owner.clear();
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  EXPECT_EQ(SurvivingStages(plan), (std::vector<int>{0}));
  // A new rank may not take part of an old rank's chunks: old rank 1's virtual 1 and 6
  // would go to different new ranks.
  plan.new_ranges = {{0, 2}, {2, 4}, {4, 7}, {7, 8}};
  plan.new_owner = {0, 1, 1, 0};
  EXPECT_THAT(ValidateShrinkPlan(plan).message(), HasSubstr("a stage merges whole"));
  plan.new_ranges = {{0, 2}, {2, 4}, {4, 6}, {6, 8}};
  plan.new_owner = {0, -1, -1, 0};
  EXPECT_THAT(ValidateShrinkPlan(plan).message(), HasSubstr("new owner -1 is no stage"));
}

// tp = 2, pp 2 → 1: each tensor-parallel shard moves to the survivor with the same tp rank
// (stage 1's ranks 2 and 3 send to ranks 0 and 1), so every slice keeps its shape.
TEST(ShrinkTest, TransfersPairTheSameTensorParallelRank) {
  ShrinkPlan plan = Plan(4, 2, {{0, 2}, {2, 4}}, {{0, 4}});
  plan.old_config.tp = 2;
  std::vector<std::string> got;
  for (const ShrinkTransfer& t : ShrinkTransfers(plan)) {
    got.push_back(absl::StrCat(t.unit, " ", t.src, "->", t.dst));
  }
  EXPECT_EQ(got, (std::vector<std::string>{
                     "embedding 0->0", "layers.0 0->0", "layers.1 0->0", "layers.2 2->0",
                     "layers.3 2->0", "head 2->0",  //
                     "embedding 1->1", "layers.0 1->1", "layers.1 1->1", "layers.2 3->1",
                     "layers.3 3->1", "head 3->1"}));
}

// tp = 2, ep = 2 (inside dp = 2), pp 2 → 1, tied embeddings onto two stages of four: every
// transfer keeps the tensor-, data- and expert-parallel coordinates and lands on a
// survivor; each (tp, dp) position receives every unit of its new stage once.
TEST(ShrinkTest, TransfersKeepEveryTensorDataAndExpertCoordinate) {
  ShrinkPlan plan = Plan(16, 4, {{0, 1}, {1, 2}, {2, 3}, {3, 4}}, {{0, 2}, {2, 4}});
  plan.old_config.tp = 2;
  plan.old_config.ep = 2;
  ASSERT_TRUE(ValidateShrinkPlan(plan).ok()) << ValidateShrinkPlan(plan);
  const parallel::ParallelConfig& c = plan.old_config;
  const std::vector<int> survivors = SurvivingRanks(plan);
  std::map<int, std::vector<std::string>> received;
  for (const ShrinkTransfer& t : ShrinkTransfers(plan)) {
    SCOPED_TRACE(absl::StrCat(t.unit, " ", t.src, "->", t.dst));
    const parallel::RankCoords from = c.Coords(t.src), to = c.Coords(t.dst);
    EXPECT_EQ(from.tp, to.tp);
    EXPECT_EQ(from.dp, to.dp);
    EXPECT_EQ(from.ep, to.ep);
    EXPECT_TRUE(std::binary_search(survivors.begin(), survivors.end(), t.dst));
    received[t.dst].push_back(t.unit);
  }
  ASSERT_EQ(received.size(), 8u) << "2 stages × tp 2 × dp 2 survivors";
  for (const auto& [rank, units] : received) {
    const bool first = c.Coords(rank).pp == 0;
    EXPECT_EQ(units, first ? (std::vector<std::string>{"embedding", "layers.0", "layers.1"})
                           : (std::vector<std::string>{"embedding", "layers.2", "layers.3",
                                                       "head"}))
        << "rank " << rank;
  }
}

}  // namespace
}  // namespace fulcrum::pipeline
