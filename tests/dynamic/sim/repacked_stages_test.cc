// fulcrum_sim --repack's column: the stages re-packing keeps in each simulated iteration are
// DecideRepack's decision (fulcrum_train --repack=auto's) on that iteration's placement and
// costs, and they do fall when layers become nearly free (a frozen prefix).
#include <string>
#include <vector>

#include "dynamic/repack.h"
#include "dynamic/simulation.h"
#include "gtest/gtest.h"
#include "tests/dynamic/sim/sim_scenarios.h"

namespace fulcrum::dynamic {
namespace {

// 8 equal layers on 4 stages, 8 micro-batches; from iteration 4 layers 0-5 are frozen:
// forward only, at 0.3 of a layer's forward, no B or W. ZB-H1, and ZB-V (8 virtual stages
// of one layer; NOTE [re-packing under chunks] in dynamic/repack.h).
class RepackedStagesTest : public ::testing::TestWithParam<const char*> {};

TEST_P(RepackedStagesTest, AreTheLiveDecisionOnEachIterationsPlacementAndCosts) {
  const std::string schedule = GetParam();
  Scenario s = FixedCostScenario(std::vector<double>(8, 1.0), 4, 8, schedule, 6,
                                 schedule == "zbv" ? 2 : 1);
  s.costs = [](int64_t iteration) {
    IterationCosts c = UniformKindCosts(std::vector<double>(8, 1.0), 1e6);
    if (iteration >= 4) {
      for (int l = 0; l < 6; ++l) {
        c.forward[l] = 0.3;
        c.backward[l] = c.weight[l] = 0;
      }
    }
    return c;
  };
  const absl::StatusOr<SimulatedRun> run = SimulateRun(s, kUniform, {});
  ASSERT_TRUE(run.ok()) << run.status();
  RepackOptions options;
  options.max_slowdown = 0.05;
  const absl::StatusOr<std::vector<int>> stages = RepackedStages(s, *run, options);
  ASSERT_TRUE(stages.ok()) << stages.status();
  ASSERT_EQ(stages->size(), run->iterations.size());
  for (size_t i = 0; i < stages->size(); ++i) {
    const SimulatedIteration& it = run->iterations[i];
    const absl::StatusOr<RepackPlan> plan =
        DecideRepack(RepackProblemOf(s, s.costs(it.iteration)), it.placement, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ((*stages)[i], RanksOf(static_cast<int>(plan->placement.size()),
                                    ChunksPerRank(schedule, s.num_chunks)))
        << "iteration " << it.iteration;
  }
  // Dense: every stage equally busy, and merging two doubles a stage's work — none packs.
  EXPECT_EQ((*stages)[0], 4);
  EXPECT_EQ((*stages)[2], 4);
  // Frozen front: the first stages' work nearly vanishes, so they merge.
  EXPECT_LT((*stages)[3], 4);
  EXPECT_EQ((*stages)[5], (*stages)[3]);
}

INSTANTIATE_TEST_SUITE_P(Schedules, RepackedStagesTest, ::testing::Values("zbh1", "zbv"));

}  // namespace
}  // namespace fulcrum::dynamic
