// Tests of the balance problem (dynamic/balance_problem.h) and of the Partition balancer
// (dynamic/partition.h): Partition against a brute force over every placement of ≥ 1000
// random problems, and closed-form cases.
//
// The random problems and the brute-force enumeration are in balance_test_util.h, shared
// with diffusion_test.cc so that both balancers are judged on the same problems.
#include "dynamic/partition.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dynamic/balance_problem.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/dynamic/balance_test_util.h"

namespace fulcrum::dynamic {
namespace {

using ::testing::HasSubstr;
using namespace balance_testing;  // NOLINT: the shared test helpers.


TEST(BalanceProblemTest, MeasuresOfAPlacement) {
  BalanceProblem problem = CostsOnly({1, 2, 3, 4, 5}, 2);
  problem.first_stage_cost = 10;
  problem.last_stage_cost = 1;
  const Placement placement = {{0, 2}, {2, 5}};
  EXPECT_EQ(StageCosts(problem, placement), (std::vector<double>{13, 13}));
  EXPECT_EQ(Bottleneck(problem, placement), 13);
  EXPECT_EQ(Imbalance(problem, placement), 0);
  EXPECT_EQ(Potential(problem, placement), 0);
  EXPECT_EQ(FormatPlacement(placement), "[0,2) [2,5)");

  const Placement skewed = {{0, 1}, {1, 5}};  // Loads 11 and 15.
  EXPECT_DOUBLE_EQ(Imbalance(problem, skewed), 4.0 / 13.0);
  EXPECT_EQ(Potential(problem, skewed), 4);
  EXPECT_EQ(LayersMoved(placement, skewed), 1);
  EXPECT_EQ(LayersMoved(placement, placement), 0);
}

TEST(BalanceProblemTest, PotentialSumsAllPairs) {
  // |1−2| + |1−4| + |1−4| + |2−4| + |2−4| + |4−4| = 1 + 3 + 3 + 2 + 2 + 0.
  EXPECT_EQ(PotentialOfLoads({4, 1, 4, 2}), 11);
  EXPECT_EQ(PotentialOfLoads({0.1, 0.1, 0.1}), 0);
  EXPECT_EQ(PotentialOfLoads({}), 0);
}

TEST(BalanceProblemTest, StageMemoryFollowsTheFormula) {
  BalanceProblem problem = CostsOnly({1, 1, 1}, 2);
  problem.layer_state_bytes = {10, 20, 30};
  problem.layer_activation_bytes = {1, 2, 3};
  problem.activation_multiplier = {4, 1};
  problem.pinned_memory = {100, 200};
  EXPECT_EQ(StageMemory(problem, 0, {0, 2}), 100 + 30 + 4 * 3);
  EXPECT_EQ(StageMemory(problem, 1, {2, 3}), 200 + 30 + 1 * 3);
  problem.memory_budget = 233;
  EXPECT_TRUE(FitsMemory(problem, {{0, 2}, {2, 3}}));
  problem.memory_budget = 232;
  EXPECT_FALSE(FitsMemory(problem, {{0, 2}, {2, 3}}));
}

TEST(BalanceProblemTest, UniformPlacementIsMegatronsSplit) {
  EXPECT_EQ(UniformPlacement(10, 3), (Placement{{0, 4}, {4, 7}, {7, 10}}));
  EXPECT_EQ(UniformPlacement(8, 4), (Placement{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
}

TEST(BalanceProblemTest, ValidateProblemNamesTheField) {
  BalanceProblem problem = CostsOnly({1, 2}, 0);
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("num_stages is 0"));
  problem.num_stages = 2;
  EXPECT_TRUE(ValidateProblem(problem).ok());
  problem.layer_cost[1] = -1;
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("layer_cost[1] is -1"));
  problem.layer_cost[1] = std::nan("");
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("layer_cost[1] is nan"));
  problem.layer_cost[1] = 1;
  problem.layer_state_bytes = {1};
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("layer_state_bytes has 1 entries"));
  problem.layer_state_bytes.clear();
  problem.activation_multiplier = {1, 1, 1};
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("activation_multiplier has 3 entries"));
  problem.activation_multiplier.clear();
  problem.first_stage_cost = kInf;
  EXPECT_THAT(ValidateProblem(problem).message(), HasSubstr("first_stage_cost is inf"));
  problem.first_stage_cost = 0;
  problem.memory_budget = std::nan("");
  EXPECT_EQ(ValidateProblem(problem).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BalanceProblemTest, ValidatePlacementNamesTheStage) {
  const BalanceProblem problem = CostsOnly({1, 1, 1, 1}, 2);
  EXPECT_TRUE(ValidatePlacement(problem, {{0, 1}, {1, 4}}).ok());
  EXPECT_THAT(ValidatePlacement(problem, {{0, 4}}).message(), HasSubstr("1 stage ranges"));
  EXPECT_THAT(ValidatePlacement(problem, {{0, 2}, {3, 4}}).message(),
              HasSubstr("stage 1 begins at layer 3; expected 2"));
  EXPECT_THAT(ValidatePlacement(problem, {{0, 0}, {0, 4}}).message(),
              HasSubstr("stage 0 is empty"));
  EXPECT_THAT(ValidatePlacement(problem, {{0, 2}, {2, 3}}).message(),
              HasSubstr("cover all 4 layers"));
}

TEST(PartitionTest, FewerLayersThanStagesIsRefused) {
  const absl::StatusOr<Placement> placement = PartitionBalance(CostsOnly({1, 2, 3}, 4));
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(placement.status().message(),
              HasSubstr("3 layers cannot fill 4 pipeline stages (each stage needs at least "
                        "one layer)"));
  EXPECT_EQ(PartitionBalance(CostsOnly({}, 1)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PartitionTest, InvalidInputIsRefused) {
  BalanceProblem problem = CostsOnly({1, -2, 3}, 2);
  EXPECT_THAT(PartitionBalance(problem).status().message(), HasSubstr("layer_cost[1] is -2"));
  problem.layer_cost[1] = 2;
  const Placement wrong = {{0, 1}, {2, 3}};
  EXPECT_THAT(PartitionBalance(problem, &wrong).status().message(),
              HasSubstr("current placement is invalid"));
}

TEST(PartitionTest, EqualCostsGiveTheEvenSplit) {
  for (int p = 1; p <= 6; ++p) {
    for (int64_t num_layers = p; num_layers <= 20; ++num_layers) {
      const BalanceProblem problem = CostsOnly(std::vector<double>(num_layers, 1.5), p);
      const absl::StatusOr<Placement> placement = PartitionBalance(problem);
      ASSERT_TRUE(placement.ok()) << placement.status();
      EXPECT_EQ(*placement, UniformPlacement(num_layers, p))
          << "L=" << num_layers << " p=" << p << ": " << FormatPlacement(*placement);
    }
  }
}

TEST(PartitionTest, OptimalCurrentPlacementStays) {
  // 10 equal layers on 3 stages: the bottleneck is 4 layers; [0,3) [3,7) [7,10) is as good
  // as the even split, so a rebalancer that holds it must not move anything.
  const BalanceProblem problem = CostsOnly(std::vector<double>(10, 1.0), 3);
  const Placement current = {{0, 3}, {3, 7}, {7, 10}};
  const absl::StatusOr<Placement> placement = PartitionBalance(problem, &current);
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(*placement, current) << FormatPlacement(*placement);

  // One layer too many on the last stage: exactly one layer moves.
  const Placement worse = {{0, 3}, {3, 5}, {5, 10}};
  const absl::StatusOr<Placement> fixed = PartitionBalance(problem, &worse);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(Bottleneck(problem, *fixed), 4);
  EXPECT_EQ(LayersMoved(worse, *fixed), 1) << FormatPlacement(*fixed);
}

TEST(PartitionTest, HeavyLayerEndsAloneOnItsStage) {
  std::vector<double> costs(12, 1.0);
  costs[5] = 20;
  const absl::StatusOr<Placement> placement = PartitionBalance(CostsOnly(costs, 4));
  ASSERT_TRUE(placement.ok()) << placement.status();
  int owner = -1;
  for (int s = 0; s < 4; ++s) {
    if ((*placement)[s].begin <= 5 && 5 < (*placement)[s].end) owner = s;
  }
  ASSERT_GE(owner, 0);
  EXPECT_EQ((*placement)[owner], (StageRange{5, 6})) << FormatPlacement(*placement);
  EXPECT_EQ(Bottleneck(CostsOnly(costs, 4), *placement), 20);
}

TEST(PartitionTest, PinnedCostsShiftLayersAway) {
  // Embedding worth 3 layers on stage 0, head worth 1 on stage 1: 3 + 10 + 1 = 2 · 7.
  BalanceProblem problem = CostsOnly(std::vector<double>(10, 1.0), 2);
  problem.first_stage_cost = 3;
  problem.last_stage_cost = 1;
  const absl::StatusOr<Placement> placement = PartitionBalance(problem);
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(*placement, (Placement{{0, 4}, {4, 10}})) << FormatPlacement(*placement);
  EXPECT_EQ(Bottleneck(problem, *placement), 7);
}

TEST(PartitionTest, MemoryBudgetOverridesCost) {
  // Cost alone would give [0,2) [2,4), but stage 0 holds 3 micro-batches in flight and
  // its budget allows only one layer's activations.
  BalanceProblem problem = CostsOnly({1, 1, 1, 1}, 2);
  problem.layer_activation_bytes = {10, 10, 10, 10};
  problem.activation_multiplier = {3, 1};
  problem.memory_budget = 30;
  const absl::StatusOr<Placement> placement = PartitionBalance(problem);
  ASSERT_TRUE(placement.ok()) << placement.status();
  EXPECT_EQ(*placement, (Placement{{0, 1}, {1, 4}})) << FormatPlacement(*placement);

  problem.memory_budget = 29;
  const absl::StatusOr<Placement> none = PartitionBalance(problem);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(none.status().message(), HasSubstr("memory budget of 29 bytes"));
  EXPECT_THAT(none.status().message(), HasSubstr("smallest achievable largest stage memory is 30"));
}

TEST(PartitionTest, MatchesBruteForceOnRandomProblems) {
  std::mt19937_64 rng(kSeed + 1);
  int optimal = 0, infeasible = 0, with_current = 0, ties_broken = 0;
  for (const BalanceProblem& problem : RandomProblems(kRandomProblems, kSeed)) {
    const int64_t num_layers = problem.num_layers();
    const int p = problem.num_stages;
    // The reference of the tie-break: none (the even split), a random or the even placement.
    const int kind = static_cast<int>(rng() % 3);
    const Placement random_current = RandomPlacement(num_layers, p, &rng);
    const Placement uniform = UniformPlacement(num_layers, p);
    const Placement* current = kind == 0 ? nullptr : kind == 1 ? &random_current : &uniform;
    const Placement& reference = current != nullptr ? *current : uniform;
    with_current += current != nullptr;

    const std::string where = absl::StrFormat(
        "L=%d p=%d costs=[%s] first=%g last=%g budget=%.17g current=%s", num_layers, p,
        absl::StrJoin(problem.layer_cost, ","), problem.first_stage_cost, problem.last_stage_cost,
        problem.memory_budget, current ? FormatPlacement(*current) : "none");
    const absl::StatusOr<Placement> placement = PartitionBalance(problem, current);

    const std::vector<Placement> all = AllPlacements(num_layers, p);
    const double best = BruteForceBottleneck(problem);
    if (best == kInf) {
      ++infeasible;
      EXPECT_EQ(placement.status().code(), absl::StatusCode::kResourceExhausted) << where;
      EXPECT_THAT(placement.status().message(),
                  HasSubstr(absl::StrFormat("smallest achievable largest stage memory is %.10g",
                                            LeastLargestMemory(problem))))
          << where;
      continue;
    }
    ASSERT_TRUE(placement.ok()) << placement.status() << " " << where;
    ASSERT_TRUE(ValidatePlacement(problem, *placement).ok()) << where;
    EXPECT_TRUE(FitsMemory(problem, *placement)) << where;
    EXPECT_EQ(Bottleneck(problem, *placement), best)
        << where << " got " << FormatPlacement(*placement);
    // The tie-break: the fewest moved layers among the optimal placements, then the
    // lexicographically first (AllPlacements is in that order).
    int64_t fewest = std::numeric_limits<int64_t>::max();
    const Placement* expected = nullptr;
    int optimal_count = 0;
    for (const Placement& candidate : all) {
      if (!FitsMemory(problem, candidate) || Bottleneck(problem, candidate) != best) continue;
      ++optimal_count;
      const int64_t moved = LayersMoved(reference, candidate);
      if (moved < fewest) {
        fewest = moved;
        expected = &candidate;
      }
    }
    ASSERT_NE(expected, nullptr) << where;
    EXPECT_EQ(LayersMoved(reference, *placement), fewest) << where;
    EXPECT_EQ(*placement, *expected) << where << " got " << FormatPlacement(*placement)
                                     << " expected " << FormatPlacement(*expected);
    ++optimal;
    ties_broken += optimal_count > 1;
  }
  EXPECT_GE(optimal, 1000);
  EXPECT_GE(infeasible, 50);
  EXPECT_GE(ties_broken, 200);
  std::printf(
      "[ partition ] %d random problems: %d optimal placements equal brute force (%d with "
      "several optimal placements to choose from, %d with a current placement), %d "
      "infeasible (ResourceExhausted)\n",
      kRandomProblems, optimal, ties_broken, with_current, infeasible);
}

}  // namespace
}  // namespace fulcrum::dynamic
