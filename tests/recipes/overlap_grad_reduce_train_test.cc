// --overlap_grad_reduce (core/optimizer/overlapped_reduction.h, NOTE [overlapped gradient
// reduction]) in real multi-process runs: against the blocking reduction of the same layout
// (bit for bit where the sums add the same numbers), against one process, with both
// optimizers, under the B/W split with layers moving, with frozen layers, and the issue's
// combined command with its resume in one process. Each run asserts that buckets did start
// during the backward (the metrics' grad_buckets_overlapped).
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/recipes/train_runs.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum {
namespace {

// Small buckets: the tiny model's 14 of them (at pp = 1) start one by one.
constexpr char kOverlap[] = " --overlap_grad_reduce --ddp_bucket_size=20000";

// Untied, clipping off: the tied embedding's two gradient parts are the one sum the
// deferred last weight gradients add in another order (NOTE [overlapped gradient
// reduction]), and the norm sums slices in another order under the distributed optimizer.
std::string OverlapCommon(int iters = 12) {
  return "--recipe=tiny --train_iters=" + std::to_string(iters) +
         " --eval_interval=0 --log_interval=4 --global_batch_size=16 --micro_batch_size=4"
         " --clip_grad=0 --untie_embeddings_and_output_weights" +
         std::string(testing::kPastWarmup);
}

struct OverlapRun {
  std::vector<double> losses;
  std::vector<int64_t> overlapped;  // grad_buckets_overlapped per iteration (-1: absent)
  std::vector<nlohmann::json> records;
};

OverlapRun OverlapTrain(int n, const std::string& args, const std::string& dir, const std::string& name) {
  const std::string metrics = dir + "/" + name + ".jsonl";
  std::string output;
  const int code =
      testing::RunCommand(testing::TrainCommand(n, args + " --metrics_file=" + metrics), &output);
  EXPECT_EQ(code, 0) << output;
  OverlapRun run;
  run.records = testing::MetricsRecords(metrics);
  for (const auto& r : run.records) {
    run.losses.push_back(r["loss"].get<double>());
    run.overlapped.push_back(r.contains("grad_buckets_overlapped")
                                 ? r["grad_buckets_overlapped"].get<int64_t>()
                                 : -1);
  }
  return run;
}

// dp = 2, one stage: every bucket's sum adds the same two numbers as the blocking
// reduction, so the losses equal it bit for bit — with the replicated and with the
// distributed optimizer — and every bucket but the embedding's started early.
TEST(SlowOverlapGradReduceTest, DataParallelTwoEqualsTheBlockingReductionBitForBit) {
  const std::string dir = testing::MakeTempDir("overlap_dp2");
  for (const std::string optimizer : {"", testing::kZero}) {
    const OverlapRun blocking = OverlapTrain(2, OverlapCommon() + optimizer, dir, "blocking" + std::to_string(optimizer.size()));
    const OverlapRun overlapped =
        OverlapTrain(2, OverlapCommon() + optimizer + kOverlap, dir, "overlap" + std::to_string(optimizer.size()));
    ASSERT_EQ(blocking.losses.size(), 12u) << optimizer;
    EXPECT_EQ(overlapped.losses, blocking.losses)
        << optimizer << ": " << testing::MaxRelativeDifference(overlapped.losses, blocking.losses);
    EXPECT_LT(overlapped.losses.back(), overlapped.losses.front() - 1.0) << "it learns";
    ASSERT_EQ(overlapped.overlapped.size(), 12u);
    for (const int64_t started : overlapped.overlapped) EXPECT_GE(started, 10) << optimizer;
    EXPECT_EQ(blocking.overlapped.front(), -1);
    std::cout << (optimizer.empty() ? "AdamW" : "distributed") << ": "
              << overlapped.overlapped.front() << " buckets started during the backward\n";
  }
}

// pp = 2 × dp = 2 under ZB-H1 (the B/W split: a layer's bucket starts after its last W),
// with a scripted plan that moves a layer and then two back: iterations that move reduce at
// the step (the hook cancels), the others overlap; the losses equal the blocking
// reduction's under the same plan bit for bit, and the layers did move.
TEST(SlowOverlapGradReduceTest, PipelineWithLayerMovesEqualsTheBlockingReductionBitForBit) {
  const std::string dir = testing::MakeTempDir("overlap_moves");
  const std::string layout = OverlapCommon() +
                             " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1"
                             " --rebalance_script='3:1->1;7:3,1'";
  for (const std::string optimizer : {"", testing::kZero}) {
    const std::string tag = std::to_string(optimizer.size());
    const OverlapRun blocking = OverlapTrain(4, layout + optimizer, dir, "blocking" + tag);
    const OverlapRun overlapped = OverlapTrain(4, layout + optimizer + kOverlap, dir, "overlap" + tag);
    ASSERT_EQ(overlapped.records.size(), 12u) << optimizer;
    EXPECT_EQ(overlapped.losses, blocking.losses)
        << optimizer << ": " << testing::MaxRelativeDifference(overlapped.losses, blocking.losses);
    EXPECT_EQ(overlapped.records[1]["stage_ranges"].dump(), "[[0,2],[2,4]]");
    EXPECT_EQ(overlapped.records[2]["stage_ranges"].dump(), "[[0,1],[1,4]]");
    EXPECT_EQ(overlapped.records.back()["stage_ranges"].dump(), "[[0,3],[3,4]]");
    // The logging (last) stage: nothing early in the iterations that moved (3 and 7),
    // buckets early in the others.
    EXPECT_EQ(overlapped.overlapped[2], 0) << optimizer;
    EXPECT_EQ(overlapped.overlapped[6], 0) << optimizer;
    EXPECT_GT(overlapped.overlapped[0], 0) << optimizer;
    EXPECT_GT(overlapped.overlapped[10], 0) << optimizer;
  }
}

// Frozen layers (the freeze plugin, replicated optimizer): their parameters leave the
// buckets once frozen on every rank; the losses equal the blocking reduction's.
TEST(SlowOverlapGradReduceTest, FrozenLayersEqualTheBlockingReductionBitForBit) {
  const std::string dir = testing::MakeTempDir("overlap_freeze");
  const std::string args = OverlapCommon() + " --plugins=freeze --freeze_schedule='4:0-1;8:2'";
  const OverlapRun blocking = OverlapTrain(2, args, dir, "blocking");
  const OverlapRun overlapped = OverlapTrain(2, args + kOverlap, dir, "overlap");
  ASSERT_EQ(overlapped.losses.size(), 12u);
  EXPECT_EQ(overlapped.losses, blocking.losses)
      << testing::MaxRelativeDifference(overlapped.losses, blocking.losses);
  // Fewer buckets once layers froze.
  EXPECT_LT(overlapped.overlapped.back(), overlapped.overlapped.front());
  EXPECT_GT(overlapped.overlapped.back(), 0);
}

// The command: tp2 × dp2 with sequence parallelism, the distributed optimizer,
// overlap and full recomputation, saving at 10, follows one process over 20 iterations, and
// one process resuming from its checkpoint continues with the one-process losses.
TEST(SlowOverlapGradReduceTest, AllMemoryFeaturesTogetherFollowOneProcessAndResumeInOne) {
  const std::string dir = testing::MakeTempDir("overlap_all");
  // fp64: tensor parallelism's fp32 rounding depends on the CPU (testing::kFp64).
  const std::string base = "--recipe=tiny --eval_interval=0 --log_interval=10" +
                           std::string(testing::kPastWarmup) + " --lr_decay_iters=30" +
                           testing::kFp64;
  const OverlapRun single = OverlapTrain(1, base + " --train_iters=30", dir, "single");
  ASSERT_EQ(single.losses.size(), 30u);
  const std::string ckpt = dir + "/ck";
  const OverlapRun four = OverlapTrain(4, base + " --tensor_model_parallel_size=2 --sequence_parallel"
                                 " --use_distributed_optimizer --overlap_grad_reduce"
                                 " --ddp_bucket_size=20000 --recompute_granularity=full"
                                 " --save=" + ckpt + " --save_interval=10 --train_iters=20",
                              dir, "four");
  ASSERT_EQ(four.losses.size(), 20u);
  for (const int64_t started : four.overlapped) EXPECT_GT(started, 0);
  const std::vector<double> first20(single.losses.begin(), single.losses.begin() + 20);
  const double worst = testing::MaxRelativeDifference(four.losses, first20);
  EXPECT_LE(worst, testing::kFp64LayoutTolerance);
  const OverlapRun resumed = OverlapTrain(1, base + " --load=" + ckpt + " --train_iters=30", dir, "resumed");
  ASSERT_EQ(resumed.losses.size(), 10u);
  const std::vector<double> last10(single.losses.begin() + 20, single.losses.end());
  const double worst_resumed = testing::MaxRelativeDifference(resumed.losses, last10);
  EXPECT_LE(worst_resumed, testing::kFp64LayoutTolerance);
  std::cout << "tp2 dp2 sp zero overlap recompute vs one process: " << worst
            << "; resumed in one process: " << worst_resumed << "\n";
}

}  // namespace
}  // namespace fulcrum
