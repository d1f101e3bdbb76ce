// Tests of the load model (dynamic/load_model.h): per-layer and pinned costs from synthetic
// stage loads whose right answers are computed by hand, the median window, a layer's
// history following it across stages, parameter mode, the memory fields, bad input.
#include "dynamic/load_model.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/dynamic/load_test_util.h"

namespace fulcrum::dynamic {
namespace {

using balance_testing::MakeLoads;
using balance_testing::SyntheticTimes;
using balance_testing::UnmeasuredLoads;
using pipeline::StageLoad;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const Placement kTwoByTwo = {{0, 2}, {2, 4}};
const Placement kThreeAndOne = {{0, 3}, {3, 4}};

BalanceProblem ProblemOf(const LoadModel& model, const std::vector<StageLoad>& loads,
                         const Placement* measured_on = nullptr) {
  absl::StatusOr<BalanceProblem> problem = model.Problem(loads, measured_on);
  EXPECT_TRUE(problem.ok()) << problem.status();
  return problem.ok() ? *problem : BalanceProblem{};
}

// One stage holding one layer of `ms`; nothing pinned.
std::vector<StageLoad> OneLayer(double ms) {
  return MakeLoads({{0, 1}}, SyntheticTimes{{ms}, 0, 0});
}

TEST(LoadModelTest, LayerCostIsForwardPlusBackwardPlusWeight) {
  LoadModel model;
  ASSERT_TRUE(model.Observe(MakeLoads(kTwoByTwo, SyntheticTimes{{4, 8, 12, 16}, 2, 6})).ok());
  ASSERT_TRUE(model.ready());
  const BalanceProblem problem =
      ProblemOf(model, MakeLoads(kTwoByTwo, SyntheticTimes{{4, 8, 12, 16}, 2, 6}));
  EXPECT_EQ(problem.num_stages, 2);
  EXPECT_THAT(problem.layer_cost, ElementsAre(4, 8, 12, 16));
  // Stage 0 ran 14 ms of actions, 12 of them in its layers; stage 1 34, 28 in layers.
  EXPECT_EQ(problem.first_stage_cost, 2);
  EXPECT_EQ(problem.last_stage_cost, 6);
  EXPECT_TRUE(std::isinf(problem.memory_budget));
}

TEST(LoadModelTest, DistinctForwardBackwardWeightOnOneStage) {
  StageLoad load;
  load.layer_end = 2;
  load.layer_forward_ms = {1, 2};
  load.layer_backward_ms = {3, 4};  // A fused BW (1F1B) counts here, with W zero.
  load.layer_weight_ms = {0.5, 0};
  load.forward_ms = 10;
  load.backward_ms = 7;
  load.weight_ms = 0.5;
  LoadModel model;
  ASSERT_TRUE(model.Observe({load}).ok());
  const BalanceProblem problem = ProblemOf(model, {load});
  EXPECT_THAT(problem.layer_cost, ElementsAre(4.5, 6));
  // One stage: its residual 17.5 - 10.5 is counted once, as the first stage's.
  EXPECT_EQ(problem.first_stage_cost, 7);
  EXPECT_EQ(problem.last_stage_cost, 0);
  EXPECT_EQ(StageCosts(problem, {{0, 2}}), std::vector<double>{17.5});
}

TEST(LoadModelTest, MedianOfTheWindowIgnoresAnOutlier) {
  LoadModel model;  // Window 3.
  for (double ms : {10.0, 100.0, 11.0}) ASSERT_TRUE(model.Observe(OneLayer(ms)).ok());
  EXPECT_EQ(ProblemOf(model, OneLayer(0)).layer_cost, std::vector<double>{11});
  ASSERT_TRUE(model.Observe(OneLayer(12)).ok());  // 10 leaves: median of 100, 11, 12.
  EXPECT_EQ(ProblemOf(model, OneLayer(0)).layer_cost, std::vector<double>{12});
  ASSERT_TRUE(model.Observe(OneLayer(13)).ok());  // 11, 12, 13.
  EXPECT_EQ(ProblemOf(model, OneLayer(0)).layer_cost, std::vector<double>{12});
  EXPECT_EQ(model.observations(), 5);

  LoadModel pair(LoadModelOptions{BalanceBy::kTime, /*window=*/2});
  ASSERT_TRUE(pair.Observe(OneLayer(10)).ok());
  EXPECT_EQ(ProblemOf(pair, OneLayer(0)).layer_cost, std::vector<double>{10});
  ASSERT_TRUE(pair.Observe(OneLayer(100)).ok());  // Even count: the mean of the middle two.
  EXPECT_EQ(ProblemOf(pair, OneLayer(0)).layer_cost, std::vector<double>{55});

  LoadModel raw(LoadModelOptions{BalanceBy::kTime, /*window=*/1});
  for (double ms : {10.0, 100.0}) ASSERT_TRUE(raw.Observe(OneLayer(ms)).ok());
  EXPECT_EQ(ProblemOf(raw, OneLayer(0)).layer_cost, std::vector<double>{100});
}

TEST(LoadModelTest, PinnedTimesAreSmoothedToo) {
  LoadModel model;
  for (double first : {5.0, 50.0, 6.0}) {
    ASSERT_TRUE(model.Observe(MakeLoads(kTwoByTwo, SyntheticTimes{{1, 1, 1, 1}, first, 7})).ok());
  }
  const BalanceProblem problem = ProblemOf(model, UnmeasuredLoads(kTwoByTwo));
  EXPECT_EQ(problem.first_stage_cost, 6);
  EXPECT_EQ(problem.last_stage_cost, 7);
}

TEST(LoadModelTest, FirstIterationIsNotAMeasurement) {
  LoadModel model;
  ASSERT_TRUE(model.Observe(UnmeasuredLoads(kTwoByTwo)).ok());
  EXPECT_FALSE(model.ready());
  EXPECT_EQ(model.observations(), 0);
  absl::StatusOr<BalanceProblem> problem = model.Problem(UnmeasuredLoads(kTwoByTwo));
  EXPECT_EQ(problem.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(problem.status().message(), HasSubstr("no time measurement"));
}

TEST(LoadModelTest, HistoryFollowsALayerThatMoved) {
  LoadModel model;
  // Layer 2 runs on stage 1, then (after a move) on stage 0; its history is its own.
  ASSERT_TRUE(model.Observe(MakeLoads(kTwoByTwo, SyntheticTimes{{10, 10, 30, 10}})).ok());
  ASSERT_TRUE(model.Observe(MakeLoads(kThreeAndOne, SyntheticTimes{{10, 10, 90, 10}})).ok());
  ASSERT_TRUE(model.Observe(MakeLoads(kThreeAndOne, SyntheticTimes{{10, 10, 31, 10}})).ok());
  EXPECT_THAT(ProblemOf(model, UnmeasuredLoads(kThreeAndOne)).layer_cost,
              ElementsAre(10, 10, 31, 10));
}

TEST(LoadModelTest, PinnedTimeAfterAMoveUsesThePlacementItRanOn) {
  // Layer 2 moved from stage 1 to stage 0 at the end of the measured iteration: the loads
  // carry the new ranges and the totals of the old ones.
  const SyntheticTimes times{{10, 10, 10, 10}, 5, 7};
  const std::vector<StageLoad> loads = MakeLoads(kThreeAndOne, kTwoByTwo, times);

  LoadModel informed;
  ASSERT_TRUE(informed.Observe(loads, &kTwoByTwo).ok());
  const BalanceProblem right = ProblemOf(informed, loads, &kTwoByTwo);
  EXPECT_EQ(right.first_stage_cost, 5);
  EXPECT_EQ(right.last_stage_cost, 7);

  // Without it the moved layer's 10 ms land in stage 1's pinned time, and stage 0's
  // residual (25 - 30) is clamped to 0.
  LoadModel naive;
  ASSERT_TRUE(naive.Observe(loads).ok());
  const BalanceProblem wrong = ProblemOf(naive, loads);
  EXPECT_EQ(wrong.first_stage_cost, 0);
  EXPECT_EQ(wrong.last_stage_cost, 17);
}

TEST(LoadModelTest, MiddleStagesPinNothingAndNegativeResidualsCountAsZero) {
  const Placement three = {{0, 1}, {1, 2}, {2, 3}};
  std::vector<StageLoad> loads = MakeLoads(three, SyntheticTimes{{1, 2, 3}, 4, 5});
  loads[1].forward_ms += 100;  // Transfers on a middle stage: no unit's, not pinned.
  LoadModel model;
  ASSERT_TRUE(model.Observe(loads).ok());
  BalanceProblem problem = ProblemOf(model, loads);
  EXPECT_THAT(problem.layer_cost, ElementsAre(1, 2, 3));
  EXPECT_EQ(problem.first_stage_cost, 4);
  EXPECT_EQ(problem.last_stage_cost, 5);

  loads[0].forward_ms -= 4.125;  // Timer granularity: the layers' sum exceeds the stage's.
  LoadModel clamped(LoadModelOptions{BalanceBy::kTime, 1});
  ASSERT_TRUE(clamped.Observe(loads).ok());
  EXPECT_EQ(ProblemOf(clamped, loads).first_stage_cost, 0);
}

std::vector<StageLoad> WithParameters(std::vector<StageLoad> loads) {
  loads[0].layer_parameters = {100, 200};
  loads[1].layer_parameters = {300, 400};
  loads[0].pinned_parameters = 1000;
  loads[1].pinned_parameters = 2000;
  return loads;
}

TEST(LoadModelTest, ParamsModeIsReadyAtOnceAndUsesTheLatestCounts) {
  LoadModel model(LoadModelOptions{BalanceBy::kParams});
  EXPECT_TRUE(model.ready());
  const std::vector<StageLoad> loads = WithParameters(UnmeasuredLoads(kTwoByTwo));
  const BalanceProblem problem = ProblemOf(model, loads);
  EXPECT_THAT(problem.layer_cost, ElementsAre(100, 200, 300, 400));
  EXPECT_EQ(problem.first_stage_cost, 1000);
  EXPECT_EQ(problem.last_stage_cost, 2000);

  // One stage: its pinned parameters count once.
  StageLoad one;
  one.layer_end = 2;
  one.layer_parameters = {5, 6};
  one.pinned_parameters = 70;
  const BalanceProblem single = ProblemOf(model, {one});
  EXPECT_EQ(single.first_stage_cost, 70);
  EXPECT_EQ(single.last_stage_cost, 0);

  // Counts missing for a stage: an error naming the flag.
  std::vector<StageLoad> missing = loads;
  missing[1].layer_parameters.clear();
  absl::StatusOr<BalanceProblem> bad = model.Problem(missing);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--balance_by=params"));
}

TEST(LoadModelTest, MemoryFields) {
  std::vector<StageLoad> loads = UnmeasuredLoads(kTwoByTwo);
  loads[0].layer_state_bytes = {100, 200};
  loads[1].layer_state_bytes = {300, 400};
  loads[0].parameter_bytes = 400;  // State 1100: 300 in layers, 800 pinned (embedding).
  loads[0].gradient_bytes = 200;
  loads[0].optimizer_bytes = 500;
  loads[1].parameter_bytes = 750;  // State 750: 700 in layers, 50 pinned (final norm, head).
  loads[0].layer_activation_bytes = {10, 20};
  loads[1].layer_activation_bytes = {30, 40};
  loads[0].peak_in_flight = 2;
  loads[1].peak_in_flight = 0;                  // Counts as 1.
  loads[0].peak_activation_bytes = 2 * 30 + 7;  // 7 bytes beyond its layers' (embedding out).
  loads[1].peak_activation_bytes = 50;          // Below its layers' 70: nothing pinned.
  LoadModelOptions options;
  options.by = BalanceBy::kParams;
  options.memory_budget_bytes = 5000;
  LoadModel model(options);
  loads[0].layer_parameters = {1, 1};
  loads[1].layer_parameters = {1, 1};
  const BalanceProblem problem = ProblemOf(model, loads);
  EXPECT_THAT(problem.layer_state_bytes, ElementsAre(100, 200, 300, 400));
  EXPECT_THAT(problem.layer_activation_bytes, ElementsAre(10, 20, 30, 40));
  EXPECT_THAT(problem.activation_multiplier, ElementsAre(2, 1));
  EXPECT_THAT(problem.pinned_memory, ElementsAre(800 + 7, 50));
  EXPECT_EQ(problem.memory_budget, 5000);
  // The formula at BalanceProblem gives back what the stages hold: state plus peak.
  EXPECT_EQ(StageMemory(problem, 0, kTwoByTwo[0]), 1100 + 67);
}

TEST(LoadModelTest, ActivationResidualAfterAMoveUsesThePlacementItRanOn) {
  std::vector<StageLoad> loads = MakeLoads(kThreeAndOne, kTwoByTwo, SyntheticTimes{{1, 1, 1, 1}});
  loads[0].layer_activation_bytes = {10, 10, 10};
  loads[1].layer_activation_bytes = {10};
  loads[0].peak_activation_bytes = 25;  // Ran layers 0 and 1: 20, plus 5 of its own.
  loads[1].peak_activation_bytes = 30;  // Ran layers 2 and 3: 20, plus 10.
  LoadModel model;
  ASSERT_TRUE(model.Observe(loads, &kTwoByTwo).ok());
  EXPECT_THAT(ProblemOf(model, loads, &kTwoByTwo).pinned_memory, ElementsAre(5, 10));
  EXPECT_THAT(ProblemOf(model, loads).pinned_memory, ElementsAre(0, 20));
}

TEST(LoadModelTest, ResetAndShapeChangesForgetTheHistory) {
  LoadModel model;
  ASSERT_TRUE(model.Observe(MakeLoads(kTwoByTwo, SyntheticTimes{{1, 2, 3, 4}})).ok());
  model.Reset();
  EXPECT_FALSE(model.ready());
  ASSERT_TRUE(model.Observe(MakeLoads(kTwoByTwo, SyntheticTimes{{5, 6, 7, 8}})).ok());
  EXPECT_THAT(ProblemOf(model, UnmeasuredLoads(kTwoByTwo)).layer_cost, ElementsAre(5, 6, 7, 8));

  // Six layers now: a different model; the old four layers' times do not carry over.
  const Placement six = {{0, 3}, {3, 6}};
  ASSERT_TRUE(model.Observe(MakeLoads(six, SyntheticTimes{{1, 1, 1, 1, 1, 1}})).ok());
  EXPECT_EQ(model.observations(), 1);
  EXPECT_THAT(ProblemOf(model, UnmeasuredLoads(six)).layer_cost, ElementsAre(1, 1, 1, 1, 1, 1));
  absl::StatusOr<BalanceProblem> stale = model.Problem(UnmeasuredLoads(kTwoByTwo));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LoadModelTest, BadInputIsAnErrorNotACrash) {
  const std::vector<StageLoad> good = MakeLoads(kTwoByTwo, SyntheticTimes{{1, 2, 3, 4}});
  auto expect_invalid = [](const std::vector<StageLoad>& loads, const char* says) {
    LoadModel model;
    const absl::Status status = model.Observe(loads);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << says;
    EXPECT_THAT(status.message(), HasSubstr(says));
    EXPECT_EQ(model.observations(), 0);
    EXPECT_EQ(model.Problem(loads).status().code(), absl::StatusCode::kInvalidArgument);
  };
  expect_invalid({}, "no stage loads");
  std::vector<StageLoad> bad = good;
  bad[1].stage = 0;
  expect_invalid(bad, "says it is stage 0");
  bad = good;
  bad[1].layer_begin = 3;  // A gap.
  expect_invalid(bad, "not a placement");
  bad = good;
  bad[0].layer_end = bad[0].layer_begin;  // Empty stage 0.
  expect_invalid(bad, "not a placement");
  bad = good;
  bad[1].layer_backward_ms.pop_back();
  expect_invalid(bad, "stage 1's load has 1 layer_backward_ms");
  bad = good;
  bad[0].layer_forward_ms[1] = -1;
  expect_invalid(bad, "layer_forward_ms[1] = -1");
  bad = good;
  bad[0].weight_ms = std::numeric_limits<double>::quiet_NaN();
  expect_invalid(bad, "weight_ms = nan");
  bad = good;
  bad[1].layer_state_bytes = {1, 2, 3};
  expect_invalid(bad, "layer_state_bytes");
  bad = good;
  bad[1].peak_activation_bytes = -5;
  expect_invalid(bad, "peak_activation_bytes");

  LoadModel model;
  const Placement three = {{0, 1}, {1, 2}, {2, 4}};
  EXPECT_THAT(model.Observe(good, &three).message(), HasSubstr("measured on is invalid"));
}

TEST(LoadModelTest, OptionsAndNames) {
  BalanceBy by = BalanceBy::kTime;
  ASSERT_TRUE(ParseBalanceBy("params", &by).ok());
  EXPECT_EQ(by, BalanceBy::kParams);
  EXPECT_STREQ(BalanceByName(by), "params");
  EXPECT_STREQ(BalanceUnit(by), "params");
  ASSERT_TRUE(ParseBalanceBy("time", &by).ok());
  EXPECT_STREQ(BalanceByName(by), "time");
  EXPECT_STREQ(BalanceUnit(by), "ms");
  const absl::Status unknown = ParseBalanceBy("flops", &by);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.message(), HasSubstr("--balance_by='flops'"));

  EXPECT_TRUE(LoadModelOptions{}.Validate().ok());
  LoadModelOptions options;
  options.window = 0;
  EXPECT_THAT(options.Validate().message(), HasSubstr("--rebalance_window=0"));
  options = {};
  options.memory_budget_bytes = 0;
  EXPECT_THAT(options.Validate().message(), HasSubstr("--rebalance_memory_budget_mb"));
}

TEST(LoadModelTest, RangesAndPlacementsConvert) {
  const pipeline::LayerRanges ranges = {{0, 3}, {3, 8}};
  const Placement placement = ToPlacement(ranges);
  EXPECT_EQ(placement, (Placement{{0, 3}, {3, 8}}));
  EXPECT_EQ(ToLayerRanges(placement), ranges);
  EXPECT_EQ(PlacementOf(UnmeasuredLoads(placement)), placement);
}

}  // namespace
}  // namespace fulcrum::dynamic
