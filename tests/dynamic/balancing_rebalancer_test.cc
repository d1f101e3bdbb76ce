// Tests of the balancing rebalancer (dynamic/balancing_rebalancer.h) driven the way the
// pipeline runner drives it: Plan(i) with the loads iteration i-1 measured, every target
// carried out at the end of iteration i. Hysteresis under seeded noise (equal loads never
// move a layer; a real imbalance moves once and stays), the interval and model-change
// events, parameter mode, the move cap, memory, notes, metrics and determinism.
#include "dynamic/balancing_rebalancer.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "dynamic/balance_problem.h"
#include "dynamic/load_model.h"
#include "dynamic/partition.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/dynamic/load_test_util.h"

namespace fulcrum::dynamic {
namespace {

using balance_testing::MakeLoads;
using balance_testing::SyntheticTimes;
using balance_testing::UnmeasuredLoads;
using pipeline::LayerRanges;
using pipeline::RebalanceDecision;
using pipeline::StageLoad;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A pipeline as the runner sees it: which stage holds which layers now, and what the last
// iteration measured on the placement it ran on.
class FakePipeline {
 public:
  explicit FakePipeline(Placement start) : now_(start), ran_on_(std::move(start)) {}

  // Plan(iteration) with what the previous iteration measured, then iteration `iteration`
  // runs with `times` and the plan's moves happen at its end.
  RebalanceDecision Iterate(pipeline::Rebalancer* rebalancer, int64_t iteration,
                            const SyntheticTimes& times) {
    const std::vector<StageLoad> loads =
        measured_ ? MakeLoads(now_, ran_on_, *measured_) : UnmeasuredLoads(now_);
    RebalanceDecision decision = rebalancer->Plan(iteration, loads);
    ran_on_ = now_;
    if (!decision.target.empty()) {
      EXPECT_TRUE(
          pipeline::ValidateRanges(decision.target, now_.back().end, static_cast<int>(now_.size()))
              .ok());
      now_ = ToPlacement(decision.target);
    }
    measured_ = times;
    return decision;
  }

  const Placement& placement() const { return now_; }

 private:
  Placement now_;
  Placement ran_on_;
  std::optional<SyntheticTimes> measured_;
};

// `base` with every layer time scaled by a factor uniform in [1 - relative, 1 + relative].
SyntheticTimes Noisy(const SyntheticTimes& base, double relative, std::mt19937_64* rng) {
  std::uniform_real_distribution<double> factor(1 - relative, 1 + relative);
  SyntheticTimes out = base;
  for (double& ms : out.layer_ms) ms *= factor(*rng);
  out.first_ms *= factor(*rng);
  out.last_ms *= factor(*rng);
  return out;
}

std::unique_ptr<BalancingRebalancer> Make(BalancerOptions options) {
  absl::StatusOr<std::unique_ptr<BalancingRebalancer>> made =
      BalancingRebalancer::Create(std::move(options));
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? std::move(*made) : nullptr;
}

BalancerOptions Algorithm(const std::string& algorithm) {
  BalancerOptions options;
  options.algorithm = algorithm;
  return options;
}

// Layers 0–3 three times as slow as 4–7: [0,4) [4,8) costs 120 and 40, [0,3) [3,8) 90 and 70.
const SyntheticTimes kFrontHeavy{{30, 30, 30, 30, 10, 10, 10, 10}};
const SyntheticTimes kEqual{{10, 10, 10, 10, 10, 10, 10, 10}};

class BalancingRebalancerTest : public ::testing::TestWithParam<std::string> {};

INSTANTIATE_TEST_SUITE_P(Algorithms, BalancingRebalancerTest,
                         ::testing::Values("partition", "diffusion"),
                         [](const auto& info) { return info.param; });

TEST_P(BalancingRebalancerTest, EqualLoadsPlusNoiseNeverMoveALayer) {
  for (int stages : {2, 4}) {
    auto rebalancer = Make(Algorithm(GetParam()));
    FakePipeline pipeline(UniformPlacement(8, stages));
    std::mt19937_64 rng(1234 + stages);
    int considered = 0;
    for (int64_t i = 1; i <= 1000; ++i) {
      const RebalanceDecision decision =
          pipeline.Iterate(rebalancer.get(), i, Noisy(kEqual, 0.03, &rng));
      ASSERT_THAT(decision.target, IsEmpty()) << "iteration " << i << ": " << decision.note;
      if (!rebalancer->Metrics().empty()) ++considered;
    }
    EXPECT_EQ(considered, 999) << "every Plan from the second on decides (interval 1)";
    EXPECT_EQ(pipeline.placement(), UniformPlacement(8, stages));
  }
}

TEST_P(BalancingRebalancerTest, KnifeEdgeNoiseIsHeldByTheMinimumGain) {
  // With 10 ms pinned on the last stage, [0,4) [4,8) (40, 50) and [0,5) [5,8) (50, 40) tie:
  // noise alone makes one or the other look better. Without hysteresis layers ping-pong.
  const SyntheticTimes knife{{10, 10, 10, 10, 10, 10, 10, 10}, 0, 10};
  for (double min_gain : {0.05, 0.0}) {
    BalancerOptions options = Algorithm(GetParam());
    options.min_gain = min_gain;
    auto rebalancer = Make(options);
    FakePipeline pipeline(UniformPlacement(8, 2));
    std::mt19937_64 rng(99);
    int moves = 0;
    for (int64_t i = 1; i <= 1000; ++i) {
      if (!pipeline.Iterate(rebalancer.get(), i, Noisy(knife, 0.03, &rng)).target.empty()) ++moves;
    }
    std::printf("[ %s ] knife edge, --rebalance_min_gain=%g: %d moves in 1000 iterations\n",
                GetParam().c_str(), min_gain, moves);
    if (min_gain > 0) {
      EXPECT_EQ(moves, 0);
    } else {
      EXPECT_GE(moves, 2) << "the test would not notice missing hysteresis";
    }
  }
}

TEST_P(BalancingRebalancerTest, ARealImbalanceMovesOnceAndStays) {
  auto rebalancer = Make(Algorithm(GetParam()));
  FakePipeline pipeline(UniformPlacement(8, 2));
  std::mt19937_64 rng(5);
  std::vector<int64_t> moved_at;
  for (int64_t i = 1; i <= 1000; ++i) {
    const RebalanceDecision decision =
        pipeline.Iterate(rebalancer.get(), i, Noisy(kFrontHeavy, 0.03, &rng));
    if (!decision.target.empty()) {
      moved_at.push_back(i);
      EXPECT_EQ(decision.target, (LayerRanges{{0, 3}, {3, 8}})) << decision.note;
      EXPECT_THAT(decision.note,
                  HasSubstr(GetParam() + ": [0,4) [4,8) → [0,3) [3,8); bottleneck "));
      EXPECT_THAT(decision.note, HasSubstr(" ms (−2"));
      EXPECT_LT(decision.predicted_after, decision.predicted_before);
      EXPECT_EQ(decision.unit, "ms");
    }
  }
  // Plan(1) has nothing measured; Plan(2) decides from iteration 1 and moves layer 3.
  EXPECT_THAT(moved_at, ElementsAre(2));
  EXPECT_EQ(pipeline.placement(), (Placement{{0, 3}, {3, 8}}));
}

TEST_P(BalancingRebalancerTest, DecidesEveryIntervalAfterTheFirstMeasurement) {
  BalancerOptions options = Algorithm(GetParam());
  options.interval = 5;
  auto rebalancer = Make(options);
  FakePipeline pipeline(UniformPlacement(8, 2));
  std::vector<int64_t> considered;
  for (int64_t i = 1; i <= 20; ++i) {
    const RebalanceDecision decision = pipeline.Iterate(rebalancer.get(), i, kEqual);
    EXPECT_THAT(decision.target, IsEmpty());
    if (!rebalancer->Metrics().empty()) {
      considered.push_back(i);
      EXPECT_THAT(decision.note, HasSubstr("keep [0,4) [4,8): already balanced"));
    } else {
      EXPECT_EQ(decision.note, "") << "iteration " << i;
    }
  }
  // The first measurement decides at once (NOTE [rebalance events]), then every 5th.
  EXPECT_THAT(considered, ElementsAre(2, 5, 10, 15, 20));
}

TEST_P(BalancingRebalancerTest, ModelChangeIgnoresStaleLoadsAndForcesADecision) {
  BalancerOptions options = Algorithm(GetParam());
  options.interval = 100;
  auto rebalancer = Make(options);
  FakePipeline pipeline(UniformPlacement(8, 2));
  for (int64_t i = 1; i <= 9; ++i) {
    EXPECT_THAT(pipeline.Iterate(rebalancer.get(), i, kEqual).target, IsEmpty());
  }
  // Iteration 10 changes the model halfway: what it measures is neither model's.
  const SyntheticTimes garbage{{10, 10, 10, 10, 1000, 1000, 1000, 1000}};
  EXPECT_THAT(pipeline.Iterate(rebalancer.get(), 10, garbage).target, IsEmpty());
  rebalancer->OnModelChanged(10, "pruned to 50%");
  // Plan(11) gets iteration 10's stale loads: ignored. Iteration 11 profiles.
  const RebalanceDecision stale = pipeline.Iterate(rebalancer.get(), 11, kFrontHeavy);
  EXPECT_THAT(stale.target, IsEmpty());
  EXPECT_EQ(stale.note, "");
  EXPECT_THAT(rebalancer->Metrics(), IsEmpty());
  // Plan(12) decides from iteration 11 alone, whatever the interval.
  const RebalanceDecision forced = pipeline.Iterate(rebalancer.get(), 12, kFrontHeavy);
  EXPECT_EQ(forced.target, (LayerRanges{{0, 3}, {3, 8}})) << forced.note;
  EXPECT_EQ(forced.predicted_before, 120);  // Not mixed with the garbage (a median with 1000s).
  EXPECT_EQ(forced.predicted_after, 90);
  EXPECT_THAT(forced.note, HasSubstr("after the model changed in iteration 10 (pruned to 50%)"));
  for (int64_t i = 13; i < 100; ++i) {
    EXPECT_THAT(pipeline.Iterate(rebalancer.get(), i, kFrontHeavy).note, IsEmpty()) << i;
  }
  EXPECT_THAT(pipeline.Iterate(rebalancer.get(), 100, kFrontHeavy).note,
              HasSubstr("keep [0,3) [3,8): already balanced (bottleneck 90 ms)"));
}

TEST_P(BalancingRebalancerTest, AForcedDecisionWaitsForAMeasurement) {
  BalancerOptions options = Algorithm(GetParam());
  options.interval = 100;
  auto rebalancer = Make(options);
  FakePipeline pipeline(UniformPlacement(8, 2));
  for (int64_t i = 1; i <= 5; ++i) pipeline.Iterate(rebalancer.get(), i, kEqual);
  rebalancer->OnModelChanged(5, "");
  pipeline.Iterate(rebalancer.get(), 6, SyntheticTimes{std::vector<double>(8, 0.0)});
  EXPECT_THAT(pipeline.Iterate(rebalancer.get(), 7, kFrontHeavy).note, IsEmpty());  // All zeros.
  const RebalanceDecision forced = pipeline.Iterate(rebalancer.get(), 8, kFrontHeavy);
  EXPECT_EQ(forced.target, (LayerRanges{{0, 3}, {3, 8}})) << forced.note;
  EXPECT_THAT(forced.note, HasSubstr("after the model changed in iteration 5"));
}

TEST_P(BalancingRebalancerTest, MaxMovesCapsEachDecision) {
  BalancerOptions options = Algorithm(GetParam());
  options.max_moves = 1;
  auto rebalancer = Make(options);
  // [0,4) [4,8) costs 160 and 4; the optimum [0,2) [2,8) (80, 84) is two moves away.
  const SyntheticTimes times{{40, 40, 40, 40, 1, 1, 1, 1}};
  FakePipeline pipeline(UniformPlacement(8, 2));
  std::vector<LayerRanges> targets;
  for (int64_t i = 1; i <= 10; ++i) {
    const Placement before = pipeline.placement();
    const RebalanceDecision decision = pipeline.Iterate(rebalancer.get(), i, times);
    if (decision.target.empty()) continue;
    EXPECT_LE(LayersMoved(before, ToPlacement(decision.target)), 1) << decision.note;
    targets.push_back(decision.target);
    if (targets.size() == 1) {
      EXPECT_THAT(
          decision.note,
          HasSubstr("; on the way to [0,2) [2,8) (bottleneck 84 ms; --rebalance_max_moves=1)"));
    }
  }
  EXPECT_THAT(targets, ElementsAre(LayerRanges{{0, 3}, {3, 8}}, LayerRanges{{0, 2}, {2, 8}}));
}

TEST_P(BalancingRebalancerTest, CappedStepsThroughATieStillProgress) {
  // [0,4) [4,8) [8,12) cost 100, 100, 10; the optimum [0,3) [3,6) [6,12) (75, 75, 60) is
  // three moves away. One move at a time, the first step can only relieve stage 1: the
  // bottleneck stays at stage 0's 100. Judged alone it gains nothing; it is still progress.
  BalancerOptions options = Algorithm(GetParam());
  options.max_moves = 1;
  auto rebalancer = Make(options);
  const SyntheticTimes times{{25, 25, 25, 25, 25, 25, 25, 25, 2.5, 2.5, 2.5, 2.5}};
  FakePipeline pipeline(UniformPlacement(12, 3));
  std::vector<RebalanceDecision> applied;
  for (int64_t i = 1; i <= 20; ++i) {
    const Placement before = pipeline.placement();
    RebalanceDecision decision = pipeline.Iterate(rebalancer.get(), i, times);
    if (decision.target.empty()) continue;
    EXPECT_EQ(LayersMoved(before, ToPlacement(decision.target)), 1) << decision.note;
    EXPECT_LE(decision.predicted_after, decision.predicted_before) << decision.note;
    applied.push_back(std::move(decision));
  }
  ASSERT_EQ(applied.size(), 3u);
  EXPECT_EQ(applied[0].predicted_after, applied[0].predicted_before) << applied[0].note;
  EXPECT_EQ(pipeline.placement(), (Placement{{0, 3}, {3, 6}, {6, 12}}));
}

TEST_P(BalancingRebalancerTest, DecisionsAreDeterministic) {
  // Two rebalancers, two pipelines, the same inputs (a drifting, noisy load that makes
  // layers move now and then): the same decisions, bit for bit.
  auto a = Make(Algorithm(GetParam()));
  auto b = Make(Algorithm(GetParam()));
  FakePipeline pipeline_a(UniformPlacement(12, 4));
  FakePipeline pipeline_b(UniformPlacement(12, 4));
  std::mt19937_64 rng(77);
  int moves = 0;
  for (int64_t i = 1; i <= 600; ++i) {
    SyntheticTimes base{std::vector<double>(12, 10.0), 4, 6};
    base.layer_ms[(i / 100) % 12] = 45;  // A hot layer that wanders every 100 iterations.
    const SyntheticTimes times = Noisy(base, 0.05, &rng);
    const RebalanceDecision da = pipeline_a.Iterate(a.get(), i, times);
    const RebalanceDecision db = pipeline_b.Iterate(b.get(), i, times);
    ASSERT_EQ(da.target, db.target) << i;
    ASSERT_EQ(da.note, db.note) << i;
    ASSERT_EQ(da.predicted_before, db.predicted_before) << i;
    ASSERT_EQ(da.predicted_after, db.predicted_after) << i;
    ASSERT_EQ(a->Metrics(), b->Metrics()) << i;
    if (!da.target.empty()) ++moves;
  }
  std::printf("[ %s ] wandering hot layer: %d moves in 600 iterations\n", GetParam().c_str(),
              moves);
  EXPECT_GE(moves, 3) << "layers should have followed the hot layer";
}

TEST(BalancingRebalancerNotesTest, NotesAndMetricsSayWhatWasDecided) {
  auto rebalancer = Make(Algorithm("partition"));
  FakePipeline pipeline(UniformPlacement(8, 2));
  const RebalanceDecision first = pipeline.Iterate(rebalancer.get(), 1, kFrontHeavy);
  EXPECT_EQ(first.note, "");  // Nothing measured: nothing considered.
  EXPECT_THAT(rebalancer->Metrics(), IsEmpty());

  const RebalanceDecision moved = pipeline.Iterate(rebalancer.get(), 2, kFrontHeavy);
  EXPECT_EQ(moved.note, "partition: [0,4) [4,8) → [0,3) [3,8); bottleneck 120 → 90 ms (−25%)");
  EXPECT_EQ(moved.predicted_before, 120);
  EXPECT_EQ(moved.predicted_after, 90);
  EXPECT_EQ(moved.unit, "ms");
  EXPECT_THAT(rebalancer->Metrics(),
              ElementsAre(std::pair<std::string, double>{"predicted_bottleneck", 90},
                          std::pair<std::string, double>{"predicted_imbalance", 0.25},
                          std::pair<std::string, double>{"predicted_gain", 0.25}));

  // The loads of iteration 2 carry the new ranges and the old placement's totals; the
  // moved layer must not count as pinned time of the stage it left (else stage 0 would
  // look 30 ms heavier and another layer would follow).
  const RebalanceDecision kept = pipeline.Iterate(rebalancer.get(), 3, kFrontHeavy);
  EXPECT_THAT(kept.target, IsEmpty());
  EXPECT_EQ(kept.note, "partition: keep [0,3) [3,8): already balanced (bottleneck 90 ms)");
  EXPECT_EQ(kept.predicted_before, 90);
  EXPECT_EQ(kept.predicted_after, 90);

  // A gain below the minimum: kept, and the note says by how much.
  auto held = Make(Algorithm("partition"));
  FakePipeline tied(UniformPlacement(8, 2));
  const SyntheticTimes almost{{10, 10, 10, 10, 10, 10, 10, 10}, 0, 12};  // 40, 52 or 50, 42.
  tied.Iterate(held.get(), 1, almost);
  EXPECT_EQ(tied.Iterate(held.get(), 2, almost).note,
            "partition: keep [0,4) [4,8): best gain 3.8% < --rebalance_min_gain 5% "
            "([0,5) [5,8): bottleneck 52 → 50 ms)");
  EXPECT_NEAR(held->Metrics()[2].second, 2.0 / 52, 1e-12);
}

std::vector<StageLoad> WithMemory(std::vector<StageLoad> loads) {
  // Every layer holds 100 bytes of state; stage 0 150 bytes more (the embedding).
  for (StageLoad& load : loads) {
    load.layer_state_bytes.assign(load.layer_end - load.layer_begin, 100);
    load.parameter_bytes = 100 * (load.layer_end - load.layer_begin);
  }
  loads[0].parameter_bytes += 150;
  return loads;
}

TEST(BalancingRebalancerMemoryTest, APlacementOverTheBudgetMakesWayForOneThatFits) {
  BalancerOptions options;
  options.load.memory_budget_bytes = 300;  // Stage 0 fits one layer; stage 1 three.
  auto rebalancer = Make(options);
  const Placement even = UniformPlacement(4, 2);
  const SyntheticTimes times{{10, 10, 10, 10}};
  rebalancer->Plan(1, WithMemory(UnmeasuredLoads(even)));
  const RebalanceDecision decision = rebalancer->Plan(2, WithMemory(MakeLoads(even, times)));
  EXPECT_EQ(decision.target, (LayerRanges{{0, 1}, {1, 4}})) << decision.note;
  EXPECT_EQ(decision.predicted_before, 20);
  EXPECT_EQ(decision.predicted_after, 30);  // Slower, but within the budget.
  EXPECT_THAT(decision.note, HasSubstr("to fit --rebalance_memory_budget_mb"));
}

// README: no placement within the budget is a clear error, not a note: the decision
// carries it (the pipeline run fails with it), naming the flag, for either algorithm.
TEST(BalancingRebalancerMemoryTest, NoPlacementFitsIsAnErrorNamingTheBudget) {
  for (const char* algorithm : {"partition", "diffusion"}) {
    BalancerOptions options = Algorithm(algorithm);
    options.load.memory_budget_bytes = 1024 * 1024 / 8;  // 0.125 MiB; a layer holds 100 bytes
    auto rebalancer = Make(options);
    const Placement even = UniformPlacement(4, 2);
    std::vector<StageLoad> loads = WithMemory(MakeLoads(even, SyntheticTimes{{10, 10, 30, 30}}));
    rebalancer->Plan(1, WithMemory(UnmeasuredLoads(even)));
    EXPECT_TRUE(rebalancer->Plan(2, loads).error.ok()) << "every placement fits 0.125 MiB";
    options.load.memory_budget_bytes = 1;
    rebalancer = Make(options);
    rebalancer->Plan(1, WithMemory(UnmeasuredLoads(even)));
    const RebalanceDecision decision = rebalancer->Plan(2, loads);
    EXPECT_THAT(decision.target, IsEmpty()) << algorithm;
    EXPECT_EQ(decision.error.code(), absl::StatusCode::kInvalidArgument) << algorithm;
    EXPECT_THAT(std::string(decision.error.message()),
                AllOf(HasSubstr("--rebalance_memory_budget_mb=9.53674e-07: no placement of 4 "
                                "layers on 2 pipeline stages fits the memory budget"),
                      HasSubstr("(planning iteration 2)")))
        << algorithm;
  }
}

// A budget that the current placement exceeds but another meets is no error: the move
// to it is planned (APlacementOverTheBudgetMakesWayForOneThatFits), and a budget every
// placement meets leaves the decision to the costs.
TEST(BalancingRebalancerMemoryTest, AFeasibleBudgetIsNoError) {
  for (const char* algorithm : {"partition", "diffusion"}) {
    BalancerOptions options = Algorithm(algorithm);
    options.load.memory_budget_bytes = 300;
    auto rebalancer = Make(options);
    const Placement even = UniformPlacement(4, 2);
    rebalancer->Plan(1, WithMemory(UnmeasuredLoads(even)));
    const RebalanceDecision decision =
        rebalancer->Plan(2, WithMemory(MakeLoads(even, SyntheticTimes{{10, 10, 10, 10}})));
    EXPECT_TRUE(decision.error.ok()) << algorithm << ": " << decision.error;
  }
}

TEST(BalancingRebalancerInputTest, BadLoadsKeepThePlacementAndSayWhy) {
  auto rebalancer = Make(Algorithm("partition"));
  std::vector<StageLoad> loads = MakeLoads(UniformPlacement(4, 2), SyntheticTimes{{1, 2, 3, 4}});
  loads[1].layer_forward_ms.pop_back();
  const RebalanceDecision decision = rebalancer->Plan(2, loads);
  EXPECT_THAT(decision.target, IsEmpty());
  EXPECT_THAT(decision.note,
              HasSubstr("partition: keep [0,2) [2,4): cannot use the measured loads"));
  EXPECT_THAT(rebalancer->Metrics(), IsEmpty());
}

TEST(BalancingRebalancerParamsTest, PlansAtTheFirstCallAsPartitionOnTheParameters) {
  BalancerOptions options;
  options.load.by = BalanceBy::kParams;
  auto rebalancer = Make(options);
  const Placement even = UniformPlacement(8, 2);
  std::vector<StageLoad> loads = UnmeasuredLoads(even);  // Iteration 1: no time measured.
  const std::vector<double> parameters = {4e6, 4e6, 4e6, 4e6, 1e6, 1e6, 1e6, 1e6};
  for (StageLoad& load : loads) {
    load.layer_parameters.assign(parameters.begin() + load.layer_begin,
                                 parameters.begin() + load.layer_end);
  }
  loads[0].pinned_parameters = 2e6;  // Embedding.
  loads[1].pinned_parameters = 3e6;  // Untied head.

  BalanceProblem expected_problem;
  expected_problem.num_stages = 2;
  expected_problem.layer_cost = parameters;
  expected_problem.first_stage_cost = 2e6;
  expected_problem.last_stage_cost = 3e6;
  absl::StatusOr<Placement> expected = PartitionBalance(expected_problem, &even);
  ASSERT_TRUE(expected.ok());
  ASSERT_NE(*expected, even);

  const RebalanceDecision decision = rebalancer->Plan(1, loads);
  EXPECT_EQ(decision.target, ToLayerRanges(*expected)) << decision.note;
  EXPECT_EQ(decision.unit, "params");
  EXPECT_EQ(decision.predicted_before, Bottleneck(expected_problem, even));
  EXPECT_EQ(decision.predicted_after, Bottleneck(expected_problem, *expected));
  EXPECT_THAT(decision.note, HasSubstr("bottleneck 18M → "));
  EXPECT_THAT(decision.note, HasSubstr("M params (−"));
}

TEST(BalancingRebalancerOptionsTest, ValidateNamesTheFlag) {
  EXPECT_TRUE(BalancerOptions{}.Validate().ok());
  auto expect_flag = [](BalancerOptions options, const char* flag) {
    const absl::Status status = options.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_THAT(status.message(), HasSubstr(flag));
    EXPECT_FALSE(BalancingRebalancer::Create(options).ok());
  };
  BalancerOptions options;
  options.algorithm = "greedy";
  expect_flag(options, "--rebalancer=greedy");
  options = {};
  options.load.window = 0;
  expect_flag(options, "--rebalance_window=0");
  options = {};
  options.load.memory_budget_bytes = -1;
  expect_flag(options, "--rebalance_memory_budget_mb");
  options = {};
  options.interval = 0;
  expect_flag(options, "--rebalance_interval=0");
  options = {};
  options.min_gain = 1;
  expect_flag(options, "--rebalance_min_gain=1");
  options = {};
  options.min_gain = -0.1;
  expect_flag(options, "--rebalance_min_gain=-0.1");
  options = {};
  options.max_moves = -1;
  expect_flag(options, "--rebalance_max_moves=-1");
  options = {};
  options.diffusion_max_rounds = 0;
  expect_flag(options, "--diffusion_max_rounds=0");
}

TEST(BalancingRebalancerOptionsTest, CheckLayoutRefusesFewerLayersThanStages) {
  EXPECT_TRUE(CheckLayout(4, 4).ok());
  EXPECT_TRUE(CheckLayout(9, 4).ok());
  const absl::Status few = CheckLayout(3, 4);
  EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(few.message(), HasSubstr("--num_layers=3"));
  EXPECT_THAT(few.message(), HasSubstr("--pipeline_model_parallel_size=4"));
  EXPECT_EQ(CheckLayout(4, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BalancingRebalancerOptionsTest, NameIsTheAlgorithm) {
  EXPECT_STREQ(Make(Algorithm("partition"))->name(), "partition");
  EXPECT_STREQ(Make(Algorithm("diffusion"))->name(), "diffusion");
}

}  // namespace
}  // namespace fulcrum::dynamic
