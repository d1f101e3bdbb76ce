// Re-packing through the real binaries (dynamic/repack.h, pipeline/shrink.h,
// recipes/relaunch_protocol.h): a forced shrink pp=4 → pp=2 after iteration 6, live and
// through a checkpoint, pp=2×dp=2 → pp=1×dp=2 live, and live with the moe and early_exit
// plugins, tp=2 and ep=2, and under ZB-V and interleaved 1F1B (virtual stages merged chunk by
// chunk), each trains the losses of the run that never shrinks; the
// released ranks exit 0, the launcher exits 0 and says who was released; a checkpoint
// written after a shrink resumes under another layout.
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

constexpr int kRepackIterations = 12;
constexpr int kShrinkAfter = 6;

std::string RepackCommon() {
  return "--recipe=tiny --train_iters=12 --eval_interval=0 --log_interval=3";
}

int CountOf(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

class SlowRepackTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { dir_ = new std::string(testing::MakeTempDir("repack_train")); }

  // Trains under `n` processes with `flags` (after RepackCommon(), whose flags they may override:
  // the last value of a flag counts); the metrics records.
  std::vector<nlohmann::json> Train(int n, const std::string& name, const std::string& flags,
                                    std::string* output) {
    const std::string metrics = *dir_ + "/" + name + ".jsonl";
    const int code = testing::RunCommand(
        testing::TrainCommand(n, RepackCommon() + " " + flags + " --metrics_file=" + metrics), output);
    EXPECT_EQ(code, 0) << *output;
    return testing::MetricsRecords(metrics);
  }

  // The shrink happened after iteration kShrinkAfter: the layout fields change there.
  static void ExpectShrunk(const std::vector<nlohmann::json>& records, int pp_before,
                           int pp_after, int ranks_before, int ranks_after) {
    ASSERT_EQ(records.size(), static_cast<size_t>(kRepackIterations)) << "one record per iteration";
    for (int i = 0; i < kRepackIterations; ++i) {
      SCOPED_TRACE(::testing::Message() << "iteration " << i + 1);
      EXPECT_EQ(records[i]["iteration"], i + 1);
      const bool before = i < kShrinkAfter;
      EXPECT_EQ(records[i]["pipeline_size"], before ? pp_before : pp_after);
      EXPECT_EQ(records[i]["active_ranks"], before ? ranks_before : ranks_after);
    }
  }

  static void ExpectSameLosses(const std::vector<nlohmann::json>& a,
                               const std::vector<nlohmann::json>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      // Bit for bit. (The gradient norm's sum over the stages runs in another order on
      // fewer stages, so grad_norm may differ in its last bits.)
      EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "iteration " << i + 1;
    }
  }

  // A run on `layout` that never shrinks and the same run shrunk live from `pp_before` to
  // `pp_after` stages after iteration kShrinkAfter, on four ranks (two released): the shrink
  // happened (metrics, log lines) and the losses are bit-identical. Returns {still, live}
  // for the caller's own checks.
  std::pair<std::vector<nlohmann::json>, std::vector<nlohmann::json>> ExpectLiveShrinkKeepsTheLosses(
      const std::string& name, const std::string& layout, int pp_before, int pp_after) {
    std::string output;
    std::vector<nlohmann::json> still = Train(4, name, layout, &output);
    std::vector<nlohmann::json> live =
        Train(4, name + "_live",
              absl::StrCat(layout, " --repack_script=", kShrinkAfter, ":", pp_after), &output);
    ExpectShrunk(live, pp_before, pp_after, 4, 2);
    EXPECT_NE(output.find(absl::StrCat("re-packed live after iteration ", kShrinkAfter, ": ",
                                       pp_before, " → ", pp_after, " pipeline stages")),
              std::string::npos)
        << output;
    EXPECT_EQ(CountOf(output, "was released by re-packing and exited 0"), 2) << output;
    ExpectSameLosses(live, still);
    return {std::move(still), std::move(live)};
  }

  static std::string* dir_;
};
std::string* SlowRepackTrainTest::dir_ = nullptr;

TEST_F(SlowRepackTrainTest, Pp4ToPp2LiveAndThroughACheckpointKeepTheLosses) {
  std::string output;
  const std::vector<nlohmann::json> still =
      Train(4, "pp4", "--pipeline_model_parallel_size=4", &output);
  ASSERT_EQ(still.size(), static_cast<size_t>(kRepackIterations));

  // Live: ranks 1 and 3 (stages 1 and 3) hand their layers and the head over and exit 0.
  const std::string trace = *dir_ + "/pp4_live_trace.jsonl";
  const std::vector<nlohmann::json> live =
      Train(4, "pp4_live",
            "--pipeline_model_parallel_size=4 --repack_script=6:2 --load_trace=" + trace, &output);
  ExpectShrunk(live, 4, 2, 4, 2);
  // The load trace follows the logging rank to the shrunk pipeline's last stage: a line per
  // iteration on 4 stages, then on 2 (iteration 6's measurement, on the layout re-packing
  // replaced, has none; the run's last iteration never has one, NOTE [load trace lines]).
  const std::vector<nlohmann::json> lines = testing::MetricsRecords(trace);
  std::vector<int> iterations, stages;
  for (const nlohmann::json& line : lines) {
    iterations.push_back(line["iteration"].get<int>());
    stages.push_back(static_cast<int>(line["ran_on"].size()));
  }
  EXPECT_EQ(iterations, (std::vector<int>{1, 2, 3, 4, 5, 7, 8, 9, 10, 11}));
  EXPECT_EQ(stages, (std::vector<int>{4, 4, 4, 4, 4, 2, 2, 2, 2, 2}));
  EXPECT_EQ(CountOf(output, "released after iteration 6: the pipeline shrank from 4 to 2 stages"),
            2)
      << output;
  EXPECT_NE(output.find("rank 1 (pid"), std::string::npos) << output;
  EXPECT_EQ(CountOf(output, "was released by re-packing and exited 0"), 2) << output;
  EXPECT_NE(output.find("every rank exited 0; 2 of 4 were released early by re-packing"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("re-packed live after iteration 6: 4 → 2 pipeline stages"),
            std::string::npos)
      << output;
  ExpectSameLosses(live, still);

  // Through a checkpoint: exit code 75, the launcher relaunches two ranks with pp=2.
  const std::string save = *dir_ + "/ckpt_pp4";
  const std::vector<nlohmann::json> relaunched =
      Train(4, "pp4_ckpt",
            "--pipeline_model_parallel_size=4 --repack_script=6:2 --repack_via_checkpoint "
            "--save=" + save,
            &output);
  ExpectShrunk(relaunched, 4, 2, 4, 2);
  EXPECT_NE(output.find("exited with code 75: the job asks for a relaunch"), std::string::npos)
      << output;
  EXPECT_NE(output.find("re-packing through a checkpoint: 2 ranks released, relaunching 2 with "
                        "--pipeline_model_parallel_size=2 --load=" + save),
            std::string::npos)
      << output;
  ExpectSameLosses(relaunched, still);

  // Resume after the shrink under another layout: the checkpoint of iteration 6 (written
  // on pp=4) and of iteration 12 (on pp=2) both load into one process.
  const std::vector<nlohmann::json> resumed =
      Train(1, "resumed_single", "--load=" + save + "/iter_0000006", &output);
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kRepackIterations - kShrinkAfter)) << output;
  for (size_t i = 0; i < resumed.size(); ++i) {
    // One process sums in another order than a pipeline: equal to rounding.
    EXPECT_NEAR(resumed[i]["loss"].get<double>(), still[i + kShrinkAfter]["loss"].get<double>(),
                1e-5 * still[i + kShrinkAfter]["loss"].get<double>());
  }
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, RepackCommon() + " --train_iters=13 --load=" +
                                                             save + "/iter_0000012"),
                                &output),
            0)
      << output;
}

TEST_F(SlowRepackTrainTest, Pp2TimesDp2ToPp1TimesDp2ShrinksEveryReplicaAlike) {
  std::string output;
  // Untied embeddings: on one stage a tied output weight sums its two gradient halves in
  // autograd's order, on two the embedding group sums them, so a tied model would agree to
  // rounding only (about 3e-8 here), not bit for bit.
  const std::string layout = "--pipeline_model_parallel_size=2 --global_batch_size=16 "
                             "--micro_batch_size=4 --untie_embeddings_and_output_weights";
  const std::vector<nlohmann::json> still = Train(4, "pp2dp2", layout, &output);
  ASSERT_EQ(still.size(), static_cast<size_t>(kRepackIterations));
  const std::vector<nlohmann::json> live =
      Train(4, "pp2dp2_live", layout + " --repack_script=6:1", &output);
  ExpectShrunk(live, 2, 1, 4, 2);
  // Both replicas' second stages (ranks 2 and 3) are released.
  EXPECT_EQ(CountOf(output, "released after iteration 6: the pipeline shrank from 2 to 1 stages"),
            2)
      << output;
  EXPECT_EQ(CountOf(output, "was released by re-packing and exited 0"), 2) << output;
  ExpectSameLosses(live, still);
}

// Live shrinks of the plugins that talk to the process groups and of tp/ep layouts (NOTE
// [live shrink], NOTE [plugin doors]): the run that shrinks after iteration 6 trains the
// losses of the run that never shrinks, bit for bit.

// The MoE layers are rebuilt on the survivors' groups (OnLayout): tiny_moe, whose layers 0
// and 2 are MoE, pp=4 → 2.
TEST_F(SlowRepackTrainTest, MoePp4ToPp2LiveKeepsTheLosses) {
  ExpectLiveShrinkKeepsTheLosses("moe_pp4", "--recipe=tiny_moe --pipeline_model_parallel_size=4",
                                 4, 2);
}

// Early exit's head copy is summed over the survivors' pipeline: exit heads after layers 0
// and 2, one in each half, pp=4 → 2 (stages 0+1 and 2+3 merge). Tokens exit at layer 2
// from iteration 5 on, so the later iterations compute layer 3 on fewer tokens.
TEST_F(SlowRepackTrainTest, EarlyExitPp4ToPp2LiveKeepsTheLosses) {
  const auto [still, live] = ExpectLiveShrinkKeepsTheLosses(
      "exit_pp4",
      "--pipeline_model_parallel_size=4 --micro_batch_size=4 --plugins=early_exit "
      "--early_exit_layers=0,2 --early_exit_confidence=state --early_exit_threshold=0.99 "
      "--lr_warmup_iters=2",
      4, 2);
  ASSERT_EQ(still.size(), static_cast<size_t>(kRepackIterations));
  EXPECT_LT(still.back()["early_exit_avg_layers"].get<double>(), 4.0) << "tokens exited";
  for (int i = kShrinkAfter; i < kRepackIterations; ++i) {
    EXPECT_EQ(live[i]["early_exit_tokens"], still[i]["early_exit_tokens"]) << "iteration " << i + 1;
  }
}

// Tensor parallelism: tp=2 × pp=2 → tp=2 × pp=1; each tensor-parallel shard goes to the
// survivor of its tp rank. Untied embeddings, as in the dp test above.
TEST_F(SlowRepackTrainTest, Tp2Pp2ToTp2Pp1LiveKeepsTheLosses) {
  ExpectLiveShrinkKeepsTheLosses("tp2pp2",
                                 "--tensor_model_parallel_size=2 --pipeline_model_parallel_size=2 "
                                 "--untie_embeddings_and_output_weights",
                                 2, 1);
}

// Expert parallelism: tiny_moe ep=2 (inside dp=2) × pp=2 → ep=2 × pp=1; each expert-
// parallel rank's experts go to the survivor of its dp rank, and the expert exchange is
// rebuilt on the new expert group.
TEST_F(SlowRepackTrainTest, Ep2Pp2ToEp2Pp1LiveKeepsTheLosses) {
  ExpectLiveShrinkKeepsTheLosses("ep2pp2",
                                 "--recipe=tiny_moe --expert_model_parallel_size=2 "
                                 "--pipeline_model_parallel_size=2 --micro_batch_size=4 "
                                 "--untie_embeddings_and_output_weights",
                                 2, 1);
}

// Virtual pipeline stages (NOTE [re-packing under chunks] in dynamic/repack.h): 8 layers
// on a V of 4 ranks (virtual stages 0..7 on ranks 0 1 2 3 3 2 1 0) packed onto a V of 2
// after iteration 6 — new rank 0 takes layers 0-1 and 6-7 from old ranks 0 and 1, new rank
// 1 layers 2-5 from ranks 2 and 3, the V's turn split between its two chunks — trains the
// losses of the V that never shrinks, bit for bit; likewise interleaved 1F1B with 2 chunks
// (round-robin: new rank 0 takes virtual stages 0-1 and 4-5). m = 4 micro-batches, which
// interleaving needs on 4 and on 2 ranks. The V also through a checkpoint.
TEST_F(SlowRepackTrainTest, ZbvPp4ToPp2LiveAndThroughACheckpointKeepTheLosses) {
  const auto [still, live] = ExpectLiveShrinkKeepsTheLosses(
      "zbv_pp4",
      "--num_layers=8 --micro_batch_size=4 --pipeline_model_parallel_size=4 "
      "--pipeline_schedule=zbv",
      4, 2);
  ASSERT_EQ(live.size(), static_cast<size_t>(kRepackIterations));
  EXPECT_EQ(live[kShrinkAfter - 1]["stage_ranges"].dump(),
            "[[0,1],[1,2],[2,3],[3,4],[4,5],[5,6],[6,7],[7,8]]");
  EXPECT_EQ(live[kShrinkAfter]["stage_ranges"].dump(), "[[0,2],[2,4],[4,6],[6,8]]");

  // Through a checkpoint: the relaunch on 2 ranks lays the V out afresh, the same losses.
  std::string output;
  const std::string save = *dir_ + "/ckpt_zbv";
  const std::vector<nlohmann::json> relaunched =
      Train(4, "zbv_ckpt",
            "--num_layers=8 --micro_batch_size=4 --pipeline_model_parallel_size=4 "
            "--pipeline_schedule=zbv --repack_script=6:2 --repack_via_checkpoint --save=" + save,
            &output);
  ExpectShrunk(relaunched, 4, 2, 4, 2);
  EXPECT_NE(output.find("relaunching 2 with --pipeline_model_parallel_size=2 --load=" + save),
            std::string::npos)
      << output;
  ExpectSameLosses(relaunched, still);
}

// Interleaved 1F1B (2 chunks) pp=2 → 1 through a checkpoint: one stage runs one chunk, so
// the relaunch drops the virtual stages (--virtual_pipeline_model_parallel_size=1 appended;
// the flag alone would be refused on one stage). Untied, as in the dp test above.
TEST_F(SlowRepackTrainTest, InterleavedPp2ToPp1ThroughACheckpointKeepsTheLosses) {
  std::string output;
  const std::string layout = "--micro_batch_size=4 --pipeline_model_parallel_size=2 "
                             "--virtual_pipeline_model_parallel_size=2 "
                             "--untie_embeddings_and_output_weights";
  const std::vector<nlohmann::json> still = Train(2, "interleaved_pp2", layout, &output);
  const std::string save = *dir_ + "/ckpt_interleaved_pp2";
  const std::vector<nlohmann::json> relaunched =
      Train(2, "interleaved_pp2_ckpt",
            layout + " --repack_script=6:1 --repack_via_checkpoint --save=" + save, &output);
  ExpectShrunk(relaunched, 2, 1, 2, 1);
  EXPECT_NE(output.find("relaunching 1 with --pipeline_model_parallel_size=1 --load=" + save +
                        " --virtual_pipeline_model_parallel_size=1"),
            std::string::npos)
      << output;
  ExpectSameLosses(relaunched, still);
}

TEST_F(SlowRepackTrainTest, InterleavedPp4ToPp2LiveKeepsTheLosses) {
  ExpectLiveShrinkKeepsTheLosses("interleaved_pp4",
                                 "--num_layers=8 --micro_batch_size=4 "
                                 "--pipeline_model_parallel_size=4 "
                                 "--virtual_pipeline_model_parallel_size=2",
                                 4, 2);
}

// NOTE [overdue script step]: a pp=4 run saved after iteration 4 on four stages (as a
// SIGTERM in the step's own iteration leaves it), resumed with --repack_script=3:2: the
// step is past, so the resumed run re-packs after its first iteration and says why —
// and trains the losses of the run that never stopped nor shrank.
TEST_F(SlowRepackTrainTest, ResumedRunPastAScriptStepRepacksAtItsFirstIteration) {
  std::string output;
  const std::string common = "--pipeline_model_parallel_size=4 --train_iters=8";
  const std::vector<nlohmann::json> still = Train(4, "overdue_still", common, &output);
  ASSERT_EQ(still.size(), 8u);
  const std::string save = *dir_ + "/ckpt_overdue";
  const std::vector<nlohmann::json> first =
      Train(4, "overdue_first", common + " --exit_interval=4 --save=" + save, &output);
  ASSERT_EQ(first.size(), 4u) << output;
  const std::vector<nlohmann::json> resumed = Train(
      4, "overdue_resumed", common + " --repack_script=3:2 --load=" + save, &output);
  ASSERT_EQ(resumed.size(), 4u) << output;
  for (size_t i = 0; i < resumed.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "iteration " << i + 5);
    EXPECT_EQ(resumed[i]["iteration"], i + 5);
    EXPECT_EQ(resumed[i]["pipeline_size"], i == 0 ? 4 : 2);
    EXPECT_EQ(resumed[i]["active_ranks"], i == 0 ? 4 : 2);
    EXPECT_EQ(resumed[i]["loss"], still[i + 4]["loss"]);
  }
  EXPECT_NE(output.find("the step 3:2 was due after iteration 3"), std::string::npos) << output;
  EXPECT_NE(output.find("re-packed live after iteration 5: 4 → 2 pipeline stages"),
            std::string::npos)
      << output;
}

// Re-packing targets that cannot happen on the layout are refused before any work: a
// script step onto as many stages as there are or more, an output only written at the
// end (--timeline), and chunks given as layers per virtual stage. Two processes, pp=2.
TEST(SlowRepackFlagsTest, TargetsThePipelineCannotReachExitTwoNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--repack_script=2:8", "--repack_script: step 2:8 cannot happen"},
      {"--repack_script=2:2", "--repack_script: step 2:2 cannot happen"},
      {"--timeline=/proc/fulcrum_no_such_dir/t.json",
       "--timeline=/proc/fulcrum_no_such_dir/t.json cannot be written"},
      // NOTE [re-packing under chunks]: a stage keeps its chunks, not its layers per chunk.
      {"--repack_script=2:1 --num_layers_per_virtual_pipeline_stage=1",
       "cannot keep --num_layers_per_virtual_pipeline_stage=1"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    std::string output;
    EXPECT_EQ(testing::RunCommand(
                  testing::TrainCommand(2, "--recipe=tiny --train_iters=3 --log_interval=1 "
                                           "--eval_interval=0 --pipeline_model_parallel_size=2 " +
                                               flags),
                  &output),
              2)
        << output;
    EXPECT_NE(output.find(message), std::string::npos) << output;
    EXPECT_EQ(output.find("iteration 1"), std::string::npos) << "no training may start: " << output;
  }
}

// NOTE [re-packing under chunks]: interleaved 1F1B needs the micro-batches to be a multiple
// of the stages, so with m = 3 on 3 stages of 2 chunks a step onto 2 stages cannot run; it
// is refused before any work, naming the step and the schedule's reason. Three processes.
TEST(SlowRepackFlagsTest, AStepTheInterleavedScheduleCannotRunExitsTwo) {
  std::string output;
  EXPECT_EQ(testing::RunCommand(
                testing::TrainCommand(
                    3, "--recipe=tiny --num_layers=6 --train_iters=3 --eval_interval=0 "
                       "--global_batch_size=24 --micro_batch_size=8 "
                       "--pipeline_model_parallel_size=3 --virtual_pipeline_model_parallel_size=2 "
                       "--repack_script=2:2"),
                &output),
            2)
      << output;
  EXPECT_NE(output.find("--repack_script: step 2:2 cannot run --pipeline_schedule=1f1b on 2 "
                        "stages"),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("iteration 1"), std::string::npos) << "no training may start: " << output;
}

// The re-packing flags are checked before any work: exit 2 and one line naming the value.
TEST(RepackFlagsTest, BadFlagsExitTwoNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--repack=sometimes", "--repack='sometimes' is unknown; expected off or auto"},
      {"--repack_script=15", "step '15' is not ITER:STAGES"},
      {"--repack_script=40:2", "iteration 40 is not before the last (--train_iters=30)"},
      {"--repack=auto --repack_script=5:1", "both decide when to re-pack; give one of them"},
      {"--repack_via_checkpoint", "--repack_via_checkpoint says how to re-pack; it needs"},
      {"--repack_script=5:1 --repack_via_checkpoint", "it needs --save"},
      {"--repack=auto --repack_max_slowdown=-1", "--repack_max_slowdown=-1 must be"},
      {"--repack=auto --repack_interval=0", "--repack_interval=0 must be ≥ 1"},
      {"--on_release_command=true", "--on_release_command runs on ranks a re-packing releases"},
  };
  for (const auto& [flags, message] : cases) {
    SCOPED_TRACE(flags);
    std::string output;
    EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, "--recipe=tiny --train_iters=30 " + flags),
                                  &output),
              2);
    EXPECT_NE(output.find(message), std::string::npos) << output;
  }
}

}  // namespace
}  // namespace fulcrum
