// PipelineRunner (pipeline/pipeline_runner.h): what the rebalancer is given (loads of the
// previous iteration, per-layer F/B/W, memory counted by hand), layer moves carried out in
// the backward tail before the optimizer step with bit-identical gradients and losses, and
// data-parallel replicas agreeing on their loads. The multi-process cases run as suite
// PipelineRunnerWorker under fulcrum_launch, started by the SlowPipelineRunnerTest drivers.
#include "pipeline/pipeline_runner.h"

#include <cstring>
#include <sstream>

#include "core/optimizer/adamw.h"
#include "gtest/gtest.h"
#include "parallel/process_groups.h"
#include "parallel/world_communicator.h"
#include "tests/pipeline/engine/engine_test_util.h"

namespace fulcrum::pipeline {
namespace {

using testing::EngineModel;
using testing::IsWorker;
using testing::LaunchWorkers;
using testing::LayerParameters;
using testing::RandomPlan;
using testing::WorldFromEnvironment;
using testing::kMicroBatchSize;
using testing::kLossScale;

// Remembers every Plan call's inputs and returns a fixed script of placements.
class RecordingRebalancer final : public Rebalancer {
 public:
  explicit RecordingRebalancer(std::map<int64_t, LayerRanges> script = {},
                               std::vector<std::vector<StageLoad>>* seen = nullptr)
      : script_(std::move(script)), seen_(seen) {}
  const char* name() const override { return "recording"; }
  RebalanceDecision Plan(int64_t iteration, const std::vector<StageLoad>& loads) override {
    if (seen_ != nullptr) seen_->push_back(loads);
    RebalanceDecision decision;
    auto it = script_.find(iteration);
    if (it != script_.end()) decision.target = it->second;
    return decision;
  }

 private:
  std::map<int64_t, LayerRanges> script_;
  std::vector<std::vector<StageLoad>>* seen_;
};

// Every field of `loads` as doubles, in a fixed order (to compare replicas bit for bit).
std::vector<double> Flatten(const std::vector<StageLoad>& loads) {
  std::vector<double> out;
  for (const StageLoad& l : loads) {
    for (double v : {double(l.stage), double(l.layer_begin), double(l.layer_end), l.forward_ms,
                     l.backward_ms, l.weight_ms, l.wait_ms, l.total_ms, double(l.parameter_bytes),
                     double(l.gradient_bytes), double(l.optimizer_bytes),
                     double(l.peak_activation_bytes)}) {
      out.push_back(v);
    }
    for (const auto* v : {&l.layer_forward_ms, &l.layer_backward_ms, &l.layer_weight_ms}) {
      out.insert(out.end(), v->begin(), v->end());
    }
    for (int64_t b : l.layer_state_bytes) out.push_back(double(b));
    out.insert(out.end(), l.layer_block_load.begin(), l.layer_block_load.end());
  }
  return out;
}

// A block replacing the MLP of odd layers that reports a fixed load of 100 + its layer.
class FixedLoadBlock final : public FeedForward {
 public:
  explicit FixedLoadBlock(int64_t layer) : layer_(layer) {}
  at::Tensor Forward(const at::Tensor& x, const ForwardContext&) override { return x * 0.5; }
  double Load() const override { return 100.0 + static_cast<double>(layer_); }

 private:
  int64_t layer_;
};

// ---- One process ----------------------------------------------------------------------

// Iteration 1's rebalancer sees ranges and memory but no times; iteration 2's sees what
// iteration 1 measured. Memory by hand: 4 bytes a parameter, as much again for its
// gradient, twice as much for the two Adam moments.
TEST(PipelineRunnerTest, LoadsCarryThePreviousIterationAndMemoryCountedByHand) {
  auto world = parallel::CreateWorldCommunicator(parallel::WorldInfo{}, parallel::Backend::kGloo,
                                                 std::chrono::seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  const ModelOptions options = EngineModel();
  GptModel model(options);
  std::vector<std::vector<StageLoad>> seen;
  PipelineRunner runner(world->get(), "zbh1", kMicroBatchSize,
                        std::make_unique<RecordingRebalancer>(std::map<int64_t, LayerRanges>{},
                                                              &seen));
  std::map<int64_t, double> first_forward;  // What iteration 1 measured per layer.
  for (int64_t iteration = 1; iteration <= 2; ++iteration) {
    model.ZeroGrad();
    ASSERT_TRUE(runner.Run(model, iteration, RandomPlan(options, 3, kMicroBatchSize), kLossScale).ok());
    if (iteration == 1) first_forward = runner.last_run().layer_forward_ms;
  }
  ASSERT_EQ(seen.size(), 2u);
  ASSERT_EQ(seen[0].size(), 1u);
  const StageLoad& before = seen[0][0];
  const StageLoad& after = seen[1][0];
  EXPECT_EQ(before.layer_begin, 0);
  EXPECT_EQ(before.layer_end, 4);
  EXPECT_EQ(before.forward_ms, 0.0);
  EXPECT_EQ(before.peak_activation_bytes, 0);
  for (double ms : before.layer_backward_ms) EXPECT_EQ(ms, 0.0);

  const int64_t h = options.hidden_size;
  const int64_t layer = LayerParameters(options);
  const int64_t embedding = options.vocab_size * h + options.seq_length * h;  // words, positions
  const int64_t head = 2 * h + options.vocab_size * h;  // final norm, untied output layer
  const int64_t total = embedding + options.num_layers * layer + head;
  ASSERT_EQ(total, model.NumParameterElements()) << "the hand count misses a parameter";
  for (const StageLoad* load : {&before, &after}) {
    EXPECT_EQ(load->parameter_bytes, 4 * total);
    EXPECT_EQ(load->gradient_bytes, 4 * total);
    EXPECT_EQ(load->optimizer_bytes, 8 * total);
    ASSERT_EQ(load->layer_state_bytes.size(), 4u);
    for (int64_t bytes : load->layer_state_bytes) EXPECT_EQ(bytes, 16 * layer);
  }

  EXPECT_GT(after.forward_ms, 0.0);
  EXPECT_GT(after.backward_ms, 0.0);
  EXPECT_GT(after.weight_ms, 0.0);
  EXPECT_GT(after.peak_activation_bytes, 0);
  ASSERT_EQ(after.layer_weight_ms.size(), 4u);
  double layers_b = 0, layers_w = 0;
  for (int i = 0; i < 4; ++i) {
    EXPECT_GT(after.layer_forward_ms[i], 0.0);
    EXPECT_GT(after.layer_backward_ms[i], 0.0);
    EXPECT_GT(after.layer_weight_ms[i], 0.0);
    layers_b += after.layer_backward_ms[i];
    layers_w += after.layer_weight_ms[i];
  }
  EXPECT_LE(layers_b, after.backward_ms);
  EXPECT_LE(layers_w, after.weight_ms);
  // What the rebalancer saw in iteration 2 is what the executor measured in iteration 1.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(after.layer_forward_ms[i], first_forward.at(i));
}

// Layers whose FeedForward reports a load (an MoE layer's expert rows) show it in
// StageLoad::layer_block_load; dense layers show 0.
TEST(PipelineRunnerTest, LoadsCarryEachBlocksOwnLoad) {
  auto world = parallel::CreateWorldCommunicator(parallel::WorldInfo{}, parallel::Backend::kGloo,
                                                 std::chrono::seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  const ModelOptions options = EngineModel();
  FeedForwardFactory odd_layers = [](int64_t layer, Unit&, bool) -> std::unique_ptr<FeedForward> {
    if (layer % 2 == 0) return nullptr;
    return std::make_unique<FixedLoadBlock>(layer);
  };
  GptModel model(options, StageSpec(), nullptr, odd_layers);
  std::vector<std::vector<StageLoad>> seen;
  PipelineRunner runner(world->get(), "zbh1", kMicroBatchSize,
                        std::make_unique<RecordingRebalancer>(std::map<int64_t, LayerRanges>{},
                                                              &seen));
  ASSERT_TRUE(runner.Run(model, 1, RandomPlan(options, 2, kMicroBatchSize), kLossScale).ok());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0][0].layer_block_load, (std::vector<double>{0, 101, 0, 103}));
}

// ---- Several processes ----------------------------------------------------------------

// Trains `iterations` steps of a pp-stage pipeline (this rank's stage of `world`) with the
// given script, AdamW after every Run, and returns the losses; `model` is left as trained.
std::vector<double> Train(parallel::Communicator* pp, GptModel& model, const std::string& schedule,
                          std::map<int64_t, LayerRanges> script, int iterations,
                          std::vector<StageRunResult>* runs = nullptr) {
  PipelineRunner runner(pp, schedule, kMicroBatchSize,
                        std::make_unique<RecordingRebalancer>(std::move(script)));
  OptimizerOptions adam;
  adam.lr = 1e-2;
  AdamW optimizer(adam);
  std::vector<double> losses;
  for (int64_t iteration = 1; iteration <= iterations; ++iteration) {
    model.ZeroGrad();
    auto loss = runner.Run(model, iteration, RandomPlan(model.options(), 4, kMicroBatchSize, 8 * iteration),
                           kLossScale);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (!loss.ok()) return losses;
    losses.push_back(loss->first);
    if (runs != nullptr) runs->push_back(runner.last_run());
    if (iteration < iterations) optimizer.Step(model.Units(), 1e-2);
  }
  return losses;
}

// The gradients of layer `layer` (concatenated, in parameter order), or undefined when
// `model` does not hold it.
at::Tensor LayerGradients(const GptModel& model, int64_t layer) {
  auto it = model.layers().find(layer);
  if (it == model.layers().end()) return at::Tensor();
  std::vector<at::Tensor> grads;
  for (const Parameter& p : it->second->parameters()) grads.push_back(p.value.grad().reshape({-1}));
  return at::cat(grads).contiguous();
}

// NOTE [early migration]: under each schedule, a plan for iteration 2 — stage 0's last layer
// forward; stage 1's first layer back — is carried out inside that iteration's Run: the
// layout has changed when Run returns, before the optimizer step, and the sender posts in
// its last backward action. The losses of every iteration, before and after the moves, and
// the final gradients of every layer equal those of the run without moves, bit for bit.
// (Moves over several stages at once are tested through fulcrum_train at pp=4.)
TEST(PipelineRunnerWorker, EarlyMigration) {
  if (!IsWorker()) GTEST_SKIP() << "runs under fulcrum_launch, started by SlowPipelineRunnerTest";
  std::unique_ptr<parallel::Communicator> pp = WorldFromEnvironment();
  ASSERT_NE(pp, nullptr);
  ASSERT_EQ(pp->size(), 2);
  const int stage = pp->rank();
  const ModelOptions options = EngineModel();
  constexpr int kIterations = 3;
  const LayerRanges initial = {{0, 2}, {2, 4}};
  const std::vector<LayerRanges> plans = {{{0, 1}, {1, 4}}, {{0, 3}, {3, 4}}};
  for (const std::string schedule : {"1f1b", "zbh1", "zbh2"}) {
    for (const LayerRanges& plan : plans) {
      SCOPED_TRACE(schedule + ": " + FormatRanges(initial) + " -> " + FormatRanges(plan));
      GptModel still(options, EvenStage(options.num_layers, 2, stage));
      const std::vector<double> expected = Train(pp.get(), still, schedule, {}, kIterations);
      GptModel moved(options, EvenStage(options.num_layers, 2, stage));
      std::vector<StageRunResult> runs;
      const std::vector<double> losses = Train(pp.get(), moved, schedule, {{2, plan}}, kIterations, &runs);
      ASSERT_EQ(losses.size(), expected.size());
      for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], expected[i]) << "iteration " << i + 1;

      // The move happened.
      EXPECT_EQ(moved.layer_begin(), plan[stage].first);
      EXPECT_EQ(moved.layer_end(), plan[stage].second);
      ASSERT_EQ(runs.size(), static_cast<size_t>(kIterations));
      EXPECT_TRUE(runs[0].migrations.empty());
      EXPECT_TRUE(runs[2].migrations.empty());
      const std::vector<PlannedMove> moves = MovesBetween(initial, plan);
      ASSERT_EQ(moves.size(), 1u);
      // Both stages take part in the move.
      ASSERT_EQ(runs[1].migrations.size(), 1u);
      const MigrationTiming& m = runs[1].migrations[0];
      EXPECT_EQ(m.layer, moves[0].layer);
      EXPECT_EQ(m.sent, stage == moves[0].from_stage);
      if (m.sent) {
        EXPECT_TRUE(m.early) << "the sender posts in its last backward action";
        const ActionTiming& last = runs[1].timings.back();
        EXPECT_GE(m.start_ms, last.start_ms);
        EXPECT_LE(m.end_ms, last.end_ms);
        EXPECT_GT(last.migration_ms, 0.0);
      }
      for (const MigrationTiming& t : runs[1].migrations) EXPECT_GT(t.bytes, 0);

      // Iteration 3 ran on the new layout; every layer's gradients equal the still run's,
      // wherever each run holds it.
      for (int64_t layer = 0; layer < options.num_layers; ++layer) {
        SCOPED_TRACE("layer " + std::to_string(layer));
        const at::Tensor here = LayerGradients(moved, layer);
        const at::Tensor reference = LayerGradients(still, layer);
        if (here.defined() && reference.defined()) {
          EXPECT_TRUE(at::equal(here, reference));
        } else if (reference.defined()) {
          pp->Send(reference, 1 - stage, 7);
        } else if (here.defined()) {
          at::Tensor theirs = at::empty_like(here);
          pp->Recv(theirs, 1 - stage, 7);
          EXPECT_TRUE(at::equal(here, theirs));
        }
      }
    }
  }
  pp->Barrier();
}

// NOTE [when the plan is made]: two data-parallel replicas of a two-stage pipeline measure
// different times (different data, different processes); their rebalancers must see the
// same loads, bit for bit.
TEST(PipelineRunnerWorker, DataParallelReplicasAgreeOnLoads) {
  if (!IsWorker()) GTEST_SKIP() << "runs under fulcrum_launch, started by SlowPipelineRunnerTest";
  std::unique_ptr<parallel::Communicator> world = WorldFromEnvironment();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 4);
  parallel::ParallelConfig config;
  config.world_size = 4;
  config.pp = 2;
  auto context = parallel::ProcessGroupContext::Create(std::move(world), config,
                                                       /*tie_embeddings=*/false);
  ASSERT_TRUE(context.ok()) << context.status();
  parallel::ProcessGroupContext& ctx = **context;
  parallel::Communicator& dp = ctx.group(parallel::GroupKind::kData);
  ASSERT_EQ(dp.size(), 2);
  const ModelOptions options = EngineModel();
  GptModel model(options, EvenStage(options.num_layers, 2, ctx.coords().pp));
  std::vector<std::vector<StageLoad>> seen;
  PipelineRunner runner(&ctx.group(parallel::GroupKind::kPipeline), "zbh1", kMicroBatchSize,
                        std::make_unique<RecordingRebalancer>(
                            std::map<int64_t, LayerRanges>{{3, LayerRanges{{0, 1}, {1, 4}}}}, &seen),
                        {&ctx.group(parallel::GroupKind::kTensor), &dp});
  constexpr int kIterations = 4;
  std::vector<double> own_forward;  // This replica's own measurement, before agreeing.
  for (int64_t iteration = 1; iteration <= kIterations; ++iteration) {
    model.ZeroGrad();
    auto loss = runner.Run(model, iteration,
                           RandomPlan(options, 3, kMicroBatchSize, 100 * ctx.coords().dp + 10 * iteration),
                           kLossScale);
    ASSERT_TRUE(loss.ok()) << loss.status();
    double f = 0;
    for (const auto& [layer, ms] : runner.last_run().layer_forward_ms) f += ms;
    own_forward.push_back(f);
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kIterations));
  EXPECT_EQ(model.layer_begin(), ctx.coords().pp == 0 ? 0 : 1) << "both replicas moved layer 1";
  std::vector<double> flat;
  for (const auto& loads : seen) {
    const std::vector<double> f = Flatten(loads);
    flat.insert(flat.end(), f.begin(), f.end());
  }
  const at::Tensor mine = at::tensor(flat, at::kDouble);
  const at::Tensor sizes = dp.AllGather(at::tensor({mine.numel()}, at::kLong));
  ASSERT_EQ(sizes[0].item<int64_t>(), sizes[1].item<int64_t>());
  const at::Tensor both = dp.AllGather(mine.unsqueeze(0));
  EXPECT_TRUE(at::equal(both[0], both[1])) << "the replicas' rebalancers saw different loads";
  // Without agreeing, the replicas' inputs differ (or this test would prove nothing).
  {
    GptModel alone(options, EvenStage(options.num_layers, 2, ctx.coords().pp));
    std::vector<std::vector<StageLoad>> own;
    PipelineRunner disagreeing(&ctx.group(parallel::GroupKind::kPipeline), "zbh1", kMicroBatchSize,
                               std::make_unique<RecordingRebalancer>(
                                   std::map<int64_t, LayerRanges>{}, &own));
    for (int64_t iteration = 1; iteration <= 2; ++iteration) {
      alone.ZeroGrad();
      ASSERT_TRUE(disagreeing
                      .Run(alone, iteration,
                           RandomPlan(options, 3, kMicroBatchSize, 100 * ctx.coords().dp + 10 * iteration),
                           kLossScale)
                      .ok());
    }
    const at::Tensor raw = dp.AllGather(at::tensor(Flatten(own[1]), at::kDouble).unsqueeze(0));
    EXPECT_FALSE(at::equal(raw[0], raw[1])) << "two replicas measured identical times";
  }
  // The raw measurements did differ: report them.
  const at::Tensor raw = dp.AllGather(at::tensor(own_forward, at::kDouble).unsqueeze(0));
  std::ostringstream text;
  text << "rank " << ctx.roles().world_rank << " own per-layer F sums per iteration: " << raw;
  std::cout << text.str() << std::endl;
  ctx.Barrier();
}

// A rebalancer that decides differently on one data-parallel replica (a bug: it must decide
// from the agreed loads alone) is caught before any layer moves: every rank's Run fails
// naming the rank that planned otherwise.
TEST(PipelineRunnerWorker, ReplicasThatPlanDifferentlyAreRefused) {
  if (!IsWorker()) GTEST_SKIP() << "runs under fulcrum_launch, started by SlowPipelineRunnerTest";
  std::unique_ptr<parallel::Communicator> world = WorldFromEnvironment();
  ASSERT_NE(world, nullptr);
  ASSERT_EQ(world->size(), 4);
  parallel::ParallelConfig config;
  config.world_size = 4;
  config.pp = 2;
  auto context = parallel::ProcessGroupContext::Create(std::move(world), config,
                                                       /*tie_embeddings=*/false);
  ASSERT_TRUE(context.ok()) << context.status();
  parallel::ProcessGroupContext& ctx = **context;
  const ModelOptions options = EngineModel();
  GptModel model(options, EvenStage(options.num_layers, 2, ctx.coords().pp));
  std::map<int64_t, LayerRanges> script;
  if (ctx.coords().dp == 1) script[2] = {{0, 1}, {1, 4}};
  PipelineRunner runner(&ctx.group(parallel::GroupKind::kPipeline), "zbh1", kMicroBatchSize,
                        std::make_unique<RecordingRebalancer>(script),
                        {&ctx.group(parallel::GroupKind::kTensor),
                         &ctx.group(parallel::GroupKind::kData)});
  ASSERT_TRUE(runner.Run(model, 1, RandomPlan(options, 3, kMicroBatchSize), kLossScale).ok());
  auto second = runner.Run(model, 2, RandomPlan(options, 3, kMicroBatchSize), kLossScale);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("the replica ranks do not agree on the rebalancer's plan: "
                                           "ranks 1 of that group"),
            std::string::npos)
      << second.status();
  EXPECT_TRUE(model.CheckRange(ctx.coords().pp == 0 ? 0 : 2, ctx.coords().pp == 0 ? 2 : 4).ok())
      << "nothing moved";
  ctx.Barrier();
}

TEST(SlowPipelineRunnerTest, ReplicasThatPlanDifferentlyAreRefused) {
  std::string output;
  const int code = LaunchWorkers(4, "PipelineRunnerWorker.ReplicasThatPlanDifferentlyAreRefused", &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
}

TEST(SlowPipelineRunnerTest, EarlyMigrationUnderEverySchedule) {
  std::string output;
  const int code = LaunchWorkers(2, "PipelineRunnerWorker.EarlyMigration", &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
  EXPECT_EQ(output.find("unknown size"), std::string::npos) << "c10 memory reporter warned:\n" << output;
}

TEST(SlowPipelineRunnerTest, DataParallelReplicasGetIdenticalLoads) {
  std::string output;
  const int code = LaunchWorkers(4, "PipelineRunnerWorker.DataParallelReplicasAgreeOnLoads", &output);
  EXPECT_EQ(code, 0) << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum::pipeline
