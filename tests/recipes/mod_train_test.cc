// The mod plugin (plugins/mod.cc) through the real binaries: it trains and reports the
// tokens its routed layers computed; pp=2 (also with the routed layer migrating), tp=2 and
// dp=2 train the one-process losses (routing is per sequence and replicated over tensor
// parallelism); a resume continues the straight run bit for bit (router and predictor are
// the layer's own parameters).
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

const std::string kModCommon =
    "--recipe=tiny --train_iters=10 --eval_interval=0 --log_interval=5 --global_batch_size=16 "
    "--micro_batch_size=4 --plugins=mod --mod_capacity=0.25" + std::string(testing::kPastWarmup);

TEST(SlowModTrainTest, EveryLayoutTrainsTheOneProcessLosses) {
  testing::PluginTrainRuns runs("mod", kModCommon, 10);
  ASSERT_NO_FATAL_FAILURE(runs.RunOneProcess(/*save_interval=*/5));
  EXPECT_NE(runs.output().find("mod tokens 0.250"), std::string::npos) << runs.output();
  const std::vector<nlohmann::json>& one = runs.one();
  // Layers 1 and 3 are routed: 32 of 128 tokens of each of the 4 sequences.
  EXPECT_EQ(one.back()["mod_tokens"], nlohmann::json::parse(R"({"layers.1":[128,512],"layers.3":[128,512]})"));
  EXPECT_DOUBLE_EQ(one.back()["layer_loads"]["layers.1"].get<double>(), 0.25);
  EXPECT_LT(one.back()["loss"].get<double>(), one.front()["loss"].get<double>()) << "it learns";
  ASSERT_NO_FATAL_FAILURE(runs.ExpectLayoutsTrainTheOneProcessLosses(
      {// Layer 1 (routed) moves to stage 1 in iteration 3 and back in 6.
       {"pp2_migrating", " --pipeline_model_parallel_size=2 --rebalance_script='3:1->1;6:2,2'"},
       {"tp2", " --tensor_model_parallel_size=2"},
       {"dp2", ""}},
      [](const std::string& name, const std::vector<nlohmann::json>& records) {
        if (name == "pp2_migrating") {
          EXPECT_EQ(records.back()["layers_moved"], 2) << "layer 1 moved there and back";
        }
      }));
  // A resume from iteration 5 continues the straight run bit for bit.
  ASSERT_NO_FATAL_FAILURE(runs.ExpectResumeContinuesBitForBit(5));
}

}  // namespace
}  // namespace fulcrum
