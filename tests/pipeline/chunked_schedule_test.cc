// Tests of the schedules with several model chunks per stage — interleaved 1F1B
// and ZB-V (pipeline/schedule.h) — and of the simulator with chunks
// (pipeline/schedule_simulator.h).
#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::pipeline {
namespace {

using ::testing::HasSubstr;

constexpr double kChunkedTolerance = 1e-9;
const int kStageCounts[] = {1, 2, 3, 4, 8};

std::string CaseName(const std::string &name, int p, int m, int v = 0) {
  return name + " p=" + std::to_string(p) + " m=" + std::to_string(m) +
         (v > 0 ? " v=" + std::to_string(v) : "");
}

bool SameLayout(const std::vector<ChunkId> &a, const std::vector<ChunkId> &b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// ---------------------------------------------------------------------------------------
// Interleaved 1F1B

TEST(InterleavedOneFOneBTest, PassesTheCheckerWhereMegatronRunsIt) {
  for (int p : kStageCounts) {
    for (int v : {2, 3, 4}) {
      for (int m = 1; m <= 4 * p; ++m) {
        SCOPED_TRACE(CaseName("1f1b", p, m, v));
        absl::StatusOr<Schedule> schedule = MakeSchedule("1f1b", p, m, v);
        if (m % p != 0) {
          // Megatron-LM's rule: whole groups of p micro-batches per chunk.
          EXPECT_EQ(schedule.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_THAT(std::string(schedule.status().message()),
                      HasSubstr("to be a multiple of the pipeline stages "
                                "(--pipeline_model_parallel_size=" +
                                std::to_string(p) + ")"));
          continue;
        }
        ASSERT_TRUE(schedule.ok()) << schedule.status();
        EXPECT_TRUE(ValidateSchedule(*schedule).ok()) << ValidateSchedule(*schedule);
        EXPECT_EQ(schedule->num_chunks, v);
        EXPECT_TRUE(SameLayout(schedule->virtual_stages, InterleavedChunks(p, v)));
        EXPECT_FALSE(UsesSplitBackward(*schedule));
        // NOTE [interleaved 1F1B]: stage 0 holds min(m·v, (v+1)p - 1) chunk
        // micro-batches, and no stage more.
        EXPECT_EQ(schedule->max_in_flight, std::min(m * v, (v + 1) * p - 1));
        EXPECT_EQ(PeakInFlight(*schedule, 0), schedule->max_in_flight);
      }
    }
  }
  // v = 1 is plain 1F1B, bit for bit.
  const Schedule plain = OneFOneB(4, 6, 1);
  EXPECT_EQ(plain.num_chunks, 1);
  EXPECT_TRUE(plain.virtual_stages.empty());
  EXPECT_EQ(FormatSchedule(plain), FormatSchedule(*MakeSchedule("1f1b", 4, 6)));
  EXPECT_THROW(OneFOneB(4, 6, 0), std::invalid_argument);
}

// p = 2, m = 4, v = 2 (NOTE [interleaved 1F1B]). The virtual micro-batch
// sequence, groups of p·v = 4: forwards F0.0 F1.0 F0.1 F1.1 | F2.0 F3.0 F2.1
// F3.1, backwards the same micro-batches with the chunks reversed: BW0.1 BW1.1
// BW0.0 BW1.0 | BW2.1 BW3.1 BW2.0 BW3.0. Warm-up: stage 0 runs 2(p-1) + (v-1)p
// = 4 forwards, stage 1 runs 0 + 2 = 2; then each alternates the next forward
// with the next backward and ends with the backwards left.
TEST(InterleavedOneFOneBTest, MegatronsOrderForTwoStages) {
  EXPECT_EQ(FormatSchedule(OneFOneB(2, 4, 2)),
            "1f1b: 2 stages, 4 micro-batches, 2 chunks per stage, at most 5 in "
            "flight\n"
            "virtual stages: 0.0 1.0 0.1 1.1\n"
            "stage 0: F0.0 F1.0 F0.1 F1.1 F2.0 BW0.1 F3.0 BW1.1 F2.1 BW0.0 "
            "F3.1 BW1.0 BW2.1 "
            "BW3.1 BW2.0 BW3.0\n"
            "stage 1: F0.0 F1.0 F0.1 BW0.1 F1.1 BW1.1 F2.0 BW0.0 F3.0 BW1.0 "
            "F2.1 BW2.1 F3.1 "
            "BW3.1 BW2.0 BW3.0");
  // m = p: Megatron runs every forward first.
  EXPECT_EQ(FormatSchedule(OneFOneB(2, 2, 2)),
            "1f1b: 2 stages, 2 micro-batches, 2 chunks per stage, at most 4 in "
            "flight\n"
            "virtual stages: 0.0 1.0 0.1 1.1\n"
            "stage 0: F0.0 F1.0 F0.1 F1.1 BW0.1 BW1.1 BW0.0 BW1.0\n"
            "stage 1: F0.0 F1.0 F0.1 F1.1 BW0.1 BW1.1 BW0.0 BW1.0");
}

// Narayanan et al. 2021 §2.2: with v chunks per stage each chunk costs 1/v of
// the stage, and the ramp-up and ramp-down of the pipeline each last p-1 chunk
// steps instead of p-1 stage steps, so every stage idles (p-1)(T_F + T_B +
// T_W)/v — 1F1B's (p-1)(T_F + T_B + T_W) divided by v — when m is a multiple of
// p. The simulator gives exactly that on every stage for m = p..4p and every
// cost mix tried (forward or backward the heavier one).
TEST(InterleavedOneFOneBTest, BubbleIsOneFOneBsOverV) {
  for (int p : kStageCounts) {
    for (int v : {2, 3}) {
      for (int m = p; m <= 4 * p; m += p) {
        for (const ActionCosts &c : {ActionCosts{1, 1, 1}, ActionCosts{1, 1.5, 0.5},
                                     ActionCosts{2, 1, 0.5}, ActionCosts{0.5, 1, 2}}) {
          const SimulationResult result = Simulate(OneFOneB(p, m, v), ChunkCosts(c, v));
          const double expected = (p - 1) * (c.forward + c.backward_input + c.backward_weight) / v;
          for (int s = 0; s < p; ++s) {
            EXPECT_NEAR(result.bubble(s), expected, kChunkedTolerance)
                << CaseName("1f1b", p, m, v) << " F=" << c.forward << " B=" << c.backward_input
                << " W=" << c.backward_weight << " stage " << s;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Interleaved ZB-H1 (NOTE [interleaved ZB-H1])

// Megatron's interleaved order with B/W split and stage s's W's 2s backwards late: valid,
// within interleaved 1F1B's memory, and never slower than interleaved 1F1B or one-chunk
// ZB-H1 for these sizes and cost mixes (with transfer time too, except below).
//
// A lower bound for any schedule whose stages do equal work: the last stage cannot start
// before micro-batch 0 passed the p-1 chunks before it, (p-1)·T_F/v, and every stage then
// works as long as it, so every stage idles at least (p-1)·T_F/v. Interleaved ZB-H1 meets it
// for p ≤ 4 and m ≥ 2p at these mixes (no transfer time); 1F1B's and ZB-H1's bubbles
// are (p-1)(T_F + T_B + T_W)/v and (p-1)·max(T_F, T_B, T_F + T_B - T_W).
TEST(InterleavedZeroBubbleH1Test, ValidWithinMemoryAndNeverSlower) {
  for (int p : kStageCounts) {
    for (int v : {2, 3}) {
      for (int m = 1; m <= 4 * p; ++m) {
        SCOPED_TRACE(CaseName("zbh1", p, m, v));
        absl::StatusOr<Schedule> made = MakeSchedule("zbh1", p, m, v);
        if (m % p != 0) {
          EXPECT_THAT(std::string(made.status().message()),
                      HasSubstr("zbh1 schedule: interleaved ZB-H1 (" + std::to_string(v) +
                                " chunks per stage"));
          continue;
        }
        ASSERT_TRUE(made.ok()) << made.status();
        const Schedule& h1 = *made;
        EXPECT_TRUE(ValidateSchedule(h1).ok()) << ValidateSchedule(h1);
        EXPECT_TRUE(UsesSplitBackward(h1));
        const Schedule one_f_one_b = OneFOneB(p, m, v);
        EXPECT_EQ(h1.max_in_flight, one_f_one_b.max_in_flight);
        for (int s = 0; s < p; ++s) EXPECT_LE(PeakInFlight(h1, s), h1.max_in_flight);
        for (const ActionCosts& c :
             {ActionCosts{1, 1, 1}, ActionCosts{1, 2, 1}, ActionCosts{1, 1, 0.5},
              ActionCosts{2, 1, 1}, ActionCosts{1, 1, 1, 0.25}}) {
          const SimulationResult r = Simulate(h1, ChunkCosts(c, v));
          EXPECT_LE(r.makespan, Simulate(one_f_one_b, ChunkCosts(c, v)).makespan + kChunkedTolerance);
          // Interleaving sends v times as many activations: with transfer time and m = p
          // it can lose to one-chunk ZB-H1 (p = 2, m = 2, v = 2, p2p 0.25: 8 against 7.5).
          if (c.p2p == 0 || m > p) {
            EXPECT_LE(r.makespan, Simulate(ZeroBubbleH1(p, m), c).makespan + kChunkedTolerance);
          }
          const double bound = (p - 1) * c.forward / v;
          for (int s = 0; s < p; ++s) {
            EXPECT_GE(r.bubble(s), bound - kChunkedTolerance);
            if (p <= 4 && m >= 2 * p && c.p2p == 0) {
              EXPECT_NEAR(r.bubble(s), bound, kChunkedTolerance)
                  << "F=" << c.forward << " B=" << c.backward_input << " stage " << s;
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// ZB-V

TEST(ZeroBubbleVTest, PassesTheCheckerWithOneFOneBsMemory) {
  for (int p : kStageCounts) {
    for (int m = 1; m <= 4 * p; ++m) {
      SCOPED_TRACE(CaseName("zbv", p, m));
      // The V sets its own two chunks: v = 1 (not set) and v = 2 give the same
      // schedule.
      absl::StatusOr<Schedule> schedule = MakeSchedule("zbv", p, m);
      ASSERT_TRUE(schedule.ok()) << schedule.status();
      EXPECT_EQ(FormatSchedule(*schedule), FormatSchedule(*MakeSchedule("zbv", p, m, 2)));
      EXPECT_TRUE(ValidateSchedule(*schedule).ok()) << ValidateSchedule(*schedule);
      EXPECT_EQ(schedule->num_chunks, 2);
      EXPECT_TRUE(SameLayout(schedule->virtual_stages, VShapeChunks(p)));
      EXPECT_TRUE(UsesSplitBackward(*schedule));
      // 2p half-stage micro-batches = 1F1B's p whole ones.
      EXPECT_EQ(schedule->max_in_flight, std::min(2 * p, 2 * m));
      for (int s = 0; s < p; ++s) EXPECT_LE(PeakInFlight(*schedule, s), 2 * p);
    }
  }
  absl::StatusOr<Schedule> three = MakeSchedule("zbv", 4, 8, 3);
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(three.status().message()),
              HasSubstr("zbv schedule: ZB-V runs exactly 2 chunks per stage (a V), got 3"));
}

// p = 2, m = 2, step by step under NOTE [ZB-V]'s rules (unit steps; "x@s" = x
// on stage s):
//   t0  s0: F0.0                  s1: —   (nothing has arrived)
//   t1  s0: F1.0 (F0 with room)   s1: F0.0
//   t2  s0: —    (F0.1 waits)     s1: F0.1 (the turn of the V: its input is
//   local) t3  s0: F0.1                  s1: F1.0 t4  s0: B0.1 (the head) s1:
//   F1.1 t5  s0: F1.1                  s1: B0.1 t6  s0: B1.1 s1: B0.0 (its
//   gradient is B0.1@1, local) t7  s0: B0.0                  s1: B1.1 t8  s0:
//   W0.1 (B1.0 waits)     s1: B1.0 t9  s0: B1.0                  s1: W0.1
//   t10..12: the W's owed, oldest first. Makespan 13 = 6m + p - 1 (see below).
TEST(ZeroBubbleVTest, OrderForTwoStages) {
  EXPECT_EQ(FormatSchedule(ZeroBubbleV(2, 2)),
            "zbv: 2 stages, 2 micro-batches, 2 chunks per stage, at most 4 in "
            "flight\n"
            "virtual stages: 0.0 1.0 1.1 0.1\n"
            "stage 0: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 W0.1 B1.0 W1.1 W0.0 W1.0\n"
            "stage 1: F0.0 F0.1 F1.0 F1.1 B0.1 B0.0 B1.1 B1.0 W0.1 W0.0 W1.1 W1.0");
  EXPECT_DOUBLE_EQ(Simulate(ZeroBubbleV(2, 2), ActionCosts{1, 1, 1}).makespan, 13);
}

// The goal at unit costs: each chunk action costs 1 (a chunk is half a
// stage, so ZB-H1's whole-stage actions cost 2), no transfer time, p ∈ {2, 4,
// 8}, m ∈ {p, 2p, 4p}.
//
// A lower bound for any schedule on the V (the zero-bubble authors' greedy V
// scheduler's included): stage p-1 cannot start before step p-1, as micro-batch
// 0's forward needs the p-1 chunks before it on stages 0..p-2, and it then has
// 6m unit actions to run (F, B, W of m micro-batches for two chunks). So the
// makespan is at least 6m + p - 1. We do not re-implement the authors'
// scheduler: ours meets this bound at every point here, so it is no longer than
// theirs. (It does not everywhere: e.g. p = 5, m = 6 takes one step more.) Its
// bubble ratio is below ZB-H1's at every point, at the same memory.
TEST(ZeroBubbleVTest, UnitCostMakespanAgainstTheBoundAndZeroBubbleH1) {
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p, 4 * p}) {
      SCOPED_TRACE(CaseName("zbv", p, m));
      const SimulationResult v = Simulate(ZeroBubbleV(p, m), ActionCosts{1, 1, 1});
      const SimulationResult h1 = Simulate(ZeroBubbleH1(p, m), ActionCosts{2, 2, 2});
      EXPECT_DOUBLE_EQ(v.makespan, 6 * m + p - 1);
      for (int s = 0; s < p; ++s) {
        EXPECT_DOUBLE_EQ(v.stages[s].busy, 6 * m);
        EXPECT_LT(v.BubbleRatio(s), h1.BubbleRatio(s)) << "stage " << s;
      }
    }
  }
}

// The unit-cost order loses its lead once B costs more than F; the greedy run at those costs
// (ZeroBubbleVAt) keeps ZB-V ahead of ZB-H1 (whole-stage costs twice a chunk's) at
// F = 1.33, B = 1.67, W = 1 — about the dense GPT layer's F : B : W (NOTE [sim FLOP model]).
// At unit costs scaled by any factor it gives the unit order: its rounds are the steps.
TEST(ZeroBubbleVTest, OrderBuiltAtTheCosts) {
  const ActionCosts c{1.33, 1.67, 1};
  for (int p : {4, 8, 24}) {
    const int m = 4 * p;
    SCOPED_TRACE(CaseName("zbv", p, m));
    const Schedule at_costs = ZeroBubbleVAt(p, m, c.forward, c.backward_input, c.backward_weight, 0);
    ASSERT_TRUE(ValidateSchedule(at_costs).ok()) << ValidateSchedule(at_costs);
    for (int s = 0; s < p; ++s) EXPECT_LE(PeakInFlight(at_costs, s), 2 * p);
    const double built = Simulate(at_costs, c).makespan;
    const double unit_order = Simulate(ZeroBubbleV(p, m), c).makespan;
    const double h1 = Simulate(ZeroBubbleH1(p, m), ActionCosts{2 * c.forward, 2 * c.backward_input,
                                                               2 * c.backward_weight})
                          .makespan;
    EXPECT_LT(built, h1);
    // At p = 24 the first order alone came within 0.01% of ZB-H1 (859.89 against 860); the
    // other two orders take it to 845.16.
    if (p == 24) {
      EXPECT_LT(built, 0.99 * h1);
    }
    EXPECT_LT(built, 0.9 * unit_order);
    EXPECT_EQ(FormatSchedule(ZeroBubbleVAt(p, m, 2.5, 2.5, 2.5, 0)), FormatSchedule(ZeroBubbleV(p, m)));
  }
  // With transfer time the order still passes the checker.
  EXPECT_TRUE(ValidateSchedule(ZeroBubbleVAt(8, 16, 1, 1.5, 0.75, 0.5)).ok());
  EXPECT_THROW(ZeroBubbleVAt(4, 8, 0, 1, 1, 0), std::invalid_argument);
  EXPECT_THROW(ZeroBubbleVAt(4, 8, 1, 1, 1, -1), std::invalid_argument);
  EXPECT_THROW(ZeroBubbleVAt(0, 8, 1, 1, 1, 0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// Simulator with chunks

// ZB-V, p = 2, m = 1 (order: stage 0 F0.0 F0.1 B0.1 W0.1 B0.0 W0.0, stage 1
// F0.0 F0.1 B0.1 B0.0 W0.1 W0.0), each virtual stage k with F = k+1, B = W = 1
// and a transfer of 0.5:
//   s0 F0.0 (k0)   0 .. 1
//   s1 F0.0 (k1)   1.5 .. 3.5     (transfer from stage 0)
//   s1 F0.1 (k2)   3.5 .. 6.5     (the turn: same stage, no transfer)
//   s0 F0.1 (k3)   7 .. 11
//   s0 B0.1 (k3)   11 .. 12,  W0.1 12 .. 13
//   s1 B0.1 (k2)   12.5 .. 13.5,  B0.0 (k1) 13.5 .. 14.5,  W0.1 .. 15.5,  W0.0
//   .. 16.5 s0 B0.0 (k0)   15 .. 16,  W0.0 16 .. 17
TEST(ChunkedSimulateTest, CostsPerVirtualStageAndNoTransferAtTheTurn) {
  const Schedule schedule = ZeroBubbleV(2, 1);
  std::vector<ActionCosts> costs;
  for (int k = 0; k < 4; ++k) costs.push_back({k + 1.0, 1, 1, 0.5});
  const SimulationResult result = Simulate(schedule, costs);
  EXPECT_DOUBLE_EQ(result.makespan, 17);
  const std::vector<TimedAction> &s1 = result.stages[1].actions;
  ASSERT_EQ(s1.size(), 6u);
  EXPECT_EQ(s1[1].action, (Action{ActionKind::kForward, 0, 1}));
  EXPECT_DOUBLE_EQ(s1[1].start, 3.5);
  EXPECT_DOUBLE_EQ(s1[1].end, 6.5);
  EXPECT_DOUBLE_EQ(result.stages[0].actions[1].start, 7);
  EXPECT_DOUBLE_EQ(result.stages[0].actions[4].start, 15);
  EXPECT_DOUBLE_EQ(result.stages[1].end(), 16.5);

  // One entry per stage: every chunk of the stage costs the same.
  const SimulationResult per_stage =
      Simulate(schedule, std::vector<ActionCosts>{{1, 1, 1}, {1, 1, 1}});
  EXPECT_DOUBLE_EQ(per_stage.makespan,
                   Simulate(schedule, std::vector<ActionCosts>(4, ActionCosts{1, 1, 1})).makespan);

  try {
    Simulate(schedule, std::vector<ActionCosts>(3));
    ADD_FAILURE() << "3 costs for 2 stages × 2 chunks were accepted";
  } catch (const std::invalid_argument &e) {
    EXPECT_THAT(e.what(), HasSubstr("3 costs for 2 stages × 2 chunks; give 2 (one per stage) "
                                    "or 4 (one per virtual stage, in model order)"));
  }
  costs[2].forward = -1;
  try {
    Simulate(schedule, costs);
    ADD_FAILURE() << "a negative cost was accepted";
  } catch (const std::invalid_argument &e) {
    EXPECT_THAT(e.what(), HasSubstr("virtual stage 2 has a cost of -1"));
  }
  EXPECT_THROW(ChunkCosts(ActionCosts{}, 0), std::invalid_argument);
}

// Every simulated action starts after its dependencies (plus a transfer across
// stages only) and after the previous action of its stage, for both chunked
// generators.
TEST(ChunkedSimulateTest, TimelinesRespectDependencies) {
  const ActionCosts costs{1, 1.5, 0.5, 0.25};
  for (const Schedule &schedule : {OneFOneB(4, 8, 2), OneFOneB(3, 6, 3), ZeroBubbleV(4, 7)}) {
    const SimulationResult result = Simulate(schedule, costs);
    for (int s = 0; s < schedule.num_stages; ++s) {
      const std::vector<TimedAction> &timeline = result.stages[s].actions;
      ASSERT_EQ(timeline.size(), schedule.stages[s].size());
      for (size_t i = 0; i < timeline.size(); ++i) {
        EXPECT_EQ(timeline[i].action, schedule.stages[s][i]);
        if (i > 0) {
          EXPECT_GE(timeline[i].start, timeline[i - 1].end - kChunkedTolerance);
        }
        for (const StageAction &dep : Dependencies(schedule, s, timeline[i].action)) {
          const auto &other = result.stages[dep.stage].actions;
          auto it = std::find_if(other.begin(), other.end(),
                                 [&](const TimedAction &t) { return t.action == dep.action; });
          ASSERT_NE(it, other.end());
          EXPECT_GE(timeline[i].start, it->end + (dep.stage == s ? 0 : costs.p2p) - kChunkedTolerance);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fulcrum::pipeline
