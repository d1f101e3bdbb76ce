// Tests of the virtual-stage (model chunk) side of pipeline/schedule.h: the layouts, the
// dependencies over virtual stages and the checker over (micro-batch, chunk) pairs, on
// hand-written schedules (the generators with v > 1 have their own tests).
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/schedule.h"

namespace fulcrum::pipeline {
namespace {

using ::testing::HasSubstr;

Action F(int mb, int chunk) { return {ActionKind::kForward, mb, chunk}; }
Action BW(int mb, int chunk) { return {ActionKind::kBackward, mb, chunk}; }
Action B(int mb, int chunk) { return {ActionKind::kBackwardInput, mb, chunk}; }
Action W(int mb, int chunk) { return {ActionKind::kBackwardWeight, mb, chunk}; }

std::string Ids(const std::vector<ChunkId>& ids) {
  std::string out;
  for (const ChunkId& id : ids) out += " " + std::to_string(id.stage) + "." + std::to_string(id.chunk);
  return out;
}

std::string Deps(const Schedule& schedule, int stage, const Action& action) {
  std::string out;
  for (const StageAction& dep : Dependencies(schedule, stage, action)) {
    out += " " + dep.action.ToString(true) + "@" + std::to_string(dep.stage);
  }
  return out;
}

// A V of two stages, one micro-batch, fused backward: model order 0.0 1.0 1.1 0.1.
Schedule HandV() {
  Schedule schedule;
  schedule.name = "hand-v";
  schedule.num_stages = 2;
  schedule.num_microbatches = 1;
  schedule.max_in_flight = 2;
  schedule.num_chunks = 2;
  schedule.virtual_stages = VShapeChunks(2);
  schedule.stages = {{F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)},
                     {F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)}};
  return schedule;
}

void ExpectChunkedRejected(const Schedule& schedule, const std::string& message) {
  const absl::Status status = ValidateSchedule(schedule);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(message));
}

TEST(VirtualStageTest, ActionsNameTheirChunk) {
  EXPECT_EQ(F(3, 0).ToString(), "F3");  // v = 1 output unchanged
  EXPECT_EQ(F(3, 0).ToString(true), "F3.0");
  EXPECT_EQ(B(3, 1).ToString(), "B3.1");  // a chunk other than 0 always shows
  EXPECT_EQ(W(12, 1).ToString(false), "W12.1");
  EXPECT_NE(F(1, 0), F(1, 1));
  EXPECT_EQ(BW(1, 1), BW(1, 1));
  // Aggregate initialisation without a chunk still means chunk 0.
  EXPECT_EQ((Action{ActionKind::kForward, 2}), F(2, 0));
}

TEST(VirtualStageTest, Layouts) {
  EXPECT_EQ(Ids(InterleavedChunks(2, 2)), " 0.0 1.0 0.1 1.1");
  EXPECT_EQ(Ids(InterleavedChunks(3, 1)), " 0.0 1.0 2.0");
  EXPECT_EQ(Ids(InterleavedChunks(2, 3)), " 0.0 1.0 0.1 1.1 0.2 1.2");
  // The V: down the ranks with chunk 0, back up with chunk 1; rank 0 holds both ends.
  EXPECT_EQ(Ids(VShapeChunks(3)), " 0.0 1.0 2.0 2.1 1.1 0.1");
  EXPECT_EQ(Ids(VShapeChunks(1)), " 0.0 0.1");
  EXPECT_THROW(InterleavedChunks(0, 2), std::invalid_argument);
  EXPECT_THROW(InterleavedChunks(2, 0), std::invalid_argument);
  EXPECT_THROW(VShapeChunks(0), std::invalid_argument);

  Schedule one_chunk;
  one_chunk.num_stages = 3;
  EXPECT_EQ(Ids(VirtualStages(one_chunk)), " 0.0 1.0 2.0");
  EXPECT_EQ(VirtualStageOf(one_chunk, 2, 0), 2);
  EXPECT_EQ(VirtualStageOf(one_chunk, 2, 1), -1);
  EXPECT_EQ(VirtualStageOf(one_chunk, 3, 0), -1);

  const Schedule v = HandV();
  EXPECT_EQ(Ids(VirtualStages(v)), " 0.0 1.0 1.1 0.1");
  EXPECT_EQ(VirtualStageOf(v, 0, 0), 0);
  EXPECT_EQ(VirtualStageOf(v, 1, 1), 2);
  EXPECT_EQ(VirtualStageOf(v, 0, 1), 3);
  EXPECT_EQ(VirtualStageOf(v, 0, 2), -1);
}

TEST(VirtualStageTest, DependenciesFollowTheModelOrder) {
  const Schedule v = HandV();  // 0.0 1.0 1.1 0.1
  EXPECT_EQ(Deps(v, 0, F(0, 0)), "");
  EXPECT_EQ(Deps(v, 1, F(0, 0)), " F0.0@0");
  EXPECT_EQ(Deps(v, 1, F(0, 1)), " F0.0@1");  // the turn of the V: same stage
  EXPECT_EQ(Deps(v, 0, F(0, 1)), " F0.1@1");
  EXPECT_EQ(Deps(v, 0, BW(0, 1)), " F0.1@0");  // the head: no gradient to wait for
  EXPECT_EQ(Deps(v, 1, BW(0, 1)), " F0.1@1 BW0.1@0");
  EXPECT_EQ(Deps(v, 1, B(0, 0)), " F0.0@1 B0.1@1");
  EXPECT_EQ(Deps(v, 0, W(0, 1)), " B0.1@0");
  EXPECT_THROW(Dependencies(v, 0, F(0, 2)), std::out_of_range);

  // Interleaved: virtual stage p (stage 0, chunk 1) takes its input from stage p-1.
  Schedule interleaved = v;
  interleaved.virtual_stages = InterleavedChunks(2, 2);  // 0.0 1.0 0.1 1.1
  EXPECT_EQ(Deps(interleaved, 0, F(0, 1)), " F0.0@1");
  EXPECT_EQ(Deps(interleaved, 1, BW(0, 0)), " F0.0@1 BW0.1@0");
  EXPECT_EQ(Deps(interleaved, 1, BW(0, 1)), " F0.1@1");

  // v = 1 is unchanged.
  Schedule line;
  line.num_stages = 3;
  EXPECT_EQ(Deps(line, 1, F(2, 0)), " F2.0@0");
  EXPECT_EQ(Deps(line, 1, B(2, 0)), " F2.0@1 B2.0@2");
  EXPECT_EQ(Deps(line, 2, BW(2, 0)), " F2.0@2");
}

TEST(VirtualStageTest, CheckerAcceptsAHandWrittenV) {
  const Schedule v = HandV();
  EXPECT_TRUE(ValidateSchedule(v).ok()) << ValidateSchedule(v);
  EXPECT_EQ(PeakInFlight(v, 0), 2);
  EXPECT_EQ(FormatSchedule(v),
            "hand-v: 2 stages, 1 micro-batches, 2 chunks per stage, at most 2 in flight\n"
            "virtual stages: 0.0 1.0 1.1 0.1\n"
            "stage 0: F0.0 F0.1 BW0.1 BW0.0\n"
            "stage 1: F0.0 F0.1 BW0.1 BW0.0");

  // The split form, with W's anywhere after their B.
  Schedule split = v;
  split.stages = {{F(0, 0), F(0, 1), B(0, 1), B(0, 0), W(0, 1), W(0, 0)},
                  {F(0, 0), F(0, 1), B(0, 1), W(0, 1), B(0, 0), W(0, 0)}};
  EXPECT_TRUE(ValidateSchedule(split).ok()) << ValidateSchedule(split);
}

TEST(VirtualStageTest, CheckerRejectsBadChunks) {
  Schedule schedule = HandV();
  schedule.stages[0][1] = F(0, 2);
  ExpectChunkedRejected(schedule, "stage 0: F0.2 names chunk 2, outside 0..1 (2 chunks per stage)");

  schedule = HandV();
  schedule.stages[1].pop_back();
  ExpectChunkedRejected(schedule, "schedule 'hand-v': stage 1: BW0.0 is missing");

  schedule = HandV();
  schedule.stages[1][3] = BW(0, 1);
  ExpectChunkedRejected(schedule, "stage 1: BW0.1 appears twice");

  // The turn of the V orders two actions of one list.
  schedule = HandV();
  std::swap(schedule.stages[1][0], schedule.stages[1][1]);
  ExpectChunkedRejected(schedule, "stage 1: F0.1 before its F0.0");
  schedule = HandV();
  std::swap(schedule.stages[1][2], schedule.stages[1][3]);
  ExpectChunkedRejected(schedule, "stage 1: BW0.0 before its BW0.1");

  // Across stages: stage 0 runs the head's backward before the forward reaches it.
  schedule = HandV();
  schedule.stages[0] = {F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)};
  ExpectChunkedRejected(schedule,
                 "deadlock: stage 0 is stuck at BW0.0 waiting for BW0.0 on stage 1; stage 1 is "
                 "stuck at BW0.1 waiting for BW0.1 on stage 0");

  // In flight counts (micro-batch, chunk) pairs.
  schedule = HandV();
  schedule.max_in_flight = 1;
  ExpectChunkedRejected(schedule,
                 "stage 0: F0.1 holds 2 chunk micro-batches in flight, above the schedule's "
                 "limit of 1");
}

TEST(VirtualStageTest, CheckerRejectsABadLayout) {
  Schedule schedule = HandV();
  schedule.virtual_stages.clear();
  ExpectChunkedRejected(schedule, "has 2 chunks per stage but no virtual_stages");

  schedule = HandV();
  schedule.virtual_stages.pop_back();
  ExpectChunkedRejected(schedule, "has 3 virtual stages for 2 stages × 2 chunks");

  schedule = HandV();
  schedule.virtual_stages[3] = {0, 0};
  ExpectChunkedRejected(schedule, "virtual stages 0 and 3 are both stage 0 chunk 0");

  schedule = HandV();
  schedule.virtual_stages[2] = {2, 1};
  ExpectChunkedRejected(schedule, "virtual stage 2 is stage 2 chunk 1, outside stages 0..1, chunks 0..1");

  schedule = HandV();
  schedule.num_chunks = 0;
  ExpectChunkedRejected(schedule, "num_chunks=0");
}

TEST(VirtualStageTest, MakeScheduleChecksTheChunkCount) {
  absl::StatusOr<Schedule> made = MakeSchedule("zbh1", 4, 8, 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(made.status().message()),
              HasSubstr("--virtual_pipeline_model_parallel_size=0 must be ≥ 1"));

  made = MakeSchedule("zbh2", 4, 8, 2);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(made.status().message()),
              HasSubstr("zbh2 schedule: runs one model chunk per stage, got 2 chunks"));
  made = MakeSchedule("zbh1", 4, 8, 1);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->num_chunks, 1);
  EXPECT_TRUE(made->virtual_stages.empty());
}

}  // namespace
}  // namespace fulcrum::pipeline
