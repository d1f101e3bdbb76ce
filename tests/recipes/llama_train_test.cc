// The llama_tiny recipe (RMSNorm, SwiGLU, rope, grouped-query attention, no biases, untied
// head) under the layouts the GPT recipes are held to: tensor parallelism splitting the
// key/value heads, a pipeline whose layers migrate every few iterations (bit-identical to
// the run without moves), and a checkpoint saved after moves resumed in one process — each
// against the single-process loss curve (train_runs.h's tolerance).
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

constexpr int kIters = 12;

std::string LlamaCommon() {
  return "--recipe=llama_tiny --train_iters=12 --eval_interval=0 --log_interval=6 "
         "--global_batch_size=16 --micro_batch_size=4" +
         std::string(testing::kPastWarmup);
}

std::vector<nlohmann::json> RunLlama(int n, const std::string& flags, const std::string& metrics) {
  return testing::TrainRecords(n, LlamaCommon() + " " + flags, metrics);
}

TEST(SlowLlamaTrainTest, LayoutsMatchOneProcess) {
  const std::string dir = testing::MakeTempDir("llama_train");
  const std::vector<double> single = testing::LossesOf(RunLlama(1, "", dir + "/single.jsonl"));
  ASSERT_EQ(single.size(), static_cast<size_t>(kIters));
  EXPECT_LT(single.back(), single.front()) << "it learns";

  // Two key/value heads, one per tensor-parallel rank.
  const std::vector<double> tp2 =
      testing::LossesOf(RunLlama(2, "--tensor_model_parallel_size=2", dir + "/tp2.jsonl"));
  ASSERT_EQ(tp2.size(), static_cast<size_t>(kIters));
  EXPECT_LE(testing::MaxRelativeDifference(tp2, single), testing::kLayoutTolerance);

  const std::string pipeline = "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";
  const std::vector<nlohmann::json> still = RunLlama(2, pipeline, dir + "/still.jsonl");
  const std::string moves = "3:1->1;5:1->0,2->0;9:2->1";
  const std::string ckpt = testing::MakeTempDir("llama_ckpt");
  const std::vector<nlohmann::json> moved =
      RunLlama(2, pipeline + " --rebalance_script='" + moves + "' --save=" + ckpt + " --save_interval=6",
          dir + "/moved.jsonl");
  EXPECT_EQ(testing::LayersMovedOf(moved), testing::ScriptedMovesByIteration(moves, kIters))
      << "the layers moved";
  const std::vector<double> a = testing::LossesOf(still), b = testing::LossesOf(moved);
  ASSERT_EQ(a.size(), static_cast<size_t>(kIters));
  ASSERT_EQ(b.size(), static_cast<size_t>(kIters));
  for (int i = 0; i < kIters; ++i) EXPECT_EQ(a[i], b[i]) << "iteration " << i + 1;
  EXPECT_LE(testing::MaxRelativeDifference(b, single), testing::kLayoutTolerance);

  // Saved at 6 with layers [0,3)|[3,4) (untied head, RMSNorm without biases), resumed in
  // one process.
  const std::vector<double> resumed = testing::LossesOf(
      RunLlama(1, "--load=" + ckpt + "/iter_0000006", dir + "/resumed.jsonl"));
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kIters - 6));
  EXPECT_LE(testing::MaxRelativeDifference(resumed, std::vector<double>(single.begin() + 6, single.end())),
            testing::kLayoutTolerance);

  // Nor can a run with LayerNorm's parameters: the shape check names the flag.
  std::string output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, LlamaCommon() + " --normalization=LayerNorm --load=" + ckpt), &output), 2);
  EXPECT_NE(output.find("(--normalization)"), std::string::npos) << output;
}

TEST(SlowLlamaTrainTest, KeyValueHeadsMustSplitOverTensorParallelRanks) {
  std::string output;
  const int code = testing::RunCommand(
      testing::TrainCommand(2, LlamaCommon() + " --tensor_model_parallel_size=2 --num_query_groups=1"), &output);
  EXPECT_NE(code, 0);
  EXPECT_NE(output.find("--num_query_groups=1 is not divisible by --tensor_model_parallel_size=2"),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("iteration "), std::string::npos) << "no training may start: " << output;
}

}  // namespace
}  // namespace fulcrum
