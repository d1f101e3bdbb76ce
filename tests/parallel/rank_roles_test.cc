// Tests of RankRolesOf: hand-checked layouts (what ProcessGroupContext answered before the
// roles became a value), and properties every valid layout of small worlds must have.
#include "parallel/rank_roles.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace fulcrum::parallel {
namespace {

std::vector<RankRoles> AllRoles(const ParallelConfig& config) {
  std::vector<RankRoles> roles;
  for (int rank = 0; rank < config.world_size; ++rank) roles.push_back(RankRolesOf(config, rank));
  return roles;
}

std::vector<int> Where(const std::vector<RankRoles>& roles, bool (*pick)(const RankRoles&)) {
  std::vector<int> ranks;
  for (const RankRoles& r : roles) {
    if (pick(r)) ranks.push_back(r.world_rank);
  }
  return ranks;
}

bool Logs(const RankRoles& r) { return r.is_logging_rank; }
bool Writes(const RankRoles& r) { return r.writes_checkpoint_shard; }
bool Commits(const RankRoles& r) { return r.commits_checkpoint; }

TEST(RankRolesTest, DefaultIsTheOneProcessJob) {
  const RankRoles one;
  EXPECT_EQ(one.world_rank, 0);
  EXPECT_EQ(one.world_size, 1);
  EXPECT_EQ(one.tp_size * one.pp_size * one.ep_size * one.dp_size, 1);
  EXPECT_EQ(one.model_parallel_size, 1);
  EXPECT_TRUE(one.is_logging_rank);
  EXPECT_EQ(one.checkpoint_part, CheckpointPart::kEverything);
  EXPECT_TRUE(one.writes_checkpoint_shard);
  EXPECT_TRUE(one.commits_checkpoint);
  EXPECT_EQ(one.checkpoint_shard_name, "rank_00000");
}

// Ranks run tp fastest, then dp, then pp: rank = tp + 2·dp + 4·pp.
TEST(RankRolesTest, Tp2Pp2Dp2) {
  const std::vector<RankRoles> roles = AllRoles(ParallelConfig{8, 2, 2, 1});
  EXPECT_EQ(Where(roles, Logs), std::vector<int>({4}));  // last stage, tp 0, dp 0
  EXPECT_EQ(Where(roles, Commits), std::vector<int>({0}));
  EXPECT_EQ(Where(roles, Writes), std::vector<int>({0, 4}));  // tp 0 of the first replica
  const std::vector<int> model_parallel_rank{0, 1, 0, 1, 2, 3, 2, 3};
  const std::vector<int> dp_rank{0, 0, 1, 1, 0, 0, 1, 1};
  for (const RankRoles& r : roles) {
    SCOPED_TRACE(r.world_rank);
    EXPECT_EQ(r.world_size, 8);
    EXPECT_EQ(r.tp_size, 2);
    EXPECT_EQ(r.pp_size, 2);
    EXPECT_EQ(r.ep_size, 1);
    EXPECT_EQ(r.dp_size, 2);
    EXPECT_EQ(r.dp_rank, dp_rank[r.world_rank]);
    EXPECT_EQ(r.model_parallel_rank, model_parallel_rank[r.world_rank]);
    EXPECT_EQ(r.model_parallel_size, 4);
    EXPECT_EQ(r.checkpoint_part,
              r.dp_rank == 0 ? CheckpointPart::kEverything : CheckpointPart::kNothing);
    EXPECT_EQ(r.checkpoint_shard_name, r.world_rank < 4 ? "stage_000" : "stage_001");
  }
}

TEST(RankRolesTest, Ep2SavesTheOtherExpertsFromTheSecondReplica) {
  const std::vector<RankRoles> roles = AllRoles(ParallelConfig{2, 1, 1, 2});
  EXPECT_EQ(roles[0].checkpoint_part, CheckpointPart::kEverything);
  EXPECT_EQ(roles[1].checkpoint_part, CheckpointPart::kExpertParallel);
  EXPECT_EQ(Where(roles, Writes), std::vector<int>({0, 1}));
  EXPECT_EQ(roles[0].checkpoint_shard_name, "stage_000");
  EXPECT_EQ(roles[1].checkpoint_shard_name, "stage_000_ep_001");
  EXPECT_EQ(Where(roles, Logs), std::vector<int>({0}));
  EXPECT_EQ(roles[1].dp_rank, 1);
  EXPECT_EQ(roles[1].model_parallel_size, 1);
}

// dp = 4 over ep = 2: the second expert-parallel group (dp 2, 3) replicates the first.
TEST(RankRolesTest, Ep2Dp4) {
  const std::vector<RankRoles> roles = AllRoles(ParallelConfig{4, 1, 1, 2});
  EXPECT_EQ(roles[0].checkpoint_part, CheckpointPart::kEverything);
  EXPECT_EQ(roles[1].checkpoint_part, CheckpointPart::kExpertParallel);
  EXPECT_EQ(roles[2].checkpoint_part, CheckpointPart::kNothing);
  EXPECT_EQ(roles[3].checkpoint_part, CheckpointPart::kNothing);
  EXPECT_EQ(Where(roles, Writes), std::vector<int>({0, 1}));
  EXPECT_EQ(roles[3].checkpoint_shard_name, "stage_000_ep_001");
}

TEST(RankRolesTest, Pp4) {
  const std::vector<RankRoles> roles = AllRoles(ParallelConfig{4, 1, 4, 1});
  EXPECT_EQ(Where(roles, Logs), std::vector<int>({3}));
  EXPECT_EQ(Where(roles, Writes), std::vector<int>({0, 1, 2, 3}));
  EXPECT_EQ(Where(roles, Commits), std::vector<int>({0}));
  for (const RankRoles& r : roles) {
    EXPECT_EQ(r.model_parallel_rank, r.world_rank);
    EXPECT_EQ(r.model_parallel_size, 4);
    EXPECT_EQ(r.dp_rank, 0);
    EXPECT_EQ(r.checkpoint_shard_name, "stage_00" + std::to_string(r.world_rank));
  }
}

// Over every valid layout of worlds 1..16: one rank logs, one commits, writers' shard names
// are distinct, and the model-parallel rank is the rank's place in its model-parallel group
// (the order SumOverModelParallel's communicator has).
TEST(RankRolesTest, EveryLayoutHasOneLoggerOneCommitterAndDistinctShards) {
  for (int world = 1; world <= 16; ++world) {
    for (int tp = 1; tp <= world; ++tp) {
      for (int pp = 1; pp <= world; ++pp) {
        for (int ep = 1; ep <= world; ++ep) {
          const ParallelConfig config{world, tp, pp, ep};
          if (!config.Validate().ok()) continue;
          SCOPED_TRACE(config.ToString());
          const std::vector<RankRoles> roles = AllRoles(config);
          EXPECT_EQ(Where(roles, Logs).size(), 1u);
          EXPECT_EQ(Where(roles, Commits), std::vector<int>({0}));
          std::set<std::string> names;
          for (int rank : Where(roles, Writes)) {
            EXPECT_TRUE(names.insert(roles[rank].checkpoint_shard_name).second)
                << "two writers of " << roles[rank].checkpoint_shard_name;
          }
          for (const RankRoles& r : roles) {
            const std::vector<int> group = config.GroupOf(GroupKind::kModel, r.world_rank);
            const auto at = std::find(group.begin(), group.end(), r.world_rank);
            EXPECT_EQ(r.model_parallel_rank, at - group.begin());
            EXPECT_EQ(r.model_parallel_size, static_cast<int>(group.size()));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace fulcrum::parallel
