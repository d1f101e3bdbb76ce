// Tests of the scale simulator's core (dynamic/simulation.h): hand-computed timelines of a
// scenario, the 1F1B and ZB-H1 bubble formulas through it, the iteration in which a balancer's
// moves take effect and what they cost, and that a balanced run is never slower than its
// static baseline.
#include "dynamic/simulation.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/dynamic/sim/sim_scenarios.h"

namespace fulcrum::dynamic {
namespace {

Scenario Fixed(const std::vector<double>& scale, int p, int m, const std::string& schedule,
               int64_t iterations) {
  return FixedCostScenario(scale, p, m, schedule, iterations);
}

TEST(SimulateRunTest, HandComputedTimeline) {
  // p=2, m=2, 1F1B, layers (1, 1, 2, 2): stage 0 F=2 BW=4, stage 1 F=4 BW=8 (B+W).
  // Stage 0: F0 [0,2] F1 [2,4]; stage 1: F0 [2,6] BW0 [6,14] F1 [14,18] BW1 [18,26];
  // stage 0: BW0 [14,18] BW1 [26,30]. Makespan 30; busy 12 and 24.
  Scenario s = Fixed({1, 1, 2, 2}, 2, 2, "1f1b", 1);
  absl::StatusOr<SimulatedRun> run = SimulateRun(s, kUniform, BalancerOptions{});
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->iterations.size(), 1u);
  const SimulatedIteration& it = run->iterations[0];
  EXPECT_EQ(it.placement, (Placement{{0, 2}, {2, 4}}));
  EXPECT_DOUBLE_EQ(it.makespan_ms, 30);
  EXPECT_DOUBLE_EQ(it.stage_busy_ms[0], 12);
  EXPECT_DOUBLE_EQ(it.stage_busy_ms[1], 24);
  EXPECT_DOUBLE_EQ(it.bubble_ratio, ((30 - 12) / 30.0 + (30 - 24) / 30.0) / 2);
  EXPECT_EQ(it.layers_moved, 0);
}

TEST(SimulateRunTest, BubbleFormulasOfEqualStages) {
  // Equal layers, one per stage, F = B = W = 1: 1F1B bubble (p-1)(F+B+W) of a makespan
  // (m+p-1)(F+B+W); ZB-H1 (p-1)(F+B-W) = p-1 of a makespan 3m + p - 1.
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p, 3 * p + 1}) {
      const std::vector<double> ones(p, 1.0);
      absl::StatusOr<SimulatedRun> f = SimulateRun(Fixed(ones, p, m, "1f1b", 1), kUniform, {});
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_NEAR(f->iterations[0].bubble_ratio, (p - 1.0) / (m + p - 1.0), 1e-12) << p << " " << m;
      EXPECT_NEAR(f->iterations[0].makespan_ms, 3.0 * (m + p - 1), 1e-9);
      absl::StatusOr<SimulatedRun> z = SimulateRun(Fixed(ones, p, m, "zbh1", 1), kUniform, {});
      ASSERT_TRUE(z.ok()) << z.status();
      EXPECT_NEAR(z->iterations[0].makespan_ms, 3.0 * m + (p - 1), 1e-9) << p << " " << m;
      EXPECT_NEAR(z->iterations[0].bubble_ratio, (p - 1.0) / (3.0 * m + p - 1), 1e-12);
    }
  }
}

// A memory budget no placement fits ends the simulated run as it ends a training run
// (RebalanceDecision::error), naming the flag.
TEST(SimulateRunTest, AMemoryBudgetNoPlacementFitsEndsTheRun) {
  Scenario s = Fixed({3, 1, 1, 1}, 2, 4, "zbh1", 4);
  BalancerOptions options;
  options.load.memory_budget_bytes = 1;
  absl::StatusOr<SimulatedRun> run = SimulateRun(s, kPartition, options);
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument) << run.status();
  EXPECT_NE(run.status().message().find("--rebalance_memory_budget_mb="), std::string::npos)
      << run.status();
}

TEST(SimulateRunTest, PartitionMovesAfterProfilingAndMigrationIsCounted) {
  // Layers (3, 1, 1, 1) on 2 stages: uniform [0,2) [2,4) has loads 4:2; the optimum is
  // [0,1) [1,4) with 3:3. Plan(2) decides on iteration 1's times (NOTE [rebalance events]),
  // layer 1 moves in iteration 2's tail, iteration 3 runs balanced.
  Scenario s = Fixed({3, 1, 1, 1}, 2, 4, "zbh1", 4);
  s.network.migration_bandwidth_gbps = 1;  // 1e6 bytes: 1 ms + 10 µs.
  absl::StatusOr<SimulatedRun> run = SimulateRun(s, kPartition, BalancerOptions{});
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->iterations.size(), 4u);
  EXPECT_EQ(run->iterations[0].layers_moved, 0);
  EXPECT_EQ(run->iterations[1].placement, (Placement{{0, 2}, {2, 4}}));
  EXPECT_EQ(run->iterations[1].layers_moved, 1);
  EXPECT_EQ(run->iterations[1].next_placement, (Placement{{0, 1}, {1, 4}}));
  EXPECT_DOUBLE_EQ(run->iterations[1].bytes_migrated, 1e6);
  EXPECT_NEAR(run->iterations[1].migration_ms, 1.01, 1e-9);
  EXPECT_EQ(run->iterations[2].placement, (Placement{{0, 1}, {1, 4}}));
  EXPECT_EQ(run->iterations[3].layers_moved, 0);
  // Balanced: ZB-H1 with equal stages (F = B = W = 3): 3·(3m + p - 1) = 39.
  EXPECT_NEAR(run->iterations[2].makespan_ms, 39, 1e-9);
  EXPECT_LT(run->iterations[2].makespan_ms, run->iterations[0].makespan_ms);
  EXPECT_NEAR(run->iterations[1].iteration_ms, run->iterations[1].makespan_ms + 1.01, 1e-9);
}

// NOTE [oracle placement]: the oracle runs every iteration on that iteration's own optimum,
// moved for free. Costs alternating between heavy-first (3, 1, 1, 1) and heavy-last
// (1, 1, 1, 3) on 2 stages: the oracle's placements alternate with them ([0,1) [1,4), then
// [0,3) [3,4)), every iteration balanced at 3:3 (ZB-H1, m = 4: 3·(3m + p − 1) = 39), nothing
// counted as moved; Partition by time plans each iteration from the one before, so from its
// first decision on it runs each iteration on the previous one's optimum — the wrong one
// here — and is slower than the oracle.
TEST(SimulateRunTest, OracleRunsEachIterationOnItsOwnOptimum) {
  Scenario s = Fixed({3, 1, 1, 1}, 2, 4, "zbh1", 6);
  s.costs = [](int64_t i) {
    return UniformKindCosts(i % 2 == 1 ? std::vector<double>{3, 1, 1, 1}
                                       : std::vector<double>{1, 1, 1, 3},
                            1e6);
  };
  absl::StatusOr<SimulatedRun> oracle = SimulateRun(s, OracleStrategy(), BalancerOptions{});
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  ASSERT_EQ(oracle->iterations.size(), 6u);
  for (const SimulatedIteration& it : oracle->iterations) {
    const Placement best = it.iteration % 2 == 1 ? Placement{{0, 1}, {1, 4}} : Placement{{0, 3}, {3, 4}};
    EXPECT_EQ(it.placement, best) << "iteration " << it.iteration;
    EXPECT_NEAR(it.makespan_ms, 39, 1e-9) << "iteration " << it.iteration;
    EXPECT_EQ(it.layers_moved, 0);
    EXPECT_EQ(it.migration_ms, 0);
    EXPECT_EQ(it.decision_ms, 0);
  }
  EXPECT_TRUE(OracleStrategy().oracle);
  EXPECT_FALSE(OracleStrategy().is_static());
  absl::StatusOr<SimulatedRun> partition = SimulateRun(s, kPartition, BalancerOptions{});
  ASSERT_TRUE(partition.ok()) << partition.status();
  EXPECT_GT(partition->total_ms, oracle->total_ms + 1.0);
  absl::StatusOr<SimulatedRun> uniform = SimulateRun(s, kUniform, BalancerOptions{});
  ASSERT_TRUE(uniform.ok()) << uniform.status();
  EXPECT_GT(uniform->total_ms, oracle->total_ms + 1.0);
}

TEST(SimulateRunTest, ParamsBaselineBalancesParameters) {
  // Parameters (4, 1, 1, 1, 1) over 2 stages: DeepSpeed's split is [0,1) [1,5).
  Scenario s = Fixed({1, 1, 1, 1, 1}, 2, 2, "1f1b", 1);
  s.costs = [](int64_t) {
    IterationCosts c = UniformKindCosts({1, 1, 1, 1, 1}, 1e6);
    c.parameters = {4, 1, 1, 1, 1};
    return c;
  };
  const Strategy params{"params", "none", BalanceBy::kParams, true};
  absl::StatusOr<SimulatedRun> run = SimulateRun(s, params, {});
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->iterations[0].placement, (Placement{{0, 1}, {1, 5}}));
}

TEST(SimulateRunTest, BalancedNeverSlowerThanStatic) {
  // Random per-layer costs, migration free. The balancers minimise the bottleneck stage, so
  // from the first decision on (iteration 2's tail) no iteration's busiest stage is busier
  // than the static uniform one's. The makespan is not the bottleneck alone — fill and
  // drain depend on the other stages too — and in rare small cases (here p=2, 3 layers,
  // 1F1B: one trial in 40) a lower bottleneck comes with a makespan 0.15% longer; so the
  // run's time is held to "never more than 0.5% slower, and faster or equal in all but a
  // few trials".
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> unit(0.2, 3.0);
  int slower = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int p = 2 + trial % 5;
    const int layers = p + 1 + trial % 7;
    std::vector<double> scale(layers);
    for (double& x : scale) x = unit(rng);
    Scenario s = Fixed(scale, p, 2 * p, trial % 2 ? "1f1b" : "zbh1", 6);
    s.costs = [scale](int64_t) { return UniformKindCosts(scale, 0); };
    absl::StatusOr<SimulatedRun> fixed = SimulateRun(s, kUniform, {});
    ASSERT_TRUE(fixed.ok()) << fixed.status();
    for (const Strategy& balanced : {kPartition, kDiffusion}) {
      absl::StatusOr<SimulatedRun> run = SimulateRun(s, balanced, {});
      ASSERT_TRUE(run.ok()) << run.status();
      EXPECT_LE(run->total_ms, fixed->total_ms * 1.005) << balanced.name << " trial " << trial;
      if (run->total_ms > fixed->total_ms * (1 + 1e-12)) ++slower;
      for (size_t i = 2; i < run->iterations.size(); ++i) {
        const std::vector<double>& mine = run->iterations[i].stage_busy_ms;
        const std::vector<double>& theirs = fixed->iterations[i].stage_busy_ms;
        EXPECT_LE(*std::max_element(mine.begin(), mine.end()),
                  *std::max_element(theirs.begin(), theirs.end()) * (1 + 1e-12))
            << balanced.name << " trial " << trial << " iteration " << i + 1;
      }
    }
  }
  EXPECT_LE(slower, 2);
}

TEST(SimulateRunTest, RejectsBadScenarios) {
  Scenario s = Fixed({1, 1}, 3, 2, "zbh1", 1);  // 2 layers, 3 stages.
  absl::StatusOr<SimulatedRun> run = SimulateRun(s, kUniform, {});
  ASSERT_FALSE(run.ok());
  EXPECT_NE(std::string(run.status().message()).find("pipeline_model_parallel_size=3"),
            std::string::npos)
      << run.status();
  s = Fixed({1, 1}, 2, 2, "nope", 1);
  EXPECT_FALSE(SimulateRun(s, kUniform, {}).ok());
}

}  // namespace
}  // namespace fulcrum::dynamic
