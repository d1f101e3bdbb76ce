// The freeze plugin (plugins/freeze.cc) through the real binaries: a scripted schedule
// freezes layers front to back; the frozen weights (and their Adam state) do not change
// any more, their weight-gradient work leaves the timeline, pp=2 and dp=2 train the
// one-process losses, a resume after freezing continues bit for bit; the gradient rule
// freezes front to back within its maximum.
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checkpoint/checkpoint.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

const std::string kCommon =
    "--recipe=tiny --train_iters=12 --eval_interval=0 --log_interval=4 --global_batch_size=16 "
    "--micro_batch_size=4 --plugins=freeze" + std::string(testing::kPastWarmup);
// Layers 0 and 1 freeze after iteration 4's step, layer 2 after iteration 8's.
const std::string kSchedule = " --freeze_schedule='4:0-1;8:2'";

at::Tensor Read(const std::string& checkpoint, const std::string& name) {
  auto reader = ckpt::CheckpointReader::Open(checkpoint);
  EXPECT_TRUE(reader.ok()) << reader.status();
  auto tensor = reader->Read(name);
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return *tensor;
}

TEST(SlowFreezeTrainTest, ScheduledFreezingIsExactUnderEveryLayoutAndResume) {
  testing::PluginTrainRuns runs("freeze", kCommon + kSchedule, 12);
  ASSERT_NO_FATAL_FAILURE(runs.RunOneProcess(/*save_interval=*/4));
  const std::string& output = runs.output();
  EXPECT_NE(output.find("freeze: iteration 4: froze layers 0,1"), std::string::npos) << output;
  EXPECT_NE(output.find("freeze: iteration 8: froze layers 2"), std::string::npos) << output;
  const std::vector<nlohmann::json>& one = runs.one();
  for (size_t i = 0; i < one.size(); ++i) {
    const int64_t expected = i + 1 < 4 ? 0 : i + 1 < 8 ? 2 : 3;
    EXPECT_EQ(one[i]["frozen_layers"], expected) << "iteration " << i + 1;
    EXPECT_EQ(one[i]["frozen_prefix"], expected) << "iteration " << i + 1;
  }
  EXPECT_LT(one.back()["loss"].get<double>(), one.front()["loss"].get<double>()) << "it learns";

  // Frozen weights, their Adam moments and the frozen embedding lookup stay bit-unchanged;
  // the layer still training changes.
  const std::string at4 = runs.checkpoint(4), at8 = runs.checkpoint(8),
                    at12 = runs.checkpoint(12);
  for (const std::string name :
       {"layers.0.self_attention.linear_qkv.weight", "layers.1.mlp.linear_fc2.weight",
        "optimizer.layers.1.mlp.linear_fc1.weight.exp_avg", "embedding.position_embeddings.weight"}) {
    EXPECT_TRUE(at::equal(Read(at4, name), Read(at12, name))) << name;
  }
  EXPECT_TRUE(at::equal(Read(at8, "layers.2.mlp.linear_fc1.weight"),
                        Read(at12, "layers.2.mlp.linear_fc1.weight")));
  EXPECT_FALSE(at::equal(Read(at4, "layers.2.mlp.linear_fc1.weight"),
                         Read(at8, "layers.2.mlp.linear_fc1.weight")))
      << "layer 2 trained until iteration 8";
  EXPECT_FALSE(at::equal(Read(at8, "layers.3.mlp.linear_fc1.weight"),
                         Read(at12, "layers.3.mlp.linear_fc1.weight")))
      << "layer 3 never froze";

  // pp=2 (with a timeline) and dp=2 train the same losses.
  const std::string timeline = runs.dir() + "/t.json";
  ASSERT_NO_FATAL_FAILURE(runs.ExpectLayoutsTrainTheOneProcessLosses(
      {{"pp2", " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1 --timeline=" + timeline},
       {"dp2", ""}},
      [&](const std::string& name, const std::vector<nlohmann::json>& records) {
        for (size_t i = 0; i < records.size(); ++i) {
          EXPECT_EQ(records[i]["frozen_layers"], one[i]["frozen_layers"]) << name << " " << i + 1;
        }
      }));
  // The frozen layers' weight-gradient work is gone from the timeline after their freeze.
  std::ifstream in(timeline);
  ASSERT_TRUE(in.good());
  const nlohmann::json trace = nlohmann::json::parse(in);
  const nlohmann::json& events = trace.is_object() ? trace["traceEvents"] : trace;
  int w_before = 0, w_after = 0;
  for (const auto& e : events) {
    if (!e.contains("args") || e["args"].value("kind", "") != "W") continue;
    const int64_t iteration = e["args"].value("iteration", int64_t{0});
    const bool layer0 = e["args"].contains("layers.0 ms");
    if (iteration <= 4 && layer0) ++w_before;
    if (iteration > 4) {
      ++w_after;
      EXPECT_FALSE(layer0) << e.dump();
      EXPECT_FALSE(e["args"].contains("layers.1 ms")) << e.dump();
    }
  }
  EXPECT_GT(w_before, 0) << "layer 0 did weight-gradient work before it froze";
  EXPECT_GT(w_after, 0) << "W actions of the trainable layers remain";

  // A resume after the freezes continues the straight run bit for bit, frozen.
  std::vector<nlohmann::json> after;
  ASSERT_NO_FATAL_FAILURE(after = runs.ExpectResumeContinuesBitForBit(8));
  for (const nlohmann::json& record : after) EXPECT_EQ(record["frozen_layers"], 3);
}

TEST(SlowFreezeTrainTest, TheGradientRuleFreezesFrontToBackWithinItsMaximum) {
  const std::string dir = testing::MakeTempDir("freeze_rule");
  std::string output;
  // A threshold every layer meets: the first comparison (iteration 4, two intervals of 2)
  // freezes from the front until half the layers are frozen, and nothing more after.
  std::vector<nlohmann::json> records;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(
      1, kCommon + " --freeze_interval=2 --freeze_threshold=100 --freeze_max_fraction=0.5",
      dir + "/m.jsonl", &records, &output));
  EXPECT_NE(output.find("freeze: iteration 4: froze layers 0,1 (2 of 4 frozen"), std::string::npos)
      << output;
  ASSERT_EQ(records.size(), 12u);
  EXPECT_EQ(records[2]["frozen_layers"], 0);
  EXPECT_EQ(records.back()["frozen_layers"], 2);
  // A threshold no layer meets freezes nothing.
  std::vector<nlohmann::json> none;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(
      1, kCommon + " --freeze_interval=2 --freeze_threshold=0", dir + "/none.jsonl", &none,
      &output));
  EXPECT_EQ(none.back()["frozen_layers"], 0);
  // Bad flags are refused before any work, naming the flag.
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, kCommon + " --freeze_schedule=4:9"), &output), 2);
  EXPECT_NE(output.find("--freeze_schedule: '9' is not a layer"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum
