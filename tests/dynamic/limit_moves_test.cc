// Tests of LimitMoves (dynamic/limit_moves.h): closed-form walks, and on random problems
// that every capped result is valid, within the cap, between the current placement and the
// target boundary by boundary, the target itself when the cap allows, and within memory.
#include "dynamic/limit_moves.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "dynamic/balance_problem.h"
#include "dynamic/partition.h"
#include "gtest/gtest.h"
#include "tests/dynamic/balance_test_util.h"

namespace fulcrum::dynamic {
namespace {

using namespace balance_testing;  // NOLINT: the shared test helpers.

BalanceProblem Costs(std::vector<double> costs, int num_stages) {
  BalanceProblem problem;
  problem.num_stages = num_stages;
  problem.layer_cost = std::move(costs);
  return problem;
}

TEST(LimitMovesTest, NoCapOrEnoughMovesGiveTheTarget) {
  const BalanceProblem problem = Costs({1, 1, 1, 1, 1, 1}, 2);
  const Placement current = {{0, 1}, {1, 6}};
  const Placement target = {{0, 3}, {3, 6}};  // Two layers move.
  EXPECT_EQ(LimitMoves(problem, current, target, 0), target);
  EXPECT_EQ(LimitMoves(problem, current, target, -1), target);
  EXPECT_EQ(LimitMoves(problem, current, target, 2), target);
  EXPECT_EQ(LimitMoves(problem, current, target, 5), target);
  EXPECT_EQ(LimitMoves(problem, current, target, 1), (Placement{{0, 2}, {2, 6}}));
}

TEST(LimitMovesTest, TakesTheShiftWithTheSmallestBottleneck) {
  // Stage 0 gives one layer to stage 1 and stage 1 one to stage 2: of the two shifts, the
  // one from the heaviest stage (0: 4 → 3) leaves the smaller bottleneck.
  const BalanceProblem problem = Costs({1, 1, 1, 1, 1, 1}, 3);
  const Placement current = {{0, 4}, {4, 5}, {5, 6}};
  const Placement target = {{0, 2}, {2, 4}, {4, 6}};
  // Boundary 2 (5 → 4) would empty stage 1 first; boundary 1 moves: loads 3, 2, 1.
  EXPECT_EQ(LimitMoves(problem, current, target, 1), (Placement{{0, 3}, {3, 5}, {5, 6}}));
  // Then both shifts give bottleneck 3 (loads 2,3,1 or 3,1,2): the lower boundary wins.
  EXPECT_EQ(LimitMoves(problem, current, target, 2), (Placement{{0, 2}, {2, 5}, {5, 6}}));
}

TEST(LimitMovesTest, ProgressesEvenWhenAStepIsWorse) {
  // The target is worse than the current placement; capped, the walk still heads there.
  const BalanceProblem problem = Costs({1, 1, 1, 1, 1, 1}, 2);
  const Placement current = {{0, 3}, {3, 6}};
  const Placement target = {{0, 5}, {5, 6}};
  const Placement limited = LimitMoves(problem, current, target, 1);
  EXPECT_EQ(limited, (Placement{{0, 4}, {4, 6}}));
  EXPECT_GT(Bottleneck(problem, limited), Bottleneck(problem, current));
}

// Each boundary of `placement` lies between its positions in `current` and `target`.
bool Between(const Placement& current, const Placement& placement, const Placement& target) {
  for (size_t s = 0; s + 1 < placement.size(); ++s) {
    const int64_t lo = std::min(current[s].end, target[s].end);
    const int64_t hi = std::max(current[s].end, target[s].end);
    if (placement[s].end < lo || placement[s].end > hi) return false;
  }
  return true;
}

TEST(LimitMovesTest, RandomProblemsKeepEveryPromise) {
  std::mt19937_64 rng(7);
  int capped_walks = 0;
  for (const BalanceProblem& problem : RandomProblems(600, 424242)) {
    const int64_t num_layers = problem.num_layers();
    const int p = problem.num_stages;
    const Placement current = RandomPlacement(num_layers, p, &rng);
    // Targets: a balancer's (when one fits memory) and a random one.
    std::vector<Placement> targets = {RandomPlacement(num_layers, p, &rng)};
    if (absl::StatusOr<Placement> balanced = PartitionBalance(problem, &current); balanced.ok()) {
      targets.push_back(*balanced);
    }
    for (const Placement& target : targets) {
      const int64_t needed = LayersMoved(current, target);
      const bool target_fits = FitsMemory(problem, target);
      for (int64_t cap = 1; cap <= needed + 1; ++cap) {
        const Placement limited = LimitMoves(problem, current, target, cap);
        SCOPED_TRACE(testing::Message() << "current " << FormatPlacement(current) << " target "
                                        << FormatPlacement(target) << " cap " << cap << " gave "
                                        << FormatPlacement(limited));
        ASSERT_TRUE(ValidatePlacement(problem, limited).ok());
        EXPECT_LE(LayersMoved(current, limited), cap);
        EXPECT_TRUE(Between(current, limited, target));
        if (cap >= needed) {
          EXPECT_EQ(limited, target);
        }
        if (target_fits) {
          EXPECT_TRUE(FitsMemory(problem, limited) || limited == current);
        }
        if (cap < needed) ++capped_walks;
      }
    }
  }
  EXPECT_GT(capped_walks, 500);  // The cap was exercised, not just the short cut.
}

TEST(LimitMovesTest, WithoutAMemoryBudgetACappedWalkUsesItsMoves) {
  // Unconstrained, the walk stops only at the cap: exactly `cap` layers move.
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int p = 1 + static_cast<int>(rng() % 5);
    const int64_t num_layers = p + static_cast<int64_t>(rng() % 10);
    BalanceProblem problem = Costs(std::vector<double>(num_layers, 1.0), p);
    for (double& c : problem.layer_cost) c = 1 + static_cast<double>(rng() % 7);
    const Placement current = RandomPlacement(num_layers, p, &rng);
    const Placement target = RandomPlacement(num_layers, p, &rng);
    const int64_t needed = LayersMoved(current, target);
    for (int64_t cap = 1; cap < needed; ++cap) {
      EXPECT_EQ(LayersMoved(current, LimitMoves(problem, current, target, cap)), cap);
    }
  }
}

}  // namespace
}  // namespace fulcrum::dynamic
