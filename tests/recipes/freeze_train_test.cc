// The freeze plugin (plugins/freeze.cc) through the real binaries: a scripted schedule
// freezes layers front to back; the frozen weights (and their Adam state) do not change
// any more, their weight-gradient work leaves the timeline (a stage wholly frozen runs
// forward only), pp=2 and dp=2 train the one-process losses, a resume after freezing continues bit for bit; the gradient rule
// freezes front to back within its maximum.
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checkpoint/checkpoint.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

const std::string kFreezeCommon =
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
  testing::PluginTrainRuns runs("freeze", kFreezeCommon + kSchedule, 12);
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
  // NOTE [forward-only stages]: once layers 0 and 1 (all of stage 0, rank 0) are frozen,
  // stage 0 runs its forwards only — no B or W action at all — while stage 1 keeps both.
  int stage0_backward_before = 0, stage0_backward_after = 0, stage1_backward_after = 0;
  for (const auto& e : events) {
    if (!e.contains("args")) continue;
    const std::string kind = e["args"].value("kind", "");
    if (kind == "B" || kind == "W") {
      const int64_t iteration = e["args"].value("iteration", int64_t{0});
      const int rank = e.value("pid", -1);
      if (rank == 0) ++(iteration <= 4 ? stage0_backward_before : stage0_backward_after);
      if (rank == 1 && iteration > 4) ++stage1_backward_after;
    }
    if (kind != "W") continue;
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
  EXPECT_GT(stage0_backward_before, 0) << "stage 0 ran B and W before its layers froze";
  EXPECT_EQ(stage0_backward_after, 0) << "stage 0 runs forward only once all its layers froze";
  EXPECT_GT(stage1_backward_after, 0);

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
      1, kFreezeCommon + " --freeze_interval=2 --freeze_threshold=100 --freeze_max_fraction=0.5",
      dir + "/m.jsonl", &records, &output));
  EXPECT_NE(output.find("freeze: iteration 4: froze layers 0,1 (2 of 4 frozen"), std::string::npos)
      << output;
  ASSERT_EQ(records.size(), 12u);
  EXPECT_EQ(records[2]["frozen_layers"], 0);
  EXPECT_EQ(records.back()["frozen_layers"], 2);
  // A threshold no layer meets freezes nothing.
  std::vector<nlohmann::json> none;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(
      1, kFreezeCommon + " --freeze_interval=2 --freeze_threshold=0", dir + "/none.jsonl", &none,
      &output));
  EXPECT_EQ(none.back()["frozen_layers"], 0);
  // Bad flags are refused before any work, naming the flag.
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, kFreezeCommon + " --freeze_schedule=4:9"), &output), 2);
  EXPECT_NE(output.find("--freeze_schedule: '9' is not a layer"), std::string::npos) << output;
}

// NOTE [forward-only stages] while layers move: pp=4 over 8 layers (two per stage), layers
// 0-5 frozen after iteration 2, so stages 0, 1 and 2 run forward only from iteration 3.
// The script sends a frozen layer off a forward-only stage (4 -> stage 1 in iteration 4:
// after stage 2's last F), a trainable one onto it (6 -> stage 2 in iteration 6: stage 2
// trains again from iteration 7) and a frozen one between two forward-only stages (2 ->
// stage 0 in iteration 8). The losses are the one process's; the timeline shows which
// stages ran a backward. pp=4 on two cores: correctness only.
TEST(SlowFreezeTrainTest, ForwardOnlyStagesSendAndReceiveLayersAndKeepTheLosses) {
  const std::string dir = testing::MakeTempDir("freeze_forward_only");
  const std::string flags =
      "--recipe=tiny --num_layers=8 --train_iters=10 --eval_interval=0 --log_interval=5 "
      "--global_batch_size=16 --micro_batch_size=4 --plugins=freeze --freeze_schedule='2:0-5'" +
      std::string(testing::kPastWarmup);
  const std::string script = "4:4->1;6:6->2;8:2->0";
  std::vector<nlohmann::json> one, pp4;
  std::string output;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(1, flags, dir + "/one.jsonl", &one, &output));
  const std::string timeline = dir + "/t.json";
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(
      4,
      flags + " --pipeline_model_parallel_size=4 --pipeline_schedule=zbh1 --rebalance_script='" +
          script + "' --timeline=" + timeline + " --load_trace=" + dir + "/trace.jsonl",
      dir + "/pp4.jsonl", &pp4, &output));
  // The load trace says which iterations ran with the prefix frozen (fulcrum_sim --trace
  // replays them forward-only): iterations 3.. , not 1 and 2.
  for (const nlohmann::json& line : testing::MetricsRecords(dir + "/trace.jsonl")) {
    const int64_t iteration = line["iteration"].get<int64_t>();
    EXPECT_EQ(line.value("frozen_prefix", int64_t{0}), iteration >= 3 ? 6 : 0)
        << "trace line of iteration " << iteration;
  }
  ASSERT_EQ(one.size(), 10u);
  ASSERT_EQ(pp4.size(), 10u);
  EXPECT_LE(testing::MaxRelativeDifference(testing::LossesOf(pp4), testing::LossesOf(one)),
            testing::kLayoutTolerance);
  EXPECT_EQ(testing::LayersMovedOf(pp4), testing::ScriptedMovesByIteration(script, 10));
  EXPECT_EQ(pp4.back()["frozen_prefix"], 6);

  // Backward actions (B or W) per rank (= stage) and iteration.
  std::map<std::pair<int, int64_t>, int> backward;
  std::ifstream in(timeline);
  ASSERT_TRUE(in.good());
  const nlohmann::json trace = nlohmann::json::parse(in);
  for (const auto& e : trace.is_object() ? trace["traceEvents"] : trace) {
    if (!e.contains("args")) continue;
    const std::string kind = e["args"].value("kind", "");
    if (kind != "B" && kind != "W") continue;
    ++backward[{e.value("pid", -1), e["args"].value("iteration", int64_t{0})}];
  }
  auto ran_backward = [&](int stage, int64_t iteration) {
    return backward.count({stage, iteration}) > 0;
  };
  for (int64_t i = 1; i <= 10; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    const bool frozen = i >= 3;
    EXPECT_EQ(ran_backward(0, i), !frozen);
    EXPECT_EQ(ran_backward(1, i), !frozen);
    // Stage 2 holds layers 4-5, then 5 (iteration 5 on), then 5-6 (iteration 7 on).
    EXPECT_EQ(ran_backward(2, i), !frozen || i >= 7);
    EXPECT_TRUE(ran_backward(3, i)) << "the head's stage always runs its backward";
  }
}

}  // namespace
}  // namespace fulcrum
