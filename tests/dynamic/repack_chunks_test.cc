// Re-packing under virtual pipeline stages (NOTE [re-packing under chunks] in
// dynamic/repack.h): ranks merge chunk by chunk into the V's and the round-robin layout of
// fewer ranks (placements worked out by hand), the prediction is the chunked schedule's
// (against a direct simulation and the one-rank closed form), a rank's memory counts both
// chunks, the decision equals a brute force over every rank grouping, interleaved
// schedules refuse rank counts the micro-batches do not divide, the measured chunked
// loads become the problem in model order, and under --zbv_order=measured each placement is
// predicted with the V the runner would build for it (NOTE [re-packing under the measured
// V]). The live shrink runs in
// tests/recipes/repack_train_test.cc (SlowRepackTrainTest.ZbvPp4ToPp2LiveAndThroughACheckpoint...,
// ...InterleavedPp4ToPp2..., ...InterleavedPp2ToPp1ThroughACheckpoint...).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dynamic/load_model.h"
#include "dynamic/repack.h"
#include "dynamic/repack_trigger.h"
#include "dynamic/stage_costs.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/measured_order.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::dynamic {
namespace {

using ::testing::HasSubstr;

Placement Singles(int n) {
  Placement placement;
  for (int l = 0; l < n; ++l) placement.push_back({l, l + 1});
  return placement;
}

// ZB-V on 4 ranks: virtual stages 0 1 2 3 4 5 6 7 on ranks 0 1 2 3 3 2 1 0. Merging ranks
// {0,1},{2,3} merges virtual stages 0-1 and 2-3 down the V and 4-5 and 6-7 up it — the
// bottom turn (3, 4 on rank 3) splits between the new rank 1's two chunks, it does not merge.
TEST(RepackChunksTest, TheVMergesRanksChunkByChunk) {
  const Placement eight = Singles(8);
  EXPECT_EQ(*CoarsenRanks(eight, "zbv", 2, {1}), (Placement{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  // {0},{1,2,3}: rank 0 keeps virtual 0 and 7; the rest is one rank's chunks 1-3 and 4-6.
  EXPECT_EQ(*CoarsenRanks(eight, "zbv", 2, {0}), (Placement{{0, 1}, {1, 4}, {4, 7}, {7, 8}}));
  // {0},{1,2},{3}: a V of three.
  EXPECT_EQ(*CoarsenRanks(eight, "zbv", 2, {0, 2}),
            (Placement{{0, 1}, {1, 3}, {3, 4}, {4, 5}, {5, 7}, {7, 8}}));
  // One rank runs one chunk: the whole model.
  EXPECT_EQ(*CoarsenRanks(eight, "zbv", 2, {}), (Placement{{0, 8}}));
  // Uneven ranges keep their layers: ranks {0,1} and {2,3} of a V of 12 layers.
  const Placement uneven = {{0, 1}, {1, 3}, {3, 4}, {4, 5}, {5, 8}, {8, 9}, {9, 11}, {11, 12}};
  EXPECT_EQ(*CoarsenRanks(uneven, "zbv", 1, {1}), (Placement{{0, 3}, {3, 5}, {5, 9}, {9, 12}}));
}

// Interleaved (round-robin) on 4 ranks, 2 chunks: virtual k on rank k % 4.
TEST(RepackChunksTest, RoundRobinMergesRanksChunkByChunk) {
  const Placement eight = Singles(8);
  EXPECT_EQ(*CoarsenRanks(eight, "1f1b", 2, {1}), (Placement{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(*CoarsenRanks(eight, "1f1b", 2, {0}), (Placement{{0, 1}, {1, 4}, {4, 5}, {5, 8}}));
  EXPECT_EQ(*CoarsenRanks(eight, "zbh1", 2, {0, 1}),
            (Placement{{0, 1}, {1, 2}, {2, 4}, {4, 5}, {5, 6}, {6, 8}}));
  // Three chunks on 3 ranks (virtual k on rank k % 3) onto 2: {0},{1,2}.
  EXPECT_EQ(*CoarsenRanks(Singles(9), "1f1b", 3, {0}),
            (Placement{{0, 1}, {1, 3}, {3, 4}, {4, 6}, {6, 7}, {7, 9}}));
  // One chunk per rank: consecutive stages merge.
  EXPECT_EQ(*CoarsenRanks(Singles(4), "1f1b", 1, {1}), (Placement{{0, 2}, {2, 4}}));
  EXPECT_EQ(*EvenCoarsening(eight, 2, "zbv", 2), *CoarsenRanks(eight, "zbv", 2, {1}));
  EXPECT_EQ(*EvenCoarsening(eight, 4, "zbv", 2), eight);
  EXPECT_THAT(EvenCoarsening(eight, 5, "zbv", 2).status().message(),
              HasSubstr("cannot pack 4 pipeline stages onto 5"));
  EXPECT_THAT(CoarsenRanks(eight, "zbv", 2, {3}).status().message(), HasSubstr("cut after rank 3"));
  EXPECT_THAT(CoarsenRanks(eight, "zbv", 2, {1, 0}).status().message(), HasSubstr("out of order"));
  EXPECT_THAT(CoarsenRanks(Singles(7), "zbv", 2, {1}).status().message(),
              HasSubstr("7 ranges under --pipeline_schedule=zbv with 2 chunks per rank"));
  EXPECT_FALSE(CoarsenRanks(Singles(2), "zbv", 2, {}).ok()) << "two ranges are no V";
}

RepackProblem Random(std::mt19937& rng, int layers, const std::string& schedule, int chunks,
                     int microbatches) {
  std::uniform_real_distribution<double> cost(0.2, 2.0);
  RepackProblem problem;
  for (int l = 0; l < layers; ++l) {
    problem.layer_forward.push_back(cost(rng));
    problem.layer_backward.push_back(cost(rng));
    problem.layer_weight.push_back(cost(rng));
    problem.layer_state_bytes.push_back(std::round(100 * cost(rng)));
    problem.layer_activation_bytes.push_back(std::round(10 * cost(rng)));
  }
  problem.first_stage = {cost(rng), cost(rng), cost(rng)};
  problem.last_stage = {cost(rng), cost(rng), cost(rng)};
  problem.first_stage_pinned_bytes = 50;
  problem.last_stage_pinned_bytes = 70;
  problem.p2p = 0.1;
  problem.schedule = schedule;
  problem.num_chunks = chunks;
  problem.num_microbatches = microbatches;
  return problem;
}

// A random placement of `layers` into `ranges` non-empty contiguous ranges.
Placement RandomPlacement(std::mt19937& rng, int layers, int ranges) {
  std::vector<int> cuts(layers - 1);
  for (int i = 0; i < layers - 1; ++i) cuts[i] = i + 1;
  std::shuffle(cuts.begin(), cuts.end(), rng);
  cuts.resize(ranges - 1);
  std::sort(cuts.begin(), cuts.end());
  Placement placement;
  int begin = 0;
  for (int c : cuts) placement.push_back({begin, c}), begin = c;
  placement.push_back({begin, layers});
  return placement;
}

// The prediction of a chunked placement is the chunked schedule simulated on each virtual
// stage's own costs (embedding on virtual 0, head on the last — ZB-V: both on rank 0); on
// one rank it is the closed form m · (every layer's F + B + W + the pinned ones).
TEST(RepackChunksTest, PredictionIsTheChunkedScheduleOnTheVirtualStagesCosts) {
  std::mt19937 rng(7);
  const RepackProblem problem = Random(rng, 12, "zbv", 2, 6);
  const Placement four = {{0, 2}, {2, 6}, {6, 9}, {9, 12}};
  const absl::StatusOr<pipeline::Schedule> v = pipeline::MakeSchedule("zbv", 2, 6, 2);
  ASSERT_TRUE(v.ok());
  std::vector<pipeline::ActionCosts> costs(4);
  for (int k = 0; k < 4; ++k) {
    costs[k].forward = RangeSum(problem.layer_forward, four[k]);
    costs[k].backward_input = RangeSum(problem.layer_backward, four[k]);
    costs[k].backward_weight = RangeSum(problem.layer_weight, four[k]);
    costs[k].p2p = problem.p2p;
  }
  costs[0].forward += problem.first_stage.forward;
  costs[0].backward_input += problem.first_stage.backward_input;
  costs[0].backward_weight += problem.first_stage.backward_weight;
  costs[3].forward += problem.last_stage.forward;
  costs[3].backward_input += problem.last_stage.backward_input;
  costs[3].backward_weight += problem.last_stage.backward_weight;
  const absl::StatusOr<double> time = PredictIterationTime(problem, four);
  ASSERT_TRUE(time.ok()) << time.status();
  EXPECT_NEAR(*time, pipeline::Simulate(*v, costs).makespan, 1e-9);
  // The same ranges as a one-chunk pipeline of 4 stages would be another schedule.
  EXPECT_GT(std::abs(*time - pipeline::Simulate(*pipeline::MakeSchedule("zbh1", 4, 6), costs).makespan),
            1e-6);

  double all = 0;
  for (int l = 0; l < 12; ++l) {
    all += problem.layer_forward[l] + problem.layer_backward[l] + problem.layer_weight[l];
  }
  for (const pipeline::ActionCosts& c : {problem.first_stage, problem.last_stage}) {
    all += c.forward + c.backward_input + c.backward_weight;
  }
  const absl::StatusOr<double> one = PredictIterationTime(problem, {{0, 12}});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_NEAR(*one, 6 * all, 1e-9);
  EXPECT_THAT(PredictIterationTime(problem, {{0, 6}, {6, 12}}).status().message(),
              HasSubstr("expected one range (one rank) or q·2 for q ≥ 2 ranks"));
}

// A V rank holds both its chunks: their state, the pinned state of both ends on rank 0,
// and the activations it holds at its peak. With chunks of equal activation bytes b the
// peak is PeakInFlight · b exactly; with one chunk's bytes zero it is below.
TEST(RepackChunksTest, ARanksMemoryCountsBothChunks) {
  RepackProblem problem;
  problem.layer_forward.assign(8, 1.0);
  problem.layer_backward.assign(8, 1.0);
  problem.layer_weight.assign(8, 1.0);
  problem.layer_state_bytes = {1, 2, 4, 8, 16, 32, 64, 128};
  problem.layer_activation_bytes.assign(8, 5.0);
  problem.first_stage_pinned_bytes = 1000;
  problem.last_stage_pinned_bytes = 3000;
  problem.schedule = "zbv";
  problem.num_microbatches = 4;
  const Placement four = {{0, 2}, {2, 4}, {4, 6}, {6, 8}};  // rank 0: 0-2, 6-8; rank 1: 2-6
  const absl::StatusOr<pipeline::Schedule> v = pipeline::MakeSchedule("zbv", 2, 4, 2);
  ASSERT_TRUE(v.ok());
  const absl::StatusOr<std::vector<double>> memory = RepackStageMemory(problem, four);
  ASSERT_TRUE(memory.ok()) << memory.status();
  ASSERT_EQ(memory->size(), 2u);
  EXPECT_DOUBLE_EQ((*memory)[0], 1 + 2 + 64 + 128 + 1000 + 3000 + pipeline::PeakInFlight(*v, 0) * 10.0);
  EXPECT_DOUBLE_EQ((*memory)[1], 4 + 8 + 16 + 32 + pipeline::PeakInFlight(*v, 1) * 10.0);
  // Round-robin on 2 ranks: rank 0 holds 0-2 and 4-6 with the embedding, rank 1 2-4 and
  // 6-8 with the head.
  problem.schedule = "1f1b";
  problem.num_chunks = 2;
  const absl::StatusOr<pipeline::Schedule> rr = pipeline::MakeSchedule("1f1b", 2, 4, 2);
  ASSERT_TRUE(rr.ok());
  const absl::StatusOr<std::vector<double>> interleaved = RepackStageMemory(problem, four);
  ASSERT_TRUE(interleaved.ok()) << interleaved.status();
  EXPECT_DOUBLE_EQ((*interleaved)[0], 1 + 2 + 16 + 32 + 1000 + pipeline::PeakInFlight(*rr, 0) * 10.0);
  EXPECT_DOUBLE_EQ((*interleaved)[1], 4 + 8 + 64 + 128 + 3000 + pipeline::PeakInFlight(*rr, 1) * 10.0);
  for (int s = 0; s < 2; ++s) {
    EXPECT_DOUBLE_EQ(pipeline::PeakHeldBytes(*v, s, {10, 10}), pipeline::PeakInFlight(*v, s) * 10.0);
    EXPECT_LT(pipeline::PeakHeldBytes(*v, s, {10, 0}), pipeline::PeakInFlight(*v, s) * 10.0);
  }
}

// Every rank grouping simulated: the admissible one with the fewest ranks, then the
// fastest, then the first in lexicographic order of its cuts (DecideRepack's rule).
struct ChunkBest {
  bool found = false;
  Placement placement;
  double time = 0;
};

ChunkBest ChunkBruteForce(const RepackProblem& problem, const Placement& current, int p,
                const RepackOptions& options) {
  const double bound = (1 + options.max_slowdown) * *PredictIterationTime(problem, current);
  ChunkBest best;
  for (int q = options.min_stages; q < p && !best.found; ++q) {
    std::vector<std::vector<int>> groupings;
    for (uint32_t mask = 0; mask < (1u << (p - 1)); ++mask) {
      if (__builtin_popcount(mask) != q - 1) continue;
      std::vector<int> cuts;
      for (int r = 0; r < p - 1; ++r) {
        if (mask & (1u << r)) cuts.push_back(r);
      }
      groupings.push_back(cuts);
    }
    std::sort(groupings.begin(), groupings.end());
    for (const std::vector<int>& cuts : groupings) {
      const absl::StatusOr<Placement> candidate =
          CoarsenRanks(current, problem.schedule, problem.num_chunks, cuts);
      EXPECT_TRUE(candidate.ok()) << candidate.status();
      const absl::StatusOr<double> time = PredictIterationTime(problem, *candidate);
      if (!time.ok()) break;  // the schedule cannot run on q ranks
      const absl::StatusOr<std::vector<double>> memory = RepackStageMemory(problem, *candidate);
      if (*std::max_element(memory->begin(), memory->end()) > problem.memory_budget) continue;
      if (*time > bound) continue;
      if (!best.found || *time < best.time) best = {true, *candidate, *time};
    }
  }
  return best;
}

TEST(RepackChunksTest, DecisionEqualsTheBruteForceOverRankGroupings) {
  std::mt19937 rng(2029);
  int repacked = 0, kept = 0, fast_repacked = 0;
  const char* const schedules[] = {"zbv", "1f1b", "zbh1"};  // the V, round-robin ×2
  for (int trial = 0; trial < 90; ++trial) {
    const std::string schedule = schedules[trial % 3];
    const int p = 3 + (trial / 3) % 4;  // 3..6 ranks under each schedule
    const int layers = 2 * p + 6;
    // Round-robin needs m % p = 0; m = 4p leaves some smaller counts unrunnable (p = 5: 2, 3).
    RepackProblem problem = Random(rng, layers, schedule, 2, schedule == "zbv" ? 8 : 4 * p);
    if (trial % 5 == 0) problem.frozen_prefix = layers / 3;  // forward-only virtual stages
    const Placement current = RandomPlacement(rng, layers, 2 * p);
    problem.memory_budget = std::uniform_real_distribution<double>(600, 2500)(rng);
    RepackOptions options;
    options.max_slowdown = std::uniform_real_distribution<double>(0.0, 0.6)(rng);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " " << problem.schedule << " p=" << p
                                      << " " << FormatPlacement(current));
    const ChunkBest expected = ChunkBruteForce(problem, current, p, options);
    const absl::StatusOr<RepackPlan> plan = DecideRepack(problem, current, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->repack, expected.found) << plan->note;
    if (!expected.found) {
      ++kept;
      continue;
    }
    ++repacked;
    EXPECT_EQ(plan->placement, expected.placement) << plan->note;
    EXPECT_EQ(plan->predicted_after, expected.time);
    // The fast path (least bottleneck, then first fit) finds an admissible grouping too,
    // never one with fewer ranks than the optimum.
    options.exhaustive_up_to = 1;
    const absl::StatusOr<RepackPlan> fast = DecideRepack(problem, current, options);
    ASSERT_TRUE(fast.ok()) << fast.status();
    if (fast->repack) {
      ++fast_repacked;
      EXPECT_GE(fast->placement.size(), expected.placement.size());
      EXPECT_LE(fast->peak_memory, problem.memory_budget);
      EXPECT_LE(fast->predicted_after, (1 + options.max_slowdown) * fast->predicted_before);
    }
  }
  std::printf("[ repack chunks ] %d repacked (the fast path too in %d), %d kept\n", repacked,
              fast_repacked, kept);
  EXPECT_GT(repacked, 15);
  EXPECT_GT(kept, 5);
  EXPECT_GE(fast_repacked, repacked * 3 / 4) << "the least-bottleneck and first-fit search";
}

// Interleaved schedules need m % q = 0: with m = 4 on 4 ranks, 3 ranks are no candidate
// (the note says why) and 2 are.
TEST(RepackChunksTest, InterleavedRefusesRankCountsTheMicroBatchesDoNotDivide) {
  RepackProblem problem;
  problem.layer_forward = {1, 0.1, 0.1, 0.1, 1, 0.1, 0.1, 0.1};
  problem.layer_backward = problem.layer_forward;
  problem.layer_weight.assign(8, 0.0);
  problem.schedule = "1f1b";
  problem.num_chunks = 2;
  problem.num_microbatches = 4;
  RepackOptions options;
  options.min_stages = 3;
  options.max_slowdown = 10;
  absl::StatusOr<RepackPlan> plan = DecideRepack(problem, Singles(8), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->repack);
  EXPECT_THAT(plan->note, HasSubstr("not on 3 stages"));
  options.min_stages = 2;
  plan = DecideRepack(problem, Singles(8), options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(plan->repack) << plan->note;
  EXPECT_EQ(plan->placement.size(), 4u) << "two ranks of two chunks";
}

// What a ZB-V pipeline of 2 ranks measures (pipeline/rebalancer.h NOTE [rebalancing under
// chunks]): rank 0 holds layers 0-1 and 6-7, rank 1 layers 2-5, per-layer values in chunk
// order; rank 0's chunk 0 ran the embedding (4 ms over m = 2), its chunk 1 the head (8 ms).
TEST(RepackChunksTest, ChunkedLoadsBecomeTheProblemInModelOrder) {
  std::vector<pipeline::StageLoad> loads(2);
  loads[0].stage = 0;
  loads[0].chunk_ranges = {{0, 2}, {6, 8}};
  loads[1].stage = 1;
  loads[1].layer_begin = 2;
  loads[1].layer_end = 6;
  loads[1].chunk_ranges = {{2, 4}, {4, 6}};
  for (pipeline::StageLoad& load : loads) {
    for (const auto& [begin, end] : load.chunk_ranges) {
      double f = 0;
      for (int64_t l = begin; l < end; ++l) {
        load.layer_forward_ms.push_back(2.0 * (l + 1));
        load.layer_backward_ms.push_back(4.0 * (l + 1));
        load.layer_weight_ms.push_back(0);
        load.layer_state_bytes.push_back(100);
        f += 2.0 * (l + 1);
      }
      load.chunk_forward_ms.push_back(f);
      load.chunk_backward_ms.push_back(2 * f);
      load.chunk_weight_ms.push_back(0);
    }
    load.parameter_bytes = 400;
  }
  loads[0].chunk_forward_ms[0] += 4;
  loads[0].chunk_backward_ms[1] += 8;
  loads[0].parameter_bytes += 250;
  const absl::StatusOr<RepackProblem> problem =
      RepackProblemFromLoads(loads, "zbv", 2, 1e9, 2);
  ASSERT_TRUE(problem.ok()) << problem.status();
  EXPECT_EQ(problem->layer_forward, (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(problem->layer_backward, (std::vector<double>{2, 4, 6, 8, 10, 12, 14, 16}));
  EXPECT_EQ(problem->first_stage.forward, 2);
  EXPECT_EQ(problem->first_stage.backward_input, 0);
  EXPECT_EQ(problem->last_stage.forward, 0);
  EXPECT_EQ(problem->last_stage.backward_input, 4);
  EXPECT_EQ(problem->first_stage_pinned_bytes, 250);
  EXPECT_EQ(problem->last_stage_pinned_bytes, 0) << "rank 0's pinned state, counted once";
  EXPECT_EQ(problem->num_chunks, 2);
  // A gap in the chunks is refused.
  loads[1].chunk_ranges[1] = {5, 6};
  EXPECT_FALSE(RepackProblemFromLoads(loads, "zbv", 2, 1e9, 2).ok());
}

// --repack_script under ZB-V: 4 ranks onto 2 after iteration 5, chunk by chunk.
TEST(RepackChunksTest, AScriptPacksAVOntoFewerRanks) {
  RepackTriggerOptions options;
  options.schedule = "zbv";
  options.script = {{5, 2}};
  RepackTrigger trigger(options);
  pipeline::LayerRanges eight;
  for (int64_t l = 0; l < 8; ++l) eight.emplace_back(l, l + 1);
  EXPECT_FALSE(trigger.Check(4, eight, {})->has_value());
  const absl::StatusOr<std::optional<RepackPlan>> plan = trigger.Check(5, eight, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(plan->has_value());
  EXPECT_EQ((*plan)->placement, (Placement{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_THAT((*plan)->note, HasSubstr("packs 4 stages onto 2"));
  // Packed already (4 ranges are 2 ranks): nothing more to do.
  EXPECT_FALSE(trigger.Check(6, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}, {})->has_value());
}

// NOTE [re-packing under the measured V]: what a ZB-V pipeline of q ranks running
// `placement` would measure over m micro-batches (rank r holds virtual stages r and
// 2q-1-r): per-layer times in chunk order and each chunk's totals, the embedding in virtual
// stage 0's and the head in the last one's — the loads the runner's MeasuredVOrder and the
// re-packing trigger read.
std::vector<pipeline::StageLoad> MeasuredVLoads(const RepackProblem& problem,
                                                const Placement& placement, int m) {
  const int q = static_cast<int>(placement.size()) / 2;
  std::vector<pipeline::StageLoad> loads(q);
  for (int r = 0; r < q; ++r) {
    pipeline::StageLoad& load = loads[r];
    load.stage = r;
    for (const int k : {r, 2 * q - 1 - r}) {
      load.chunk_ranges.emplace_back(placement[k].begin, placement[k].end);
      double f = 0, b = 0, w = 0;
      for (int64_t l = placement[k].begin; l < placement[k].end; ++l) {
        load.layer_forward_ms.push_back(m * problem.layer_forward[l]);
        load.layer_backward_ms.push_back(m * problem.layer_backward[l]);
        load.layer_weight_ms.push_back(m * problem.layer_weight[l]);
        load.layer_state_bytes.push_back(problem.layer_state_bytes[l]);
        f += problem.layer_forward[l], b += problem.layer_backward[l], w += problem.layer_weight[l];
      }
      for (const pipeline::ActionCosts* pinned :
           {k == 0 ? &problem.first_stage : nullptr,
            k == 2 * q - 1 ? &problem.last_stage : nullptr}) {
        if (pinned == nullptr) continue;
        f += pinned->forward, b += pinned->backward_input, w += pinned->backward_weight;
      }
      load.chunk_forward_ms.push_back(m * f);
      load.chunk_backward_ms.push_back(m * b);
      load.chunk_weight_ms.push_back(m * w);
      load.total_ms += m * (f + b + w);
    }
  }
  return loads;
}

// A random problem with B dearer than F, as measured (NOTE [ZB-V at measured costs]: F 13.2,
// B 16.0, W 9.4 ms per chunk): there the V built at the costs beats the unit-cost one.
RepackProblem BDearerThanF(std::mt19937& rng, int layers, int microbatches) {
  RepackProblem problem = Random(rng, layers, "zbv", 2, microbatches);
  for (int l = 0; l < layers; ++l) {
    problem.layer_backward[l] = 1.6 * problem.layer_forward[l] + 0.1 * problem.layer_backward[l];
    problem.layer_weight[l] = 0.7 * problem.layer_forward[l];
  }
  return problem;
}

// Under --zbv_order=measured a placement is predicted under the order the runner builds for
// it: the time equals the makespan of MeasuredVOrder's order (built from the loads that
// placement would measure, for its frozen prefix) on the placement's costs, never above the
// unit-cost order's and below it on most placements at B > F; the memory follows that
// order's held activations. Under a frozen prefix the order is chosen as it runs with the
// prefix: choosing first and removing the frozen stages' backward after is slower on some.
TEST(RepackChunksTest, UnderTheMeasuredVThePredictionIsTheOrderTheRunnerBuilds) {
  std::mt19937 rng(31);
  int faster = 0, trials = 0, other_memory = 0, frozen = 0, prefix_wins = 0;
  double most = 0;  // the largest unit / measured - 1
  for (int trial = 0; trial < 30; ++trial) {
    const int q = 2 + trial % 3;
    const int m = (2 + trial % 2) * q;
    const int layers = 2 * q + 5;
    RepackProblem problem = BDearerThanF(rng, layers, m);
    if (trial % 4 == 3) problem.frozen_prefix = 2;  // a forward-only first virtual stage
    const Placement placement = RandomPlacement(rng, layers, 2 * q);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " q=" << q << " m=" << m << " "
                                      << FormatPlacement(placement));
    const absl::StatusOr<double> unit = PredictIterationTime(problem, placement);
    const absl::StatusOr<std::vector<double>> unit_memory = RepackStageMemory(problem, placement);
    problem.measured_zbv_order = true;
    const absl::StatusOr<double> measured = PredictIterationTime(problem, placement);
    const absl::StatusOr<std::vector<double>> memory = RepackStageMemory(problem, placement);
    ASSERT_TRUE(unit.ok() && measured.ok() && unit_memory.ok() && memory.ok());

    pipeline::MeasuredVOrder order;
    ASSERT_TRUE(order.Observe(MeasuredVLoads(problem, placement, m), m));
    const int forward_only =
        pipeline::ForwardOnlyVirtualStages(ToLayerRanges(placement), problem.frozen_prefix);
    const pipeline::Schedule runs = order.Build(q, m, forward_only);
    const pipeline::Schedule unit_runs =
        pipeline::WithForwardOnlyPrefix(pipeline::ZeroBubbleV(q, m), forward_only);
    const std::vector<pipeline::ActionCosts> costs =
        PlacementStageCosts(problem.layer_forward, problem.layer_backward, problem.layer_weight,
                            problem.first_stage, problem.last_stage, placement, problem.p2p);
    EXPECT_NEAR(*measured, pipeline::Simulate(runs, costs).makespan, 1e-9);
    EXPECT_NEAR(*unit, pipeline::Simulate(unit_runs, costs).makespan, 1e-9);
    EXPECT_LE(*measured, *unit + 1e-9);
    faster += *measured < *unit - 1e-9;
    most = std::max(most, *unit / *measured - 1);
    ++trials;
    if (forward_only > 0) {
      const double chosen_first =
          pipeline::Simulate(pipeline::WithForwardOnlyPrefix(order.Build(q, m), forward_only), costs)
              .makespan;
      EXPECT_LE(*measured, chosen_first + 1e-9);
      prefix_wins += *measured < chosen_first - 1e-9;
      ++frozen;
    }
    // Memory: the held activations of the order that runs, in place of the unit order's.
    for (int r = 0; r < q; ++r) {
      const std::vector<double> held = {
          RangeSum(problem.layer_activation_bytes, placement[r]),
          RangeSum(problem.layer_activation_bytes, placement[2 * q - 1 - r])};
      EXPECT_NEAR((*memory)[r] - (*unit_memory)[r],
                  pipeline::PeakHeldBytes(runs, r, held) -
                      pipeline::PeakHeldBytes(unit_runs, r, held),
                  1e-9);
      other_memory += std::abs((*memory)[r] - (*unit_memory)[r]) > 1e-9;
    }
  }
  std::printf("[ measured V ] faster than the unit order on %d of %d placements (the unit "
              "order up to %.1f%% slower); memory differs on %d ranks; with a frozen prefix "
              "faster than the order chosen before the prefix on %d of %d\n",
              faster, trials, 100 * most, other_memory, prefix_wins, frozen);
  EXPECT_GE(faster, trials / 2) << "at B > F the V built at the costs should win on most";
  EXPECT_GE(prefix_wins, 1) << "the order is to be chosen as it runs under the frozen prefix";
}

// DecideRepack under the measured V equals the brute force over every rank grouping with the
// same predictions, and decides otherwise than under the unit order where the orders differ.
TEST(RepackChunksTest, UnderTheMeasuredVTheDecisionEqualsTheBruteForce) {
  std::mt19937 rng(2031);
  int repacked = 0, differs = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int p = 3 + trial % 4;
    const int layers = 2 * p + 6;
    RepackProblem problem = BDearerThanF(rng, layers, 8);
    problem.measured_zbv_order = true;
    if (trial % 5 == 0) problem.frozen_prefix = layers / 3;
    const Placement current = RandomPlacement(rng, layers, 2 * p);
    problem.memory_budget = std::uniform_real_distribution<double>(600, 2500)(rng);
    RepackOptions options;
    options.max_slowdown = std::uniform_real_distribution<double>(0.0, 0.6)(rng);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " p=" << p << " "
                                      << FormatPlacement(current));
    const ChunkBest expected = ChunkBruteForce(problem, current, p, options);
    const absl::StatusOr<RepackPlan> plan = DecideRepack(problem, current, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->repack, expected.found) << plan->note;
    if (expected.found) {
      ++repacked;
      EXPECT_EQ(plan->placement, expected.placement) << plan->note;
      EXPECT_EQ(plan->predicted_after, expected.time);
    }
    RepackProblem unit = problem;
    unit.measured_zbv_order = false;
    const absl::StatusOr<RepackPlan> unit_plan = DecideRepack(unit, current, options);
    ASSERT_TRUE(unit_plan.ok()) << unit_plan.status();
    differs += unit_plan->repack != plan->repack || unit_plan->placement != plan->placement;
  }
  std::printf("[ measured V ] %d of 24 re-packed; the unit order decided otherwise in %d\n",
              repacked, differs);
  EXPECT_GT(repacked, 5);
  EXPECT_GT(differs, 0) << "the order the prediction assumes changes some decisions";
}

// The live trigger predicts under the order training runs: with --zbv_order=measured its
// decision's times are the measured V's on the problem the loads give.
TEST(RepackChunksTest, TheTriggerPredictsUnderTheMeasuredV) {
  std::mt19937 rng(5);
  RepackProblem problem = BDearerThanF(rng, 12, 12);
  const Placement current = RandomPlacement(rng, 12, 6);
  const std::vector<pipeline::StageLoad> loads = MeasuredVLoads(problem, current, 12);
  const pipeline::LayerRanges ranges = ToLayerRanges(current);
  for (const bool measured : {false, true}) {
    RepackTriggerOptions options;
    options.automatic = true;
    options.interval = 1;
    options.schedule = "zbv";
    options.num_chunks = 2;
    options.num_microbatches = 12;
    options.measured_zbv_order = measured;
    options.decision.max_slowdown = 10;
    RepackTrigger trigger(options);
    const absl::StatusOr<std::optional<RepackPlan>> plan = trigger.Check(1, ranges, loads);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(plan->has_value()) << trigger.last_note();
    absl::StatusOr<RepackProblem> from_loads = RepackProblemFromLoads(loads, "zbv", 12, 1e300, 2);
    ASSERT_TRUE(from_loads.ok()) << from_loads.status();
    from_loads->measured_zbv_order = measured;
    EXPECT_DOUBLE_EQ((*plan)->predicted_before, *PredictIterationTime(*from_loads, current));
    from_loads->measured_zbv_order = !measured;
    EXPECT_GT(std::abs((*plan)->predicted_before - *PredictIterationTime(*from_loads, current)), 1e-6)
        << "the two orders predict this placement differently";
  }
}

}  // namespace
}  // namespace fulcrum::dynamic
