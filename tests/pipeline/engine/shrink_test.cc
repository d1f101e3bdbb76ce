// Tests of the live shrink's arithmetic (pipeline/shrink.h): who survives, the layout after
// the shrink and each rank's new rank; the state exchange itself runs in the multi-process
// SlowRepackTrainTest (tests/recipes/repack_train_test.cc).
#include "pipeline/shrink.h"

#include <vector>

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
  plan.old_config.tp = 2;
  EXPECT_THAT(std::string(ValidateShrinkPlan(plan).message()),
              HasSubstr("--tensor_model_parallel_size=1"));
}

}  // namespace
}  // namespace fulcrum::pipeline
