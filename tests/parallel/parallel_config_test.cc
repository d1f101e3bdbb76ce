// Tests of ParallelConfig: the rank arithmetic and the process groups it implies, over every
// valid layout of small worlds, plus hand-checked layouts and the validation messages.
#include "parallel/parallel_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

namespace fulcrum::parallel {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Groups = std::vector<std::vector<int>>;

std::string ValidationError(int world_size, int tp, int pp, int ep) {
  return std::string(ParallelConfig{world_size, tp, pp, ep}.Validate().message());
}

// Every valid (tp, pp, ep) for worlds 1..16.
std::vector<ParallelConfig> AllValidConfigs() {
  std::vector<ParallelConfig> configs;
  for (int world = 1; world <= 16; ++world) {
    for (int tp = 1; tp <= world; ++tp) {
      for (int pp = 1; pp <= world; ++pp) {
        for (int ep = 1; ep <= world; ++ep) {
          const ParallelConfig config{world, tp, pp, ep};
          if (config.Validate().ok()) configs.push_back(config);
        }
      }
    }
  }
  return configs;
}

TEST(ParallelConfigTest, EnumeratesManyLayouts) {
  // Guards the property tests below against silently iterating over nothing.
  EXPECT_GT(AllValidConfigs().size(), 200u);
}

TEST(ParallelConfigTest, CoordsAndRankAreInverse) {
  for (const ParallelConfig& config : AllValidConfigs()) {
    SCOPED_TRACE(config.ToString());
    std::set<std::vector<int>> seen;
    for (int rank = 0; rank < config.world_size; ++rank) {
      const RankCoords c = config.Coords(rank);
      ASSERT_GE(c.tp, 0);
      ASSERT_LT(c.tp, config.tp);
      ASSERT_GE(c.dp, 0);
      ASSERT_LT(c.dp, config.dp());
      ASSERT_GE(c.pp, 0);
      ASSERT_LT(c.pp, config.pp);
      ASSERT_LT(c.ep, config.ep);
      ASSERT_LT(c.edp, config.expert_dp());
      EXPECT_EQ(c.dp, c.edp * config.ep + c.ep);
      EXPECT_EQ(config.Rank(c.tp, c.dp, c.pp), rank);
      EXPECT_TRUE(seen.insert({c.tp, c.dp, c.pp}).second) << "rank " << rank;
    }
  }
}

TEST(ParallelConfigTest, GroupsOfEachKindPartitionTheWorld) {
  for (const ParallelConfig& config : AllValidConfigs()) {
    for (GroupKind kind : kAllGroupKinds) {
      SCOPED_TRACE(config.ToString() + " " + std::string(GroupKindName(kind)));
      const Groups groups = config.AllGroups(kind);
      const int size = config.GroupSize(kind);
      ASSERT_EQ(static_cast<int>(groups.size()) * size, config.world_size);
      std::vector<int> owner(config.world_size, -1);
      for (size_t g = 0; g < groups.size(); ++g) {
        ASSERT_EQ(static_cast<int>(groups[g].size()), size);
        EXPECT_TRUE(std::is_sorted(groups[g].begin(), groups[g].end()));
        for (int rank : groups[g]) {
          ASSERT_GE(rank, 0);
          ASSERT_LT(rank, config.world_size);
          EXPECT_EQ(owner[rank], -1) << "rank " << rank << " is in two groups";
          owner[rank] = static_cast<int>(g);
        }
      }
      // Every rank, asking for its own group, gets exactly the group that lists it: all
      // ranks agree on the groups.
      for (int rank = 0; rank < config.world_size; ++rank) {
        ASSERT_NE(owner[rank], -1) << "rank " << rank << " is in no group";
        EXPECT_EQ(config.GroupOf(kind, rank), groups[owner[rank]]) << "rank " << rank;
      }
    }
  }
}

TEST(ParallelConfigTest, GroupSizesFollowTheConfig) {
  const ParallelConfig config{16, 2, 2, 2};
  ASSERT_TRUE(config.Validate().ok());
  EXPECT_EQ(config.dp(), 4);
  EXPECT_EQ(config.expert_dp(), 2);
  EXPECT_EQ(config.GroupSize(GroupKind::kTensor), 2);
  EXPECT_EQ(config.GroupSize(GroupKind::kPipeline), 2);
  EXPECT_EQ(config.GroupSize(GroupKind::kData), 4);
  EXPECT_EQ(config.GroupSize(GroupKind::kExpert), 2);
  EXPECT_EQ(config.GroupSize(GroupKind::kExpertData), 2);
  EXPECT_EQ(config.GroupSize(GroupKind::kModel), 4);
}

TEST(ParallelConfigTest, MembersShareTheCoordinatesTheirGroupDoesNotSpan) {
  for (const ParallelConfig& config : AllValidConfigs()) {
    SCOPED_TRACE(config.ToString());
    for (int rank = 0; rank < config.world_size; ++rank) {
      const RankCoords me = config.Coords(rank);
      for (int other : config.GroupOf(GroupKind::kTensor, rank)) {
        const RankCoords c = config.Coords(other);
        EXPECT_TRUE(c.dp == me.dp && c.pp == me.pp);
      }
      for (int other : config.GroupOf(GroupKind::kPipeline, rank)) {
        const RankCoords c = config.Coords(other);
        EXPECT_TRUE(c.tp == me.tp && c.dp == me.dp);
      }
      for (int other : config.GroupOf(GroupKind::kData, rank)) {
        const RankCoords c = config.Coords(other);
        EXPECT_TRUE(c.tp == me.tp && c.pp == me.pp);
      }
      for (int other : config.GroupOf(GroupKind::kExpert, rank)) {
        const RankCoords c = config.Coords(other);
        EXPECT_TRUE(c.tp == me.tp && c.pp == me.pp && c.edp == me.edp);
      }
      for (int other : config.GroupOf(GroupKind::kExpertData, rank)) {
        const RankCoords c = config.Coords(other);
        EXPECT_TRUE(c.tp == me.tp && c.pp == me.pp && c.ep == me.ep);
      }
      for (int other : config.GroupOf(GroupKind::kModel, rank)) {
        EXPECT_EQ(config.Coords(other).dp, me.dp);
      }
    }
  }
}

TEST(ParallelConfigTest, TensorGroupsAreContiguousAndExpertGroupsAreConsecutiveDpRanks) {
  for (const ParallelConfig& config : AllValidConfigs()) {
    SCOPED_TRACE(config.ToString());
    for (const auto& group : config.AllGroups(GroupKind::kTensor)) {
      EXPECT_EQ(group.back() - group.front(), config.tp - 1);
    }
    for (const auto& group : config.AllGroups(GroupKind::kExpert)) {
      for (size_t i = 1; i < group.size(); ++i) {
        EXPECT_EQ(config.Coords(group[i]).dp, config.Coords(group[i - 1]).dp + 1);
      }
    }
  }
}

TEST(ParallelConfigTest, World8Tp2Pp2Layout) {
  const ParallelConfig config{8, 2, 2, 1};
  ASSERT_TRUE(config.Validate().ok());
  EXPECT_EQ(config.dp(), 2);
  EXPECT_EQ(config.AllGroups(GroupKind::kTensor), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(config.AllGroups(GroupKind::kPipeline), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(config.AllGroups(GroupKind::kData), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(config.AllGroups(GroupKind::kModel), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(config.AllGroups(GroupKind::kExpert),
            (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  EXPECT_EQ(config.AllGroups(GroupKind::kExpertData), config.AllGroups(GroupKind::kData));
  EXPECT_EQ(config.Coords(6), (RankCoords{/*tp=*/0, /*dp=*/1, /*pp=*/1, /*ep=*/0, /*edp=*/1}));
  EXPECT_EQ(config.Rank(1, 1, 1), 7);
}

TEST(ParallelConfigTest, World16Tp2Ep2Layout) {
  // dp = 8 replicas of (tp 2); experts split over pairs of consecutive replicas.
  const ParallelConfig config{16, 2, 1, 2};
  ASSERT_TRUE(config.Validate().ok());
  EXPECT_EQ(config.dp(), 8);
  EXPECT_EQ(config.expert_dp(), 4);
  EXPECT_THAT(config.GroupOf(GroupKind::kData, 5), ElementsAre(1, 3, 5, 7, 9, 11, 13, 15));
  EXPECT_THAT(config.GroupOf(GroupKind::kExpert, 5), ElementsAre(5, 7));
  EXPECT_THAT(config.GroupOf(GroupKind::kExpert, 7), ElementsAre(5, 7));
  EXPECT_THAT(config.GroupOf(GroupKind::kExpertData, 5), ElementsAre(1, 5, 9, 13));
  EXPECT_THAT(config.GroupOf(GroupKind::kExpertData, 6), ElementsAre(2, 6, 10, 14));
  const RankCoords c = config.Coords(13);  // tp 1, dp 6 = edp 3 * ep 2 + ep 0.
  EXPECT_EQ(c, (RankCoords{/*tp=*/1, /*dp=*/6, /*pp=*/0, /*ep=*/0, /*edp=*/3}));
}

TEST(ParallelConfigTest, SingleProcessIsOneGroupOfEveryKind) {
  const ParallelConfig config;
  ASSERT_TRUE(config.Validate().ok());
  for (GroupKind kind : kAllGroupKinds) {
    EXPECT_EQ(config.AllGroups(kind), (Groups{{0}})) << GroupKindName(kind);
  }
}

TEST(ParallelConfigTest, RankArithmeticIsConstexpr) {
  constexpr ParallelConfig kConfig{8, 2, 2, 1};
  static_assert(kConfig.dp() == 2);
  static_assert(kConfig.Rank(1, 0, 1) == 5);
  static_assert(kConfig.Coords(5).pp == 1 && kConfig.Coords(5).tp == 1);
}

TEST(ParallelConfigTest, ToStringNamesEverySize) {
  EXPECT_EQ((ParallelConfig{4, 2, 1, 1}).ToString(), "tp=2 pp=1 ep=1 dp=2 (world 4)");
  EXPECT_EQ((ParallelConfig{16, 2, 2, 2}).ToString(), "tp=2 pp=2 ep=2 dp=4 (world 16)");
}

TEST(ParallelConfigTest, GroupKindNames) {
  std::set<std::string> names;
  for (GroupKind kind : kAllGroupKinds) names.insert(std::string(GroupKindName(kind)));
  EXPECT_EQ(names, (std::set<std::string>{"tp", "pp", "dp", "ep", "edp", "mp"}));
}

TEST(ParallelConfigTest, RejectsWorldNotDivisibleByModelParallelSize) {
  const absl::Status status = ParallelConfig{6, 4, 1, 1}.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "world size 6 is not divisible by --tensor_model_parallel_size=4 × "
            "--pipeline_model_parallel_size=1");
  EXPECT_THAT(ValidationError(8, 2, 3, 1),
              HasSubstr("--pipeline_model_parallel_size=3"));
}

TEST(ParallelConfigTest, RejectsExpertSizeNotDividingDataParallelSize) {
  const absl::Status status = ParallelConfig{4, 1, 1, 3}.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "--expert_model_parallel_size=3 must divide the data-parallel size 4");
}

TEST(ParallelConfigTest, RejectsNonPositiveSizes) {
  EXPECT_THAT(ValidationError(0, 1, 1, 1),
              HasSubstr("world size 0 must be at least 1"));
  EXPECT_THAT(ValidationError(4, 0, 1, 1),
              HasSubstr("--tensor_model_parallel_size=0 must be at least 1"));
  EXPECT_THAT(ValidationError(4, 1, -2, 1),
              HasSubstr("--pipeline_model_parallel_size=-2 must be at least 1"));
  EXPECT_THAT(ValidationError(4, 1, 1, 0),
              HasSubstr("--expert_model_parallel_size=0 must be at least 1"));
  // dp() and expert_dp() stay defined (0) on such configs instead of dividing by zero.
  EXPECT_EQ((ParallelConfig{4, 0, 1, 1}).dp(), 0);
  EXPECT_EQ((ParallelConfig{4, 1, 1, 0}).expert_dp(), 0);
}

}  // namespace
}  // namespace fulcrum::parallel
