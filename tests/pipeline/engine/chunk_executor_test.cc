// The executor with model chunks (virtual pipeline stages; NOTE [model chunks] in
// core/gpt_model.h, NOTE [chunk transport] in pipeline/internal/stage_transport.h): at
// pp = 2 and pp = 4, interleaved 1F1B (v = 2) and ZB-V run an 8-layer model and give the
// loss and every gradient of one process's plain forward and backward, bit for bit; a
// forward-only run gives the same loss. The cases run as suite ChunkExecutorWorker under
// fulcrum_launch, started by the SlowChunkExecutorTest drivers.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "parallel/world_communicator.h"
#include "pipeline/pipeline_runner.h"
#include "pipeline/stage_executor.h"
#include "tests/pipeline/engine/engine_test_util.h"

namespace fulcrum::pipeline {
namespace {

using testing::EngineModel;
using testing::IsWorker;
using testing::LaunchWorkers;
using testing::RandomPlan;
using testing::WorldFromEnvironment;
using testing::OneProcessWorld;
using testing::kMicroBatchSize;
using testing::kLossScale;

struct Case {
  std::string schedule;
  int chunks;
  bool tied;
};

// One case on every rank: the stage's chunks of the even split over p·v virtual stages run
// `schedule` (forward-only first, then training); one process's whole model runs the same
// micro-batches. The summed loss and every held parameter's gradient must be equal.
void RunCase(parallel::Communicator* pp, const Case& c, int microbatches) {
  SCOPED_TRACE(absl::StrCat(c.schedule, " v=", c.chunks, c.tied ? " tied" : "", " p=", pp->size()));
  ModelOptions options = EngineModel();
  options.num_layers = 8;
  options.tie_embeddings = c.tied;
  absl::StatusOr<Schedule> schedule = MakeSchedule(c.schedule, pp->size(), microbatches, c.chunks);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  ASSERT_TRUE(ValidateSchedule(*schedule).ok());
  const int virtual_stages = pp->size() * schedule->num_chunks;
  const StageSpec spec = ChunkedStage(
      *schedule, EvenVirtualRanges(options.num_layers, virtual_stages), pp->rank());
  GptModel chunked(options, spec);
  ASSERT_EQ(chunked.num_chunks(), schedule->num_chunks);
  const MicroBatchPlan plan = RandomPlan(options, microbatches, kMicroBatchSize);

  GptModel plain(options);
  double expected = 0;
  for (int mb = 0; mb < microbatches; ++mb) {
    ForwardContext ctx{true, /*iteration=*/1, plan.first_sample(mb), kLossScale, {}, 0};
    LossSum loss = plain.ForwardLoss(plan.tokens(mb), ctx);
    expected += loss.sum.item<double>();
    (loss.sum * kLossScale).backward();
  }

  StageExecutor executor(pp, kMicroBatchSize);
  auto total = [&](const StageRunResult& run) {
    at::Tensor t = at::tensor({run.loss_sum}, at::kDouble);
    pp->AllReduce(t, parallel::ReduceOp::kSum);
    return t.item<double>();
  };
  absl::StatusOr<StageRunResult> evaluated =
      executor.Run(chunked, *schedule, 1, plan, 1.0, /*forward_only=*/true);
  ASSERT_TRUE(evaluated.ok()) << evaluated.status();
  EXPECT_EQ(total(*evaluated), expected) << "forward-only";
  absl::StatusOr<StageRunResult> run = executor.Run(chunked, *schedule, 1, plan, kLossScale);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(total(*run), expected);
  // Every action of the list ran, and every layer of the stage has F and B time.
  EXPECT_EQ(run->timings.size(), schedule->stages[pp->rank()].size());
  EXPECT_EQ(run->layer_forward_ms.size(), chunked.layers().size());
  EXPECT_EQ(run->layer_backward_ms.size(), chunked.layers().size());
  EXPECT_GT(run->peak_activation_bytes, 0);

  const std::vector<Unit*> plain_units = plain.Units();
  int compared = 0;
  for (Unit* unit : chunked.Units()) {
    const Unit* reference = nullptr;
    for (Unit* u : plain_units) {
      if (u->name() == unit->name()) reference = u;
    }
    ASSERT_NE(reference, nullptr) << unit->name();
    for (size_t p = 0; p < unit->parameters().size(); ++p) {
      const at::Tensor& g = unit->parameters()[p].value.grad();
      const at::Tensor& r = reference->parameters()[p].value.grad();
      const std::string name = unit->GlobalName(unit->parameters()[p].name);
      ASSERT_TRUE(g.defined() && r.defined()) << name;
      if (c.tied && name == "embedding.word_embeddings.weight") {
        // The tied weight sums two gradients per micro-batch, the head's and the lookup's;
        // ZB-V runs the head's B of later micro-batches before the lookup's B of earlier
        // ones, so the fp32 sum is taken in another order than one process's: equal up to
        // rounding, not bit for bit.
        const double scale = r.abs().max().item<double>();
        EXPECT_LE((g - r).abs().max().item<double>(), 1e-5 * scale) << name;
      } else {
        EXPECT_TRUE(at::equal(g, r)) << name;
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
  pp->Barrier();
}

TEST(ChunkExecutorWorker, MatchesOneProcess) {
  if (!IsWorker()) GTEST_SKIP() << "runs under fulcrum_launch, started by SlowChunkExecutorTest";
  std::unique_ptr<parallel::Communicator> pp = WorldFromEnvironment();
  ASSERT_NE(pp, nullptr);
  // Interleaved 1F1B needs m % p == 0 (Megatron's rule); 2p micro-batches fill the V too.
  const int microbatches = 2 * pp->size();
  for (const Case& c : {Case{"1f1b", 2, false}, Case{"zbv", 2, false}, Case{"zbv", 2, true},
                        Case{"1f1b", 1, false}}) {
    RunCase(pp.get(), c, microbatches);
  }
}

// ZB-V on one stage: both chunks on rank 0, so every activation and gradient between them
// is an in-memory hand-over (NOTE [chunk transport]), both ways; still one process's
// gradients bit for bit.
TEST(ChunkExecutorTest, OneStageVHandsOverBetweenItsChunks) {
  std::unique_ptr<parallel::Communicator> world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  RunCase(world.get(), Case{"zbv", 2, false}, 3);
}

// A model cut otherwise than the schedule is refused by name.
TEST(ChunkExecutorTest, MismatchedChunksAreRefused) {
  std::unique_ptr<parallel::Communicator> world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  ModelOptions options = EngineModel();
  absl::StatusOr<Schedule> zbv = MakeSchedule("zbv", 1, 2);
  ASSERT_TRUE(zbv.ok()) << zbv.status();
  const MicroBatchPlan plan = RandomPlan(options, 2, kMicroBatchSize);
  StageExecutor executor(world.get(), kMicroBatchSize);
  GptModel one_chunk(options);
  absl::StatusOr<StageRunResult> run = executor.Run(one_chunk, *zbv, 1, plan, kLossScale);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("runs 2 chunks per stage"), std::string::npos)
      << run.status();
}

// NOTE [early migration] under chunks: a move between the two chunks of one rank (ZB-V on
// one stage) sends nothing; the layer stays in the model and FinishMoves gives the chunks
// the plan's ranges. The next run computes the same loss on the new cut (the same weights:
// no optimizer step), and a plan the model's layers do not fit is refused.
TEST(ChunkExecutorTest, LocalMoveChangesOnlyTheChunkRanges) {
  std::unique_ptr<parallel::Communicator> world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  ModelOptions options = EngineModel();
  options.num_layers = 4;
  absl::StatusOr<Schedule> zbv = MakeSchedule("zbv", 1, 2);
  ASSERT_TRUE(zbv.ok()) << zbv.status();
  const MicroBatchPlan plan = RandomPlan(options, 2, kMicroBatchSize);
  StageExecutor executor(world.get(), kMicroBatchSize);
  const LayerRanges before = EvenVirtualRanges(options.num_layers, 2);  // [0,2) [2,4)
  const LayerRanges after = {{0, 1}, {1, 4}};
  GptModel model(options, ChunkedStage(*zbv, before, 0));
  const std::vector<PlannedMove> moves = MovesBetween(before, after, {0, 0});
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_TRUE(moves[0].local());
  absl::StatusOr<StageRunResult> first = executor.Run(model, *zbv, 1, plan, kLossScale, false, moves);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->migrations.empty()) << "a local move sends nothing";
  EXPECT_EQ(model.layers().size(), 4u) << "the layer stays in the rank's model";
  ASSERT_TRUE(executor.FinishMoves(model, *first, after).ok());
  EXPECT_EQ(model.chunk_range(0), after[0]);
  EXPECT_EQ(model.chunk_range(1), after[1]);
  absl::StatusOr<StageRunResult> second = executor.Run(model, *zbv, 2, plan, kLossScale);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->loss_sum, first->loss_sum);
  // Chunk 1's F ran layers 1..3 now: layer 1's forward belongs to it.
  for (const ActionTiming& t : second->timings) {
    if (t.action.kind != ActionKind::kForward) continue;
    for (const auto& [layer, ms] : t.layer_ms) {
      EXPECT_EQ(t.action.chunk, layer < 1 ? 0 : 1) << t.action.ToString(true) << " layer " << layer;
    }
  }
  // A plan whose ranges the held layers do not fill is named.
  const absl::Status wrong = executor.FinishMoves(model, *second, {{0, 1}, {1, 3}});
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("should hold layers"), std::string::npos) << wrong;
}

TEST(SlowChunkExecutorTest, TwoStagesMatchOneProcess) {
  std::string output;
  const int code = LaunchWorkers(2, "ChunkExecutorWorker.MatchesOneProcess", &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
}

TEST(SlowChunkExecutorTest, FourStagesMatchOneProcess) {
  std::string output;
  const int code = LaunchWorkers(4, "ChunkExecutorWorker.MatchesOneProcess", &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum::pipeline
