// The prune plugin (plugins/prune.cc) through the real binaries: each pruning step leaves
// exactly the schedule's share of the weights at zero, pruned weights stay zero through
// training and resume, the global threshold under tp=2×pp=2 equals one process's on the
// same weights, and the sparse products train what the dense products of the masked
// weights train.
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checkpoint/checkpoint.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// Pruning steps at 4 (target 0), 6 (0.7875) and 8 (0.9): Zhu & Gupta's cubic schedule.
const std::string kPruneCommon =
    "--recipe=tiny --train_iters=12 --eval_interval=0 --log_interval=2 --global_batch_size=16 "
    "--micro_batch_size=4 --plugins=prune --prune_start_iter=4 --prune_end_iter=8 "
    "--prune_interval=2 --prune_final_sparsity=0.9" +
    std::string(testing::kPastWarmup);
const char* kPrunable[] = {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                           "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"};

double Target(int64_t t) { return t < 6 ? 0.0 : t < 8 ? 0.9 - 0.9 * 0.125 : 0.9; }

// The zeros of every prunable weight in a checkpoint, and their number.
std::vector<at::Tensor> Zeros(const std::string& checkpoint, int64_t* count, int64_t* total) {
  auto reader = ckpt::CheckpointReader::Open(checkpoint);
  EXPECT_TRUE(reader.ok()) << reader.status();
  std::vector<at::Tensor> zeros;
  *count = *total = 0;
  for (int layer = 0; layer < 4; ++layer) {
    for (const char* name : kPrunable) {
      auto w = reader->Read("layers." + std::to_string(layer) + "." + name);
      EXPECT_TRUE(w.ok()) << w.status();
      zeros.push_back(w->eq(0));
      *count += zeros.back().sum().item<int64_t>();
      *total += w->numel();
    }
  }
  return zeros;
}

TEST(SlowPruneTrainTest, TheScheduleIsMetExactlyAndPrunedWeightsStayZeroThroughResume) {
  testing::PluginTrainRuns runs("prune", kPruneCommon, 12);
  ASSERT_NO_FATAL_FAILURE(runs.RunOneProcess(/*save_interval=*/2));
  EXPECT_NE(runs.output().find("prune: iteration 6: "), std::string::npos) << runs.output();
  EXPECT_NE(runs.output().find("prune: iteration 8: "), std::string::npos) << runs.output();
  const std::vector<nlohmann::json>& one = runs.one();
  int64_t previous_zeros = 0;
  std::vector<at::Tensor> previous;
  for (int64_t t = 2; t <= 12; t += 2) {
    int64_t zeros = 0, total = 0;
    const std::vector<at::Tensor> now =
        Zeros(runs.checkpoint(static_cast<int>(t)), &zeros, &total);
    // Exactly round(S_t · N) of the N prunable weights are zero after step t.
    EXPECT_EQ(zeros, std::llround(Target(t) * total)) << "iteration " << t;
    EXPECT_NEAR(one[t - 1]["sparsity"].get<double>(), static_cast<double>(zeros) / total, 1e-12);
    // Pruned weights stay zero: every zero of the last checkpoint is still a zero.
    for (size_t i = 0; i < previous.size(); ++i) {
      EXPECT_TRUE(at::equal(previous[i].logical_and(now[i]), previous[i])) << "iteration " << t;
    }
    EXPECT_GE(zeros, previous_zeros);
    previous_zeros = zeros;
    previous = now;
  }
  EXPECT_LT(one.back()["loss"].get<double>(), one.front()["loss"].get<double>()) << "it learns";
  // The layers report their kept fraction as their load.
  EXPECT_NEAR(one.back()["layer_loads"]["layers.0"].get<double>(), 0.1, 0.1);

  // A resume from iteration 6 (pruned once) continues the straight run bit for bit.
  ASSERT_NO_FATAL_FAILURE(runs.ExpectResumeContinuesBitForBit(6, {"sparsity"}));

  // Sparse products train what the dense products of the masked weights train.
  std::string output;
  std::vector<nlohmann::json> dense;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(1, kPruneCommon + " --prune_sparse_compute=false",
                                                  runs.dir() + "/dense.jsonl", &dense, &output));
  const double worst =
      testing::MaxRelativeDifference(testing::LossesOf(dense), testing::LossesOf(one));
  std::cout << "prune: sparse vs dense products, max relative loss difference " << worst << std::endl;
  EXPECT_LE(worst, testing::kLayoutTolerance);
}

// Masks and sparse structures move with their layer: under pp=2, a pruned layer (sparse
// compute on since iteration 6) that moves to the other stage in iteration 7's backward tail
// and back in 9's — pruned again at 8 while away — trains bit for bit as it does staying put.
TEST(SlowPruneTrainTest, APrunedLayerThatMigratesKeepsItsMasksAndTheLosses) {
  const std::string dir = testing::MakeTempDir("prune_migrate");
  const std::string pp2 = kPruneCommon + " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";
  std::string output;
  std::vector<nlohmann::json> still, moved;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(2, pp2, dir + "/still.jsonl", &still, &output));
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(2, pp2 + " --rebalance_script='7:1->1;9:2,2'",
                                                  dir + "/moved.jsonl", &moved, &output));
  ASSERT_EQ(still.size(), 12u);
  ASSERT_EQ(moved.size(), 12u);
  // The moves happened (a record shows the placement after its iteration's moves).
  EXPECT_EQ(moved[6]["stage_ranges"], nlohmann::json::parse("[[0,1],[1,4]]")) << moved[6].dump();
  EXPECT_EQ(moved[8]["stage_ranges"], nlohmann::json::parse("[[0,2],[2,4]]")) << moved[8].dump();
  EXPECT_EQ(moved.back()["layers_moved"], 2);
  for (size_t i = 0; i < still.size(); ++i) {
    EXPECT_EQ(moved[i]["loss"], still[i]["loss"]) << "iteration " << i + 1;
    EXPECT_EQ(moved[i]["sparsity"], still[i]["sparsity"]) << "iteration " << i + 1;
  }
  EXPECT_NEAR(moved.back()["sparsity"].get<double>(), 0.9, 1e-6);
}

// NOTE [global threshold]: pruned on the initial weights (identical in every layout), the
// threshold found over tp=2 × pp=2 — four ranks each holding a quarter of every weight —
// is the one process's, bit for bit, and so are the losses' first values.
TEST(SlowPruneTrainTest, TheGlobalThresholdUnderTensorAndPipelineParallelismIsExact) {
  const std::string dir = testing::MakeTempDir("prune_threshold");
  const std::string flags =
      "--recipe=tiny --train_iters=3 --eval_interval=0 --log_interval=1 --global_batch_size=16 "
      "--micro_batch_size=4 --plugins=prune --prune_start_iter=0 --prune_end_iter=0 "
      "--prune_final_sparsity=0.7";
  std::string output;
  std::vector<nlohmann::json> one, four;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(1, flags, dir + "/one.jsonl", &one, &output));
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(
      4, flags + " --tensor_model_parallel_size=2 --pipeline_model_parallel_size=2",
      dir + "/four.jsonl", &four, &output));
  ASSERT_EQ(one.size(), 3u);
  ASSERT_EQ(four.size(), 3u);
  ASSERT_TRUE(one[0].contains("prune_threshold")) << one[0].dump();
  EXPECT_EQ(one[0]["prune_threshold"], four[0]["prune_threshold"]);
  EXPECT_EQ(one[0]["sparsity"], four[0]["sparsity"]);
  EXPECT_NEAR(one[0]["sparsity"].get<double>(), 0.7, 1e-6);
  EXPECT_LE(testing::MaxRelativeDifference(testing::LossesOf(four), testing::LossesOf(one)),
            testing::kLayoutTolerance);
}

}  // namespace
}  // namespace fulcrum
