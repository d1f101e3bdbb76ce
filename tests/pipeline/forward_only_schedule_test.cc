// Forward-only virtual stages (NOTE [forward-only stages] in pipeline/schedule.h): the
// stages that lie wholly in a frozen prefix lose their B/BW/W, the checker holds them to
// exactly their F's (and does not count those as held), and the simulator shows them
// running ahead instead of waiting on zero-cost backward steps — against a closed form.
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

struct Case {
  std::string name;
  int p;
  int m;
  int v;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int p : {2, 4}) {
    for (int m : {p, 2 * p, 3 * p}) {
      cases.push_back({"1f1b", p, m, 1});
      cases.push_back({"zbh1", p, m, 1});
      cases.push_back({"zbh2", p, m, 1});
      cases.push_back({"1f1b", p, m, 2});
      cases.push_back({"zbh1", p, m, 2});
      cases.push_back({"zbv", p, m, 2});
    }
  }
  return cases;
}

std::string Describe(const Case& c, int k) {
  return c.name + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v) + " forward_only=" + std::to_string(k);
}

TEST(ForwardOnlyScheduleTest, FrozenStagesKeepExactlyTheirForwardsAndTheRestIsUnchanged) {
  for (const Case& c : Cases()) {
    const Schedule base = *MakeSchedule(c.name, c.p, c.m, c.v);
    const std::vector<ChunkId> layout = VirtualStages(base);
    for (int k = 0; k < c.p * c.v; ++k) {
      SCOPED_TRACE(Describe(c, k));
      const Schedule cut = WithForwardOnlyPrefix(base, k);
      EXPECT_EQ(cut.forward_only, k);
      ASSERT_TRUE(ValidateSchedule(cut).ok()) << ValidateSchedule(cut) << "\n" << FormatSchedule(cut);
      for (int s = 0; s < c.p; ++s) {
        auto forward_only = [&](int chunk) { return VirtualStageOf(base, s, chunk) < k; };
        // What remains is the base list without the frozen chunks' backward, in order.
        std::vector<Action> expected;
        for (const Action& a : base.stages[s]) {
          if (a.kind == ActionKind::kForward || !forward_only(a.chunk)) expected.push_back(a);
        }
        EXPECT_EQ(cut.stages[s], expected) << "stage " << s;
        int removed = 0;
        for (int chunk = 0; chunk < c.v; ++chunk) removed += forward_only(chunk) ? 1 : 0;
        const int per_chunk = c.name == "1f1b" ? 1 : 2;  // BW, or B and W
        EXPECT_EQ(base.stages[s].size() - cut.stages[s].size(),
                  static_cast<size_t>(removed * per_chunk * c.m))
            << "stage " << s << " lost exactly its frozen chunks' backward";
        // A stage whose every chunk runs forward only holds nothing.
        if (removed == c.v) {
          EXPECT_EQ(PeakInFlight(cut, s), 0) << "stage " << s;
        } else {
          EXPECT_LE(PeakInFlight(cut, s), PeakInFlight(base, s)) << "stage " << s;
        }
      }
    }
  }
}

// Removing zero-cost steps only removes waits: with the frozen stages' B and W costing
// nothing in the base schedule, the forward-only one is never slower, for every schedule
// and many costs.
TEST(ForwardOnlyScheduleTest, NeverSlowerThanWaitingOnZeroCostBackwards) {
  const double values[] = {0.5, 1, 2};
  for (const Case& c : Cases()) {
    const Schedule base = *MakeSchedule(c.name, c.p, c.m, c.v);
    for (int k = 1; k < c.p * c.v; ++k) {
      const Schedule cut = WithForwardOnlyPrefix(base, k);
      for (double f : values) {
        for (double b : values) {
          std::vector<ActionCosts> costs(c.p * c.v, ActionCosts{f, b, 1.0});
          for (int j = 0; j < k; ++j) costs[j].backward_input = costs[j].backward_weight = 0;
          if (c.v == 1) costs.resize(c.p);  // one per stage = one per virtual stage
          SCOPED_TRACE(Describe(c, k) + " F=" + std::to_string(f) + " B=" + std::to_string(b));
          EXPECT_LE(Simulate(cut, costs).makespan, Simulate(base, costs).makespan + 1e-9);
        }
      }
    }
  }
}

// p = 2, stage 0 frozen and as slow as stage 1's whole work (F = 3 against F = B = W = 1),
// each transfer 0.5. Forward-only, stage 0's forwards run back to back (F_j ends at
// 3(j+1)) and stage 1 runs each micro-batch as it arrives: 1F1B ends at 3m + 3.5
// (F_{m-1} arrives at 3m + 0.5, its F and BW take 3), ZB-H1 at 3m + 4.5 (its last
// micro-batch also runs the W it deferred). In 1F1B's list stage 0's F_{j+2} waits for
// its BW_j, i.e. for stage 1's BW_j and a transfer back: a round trip that costs stage 0
// one time unit every two micro-batches (its forwards pair up 7 apart, a period of 3.5),
// 3.5m + 3 in all. ZB-H1's deferred W's on stage 1 hide that round trip at these costs.
TEST(ForwardOnlyScheduleTest, AFrozenFirstStageNeverWaitsForTheRoundTripClosedForm) {
  const std::vector<ActionCosts> costs = {{3, 0, 0, 0.5}, {1, 1, 1, 0.5}};
  for (int m : {2, 4, 8, 16}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    const Schedule base = OneFOneB(2, m);
    const SimulationResult cut = Simulate(WithForwardOnlyPrefix(base, 1), costs);
    EXPECT_DOUBLE_EQ(cut.makespan, 3.0 * m + 3.5);
    for (int j = 0; j < m; ++j) EXPECT_DOUBLE_EQ(cut.stages[0].actions[j].end, 3.0 * (j + 1));
    EXPECT_DOUBLE_EQ(Simulate(base, costs).makespan, 3.5 * m + 3) << "the round trips";
    const Schedule zbh1 = ZeroBubbleH1(2, m);
    EXPECT_DOUBLE_EQ(Simulate(WithForwardOnlyPrefix(zbh1, 1), costs).makespan, 3.0 * m + 4.5);
    EXPECT_DOUBLE_EQ(Simulate(zbh1, costs).makespan, 3.0 * m + 4.5);
  }
}

TEST(ForwardOnlyScheduleTest, CheckerRejectsABackwardOnAForwardOnlyStage) {
  Schedule cut = WithForwardOnlyPrefix(OneFOneB(2, 2), 1);
  cut.stages[0].push_back(Action{ActionKind::kBackward, 0, 0});
  const absl::Status status = ValidateSchedule(cut);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("stage 0: BW0 on virtual stage 0, which runs forward only"));
  // Its forwards are still required.
  Schedule missing = WithForwardOnlyPrefix(OneFOneB(2, 2), 1);
  missing.stages[0].pop_back();
  EXPECT_THAT(std::string(ValidateSchedule(missing).message()), HasSubstr("F1 is missing"));
}

TEST(ForwardOnlyScheduleTest, TheHeadsStageAlwaysRunsItsBackward) {
  Schedule bad = OneFOneB(2, 2);
  bad.forward_only = 2;
  EXPECT_THAT(std::string(ValidateSchedule(bad).message()),
              HasSubstr("forward_only=2 outside 0..1"));
  EXPECT_THROW(WithForwardOnlyPrefix(OneFOneB(2, 2), 2), std::invalid_argument);
  EXPECT_THROW(WithForwardOnlyPrefix(WithForwardOnlyPrefix(OneFOneB(3, 2), 1), 1),
               std::invalid_argument);
  EXPECT_THAT(FormatSchedule(WithForwardOnlyPrefix(OneFOneB(3, 2), 2)),
              HasSubstr("forward only: virtual stages 0..1"));
}

TEST(ForwardOnlyScheduleTest, ForwardOnlyVirtualStagesFollowTheFrozenPrefix) {
  const std::vector<std::pair<int64_t, int64_t>> ranges = {{0, 3}, {3, 6}, {6, 8}};
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 0), 0);
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 2), 0);  // layer 2 of stage 0 trains
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 3), 1);
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 5), 1);
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 6), 2);
  EXPECT_EQ(ForwardOnlyVirtualStages(ranges, 8), 2) << "the head's stage always trains";
  // An empty first stage with nothing frozen: the embedding trains there.
  EXPECT_EQ(ForwardOnlyVirtualStages({{0, 0}, {0, 4}}, 0), 0);
  EXPECT_EQ(ForwardOnlyVirtualStages({{0, 0}, {0, 4}}, 1), 1);
}

}  // namespace
}  // namespace fulcrum::pipeline
