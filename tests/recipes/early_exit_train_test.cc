// The early_exit plugin (plugins/early_exit.cc) through the real binaries: tokens exit and
// the later layers compute fewer (per-layer loads below 1, the average depth below the
// model's), evaluation reports the average exit depth, and pp=2 (exit decisions crossing
// the stage boundary beside the activation, an exit layer migrating), tp=2 (confidence
// over the vocabulary shards) and dp=2 train the one-process losses.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// The state-saturation confidence makes tokens exit within a few iterations of the tiny
// model (the softmax one needs tens of iterations of training first).
const std::string kEarlyExitCommon =
    "--recipe=tiny --train_iters=10 --eval_interval=10 --eval_iters=1 --log_interval=5 "
    "--global_batch_size=16 --micro_batch_size=4 --plugins=early_exit "
    "--early_exit_confidence=state --early_exit_threshold=0.995" +
    std::string(testing::kPastWarmup);

TEST(SlowEarlyExitTrainTest, TokensExitAndEveryLayoutTrainsTheOneProcessLosses) {
  testing::PluginTrainRuns runs("early_exit", kEarlyExitCommon, 10);
  ASSERT_NO_FATAL_FAILURE(runs.RunOneProcess(/*save_interval=*/5));
  EXPECT_NE(runs.output().find("avg exit layers"), std::string::npos) << runs.output();
  const std::vector<nlohmann::json>& one = runs.one();
  const nlohmann::json& last = one.back();
  EXPECT_LT(last["early_exit_avg_layers"].get<double>(), 4.0) << "tokens exited";
  EXPECT_LT(last["layer_loads"]["layers.3"].get<double>(), 1.0) << "the last layer computed fewer";
  EXPECT_EQ(last["layer_loads"]["layers.0"].get<double>(), 1.0) << "no exit before layer 0";
  EXPECT_TRUE(last.contains("valid_early_exit_avg_layers"));
  EXPECT_LT(last["loss"].get<double>(), one.front()["loss"].get<double>()) << "it learns";
  ASSERT_NO_FATAL_FAILURE(runs.ExpectLayoutsTrainTheOneProcessLosses(
      {// Layer 1 (an exit) moves to stage 1 in iteration 3 and back in 6.
       {"pp2_migrating", " --pipeline_model_parallel_size=2 --rebalance_script='3:1->1;6:2,2'"},
       {"tp2", " --tensor_model_parallel_size=2"},
       {"dp2", ""}},
      [&](const std::string& name, const std::vector<nlohmann::json>& records) {
        EXPECT_EQ(records.back()["early_exit_tokens"], last["early_exit_tokens"]) << name;
        if (name == "pp2_migrating") {
          EXPECT_EQ(records.back()["layers_moved"], 2) << "layer 1 moved there and back";
        }
      }));
  // A resume from iteration 5 continues the straight run bit for bit (the head copies are
  // refreshed from the loaded head).
  ASSERT_NO_FATAL_FAILURE(runs.ExpectResumeContinuesBitForBit(5));
}

}  // namespace
}  // namespace fulcrum
