// fulcrum_train --tensorboard_dir, read back by TensorBoard itself (PyPI's `tensorboard`,
// its EventAccumulator, in tests/recipes/tensorboard_check.py): every scalar of the metrics
// file of the same run is there, at its iteration, to float32 precision, and nothing else —
// for one process with evaluation, for a pp=2 job (each stage's load and bubble), and for a
// run resumed from a checkpoint (a second file; TensorBoard keeps the resumed iterations).
// A directory that cannot be one is refused with exit 2 and one line before any work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/file_system.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

const std::string kTensorBoardCommon =
    "--recipe=tiny --log_interval=10 --global_batch_size=8 --micro_batch_size=2 --eval_iters=1";

// Runs the check script on (dir, metrics); its output, after asserting it passed.
std::string CheckWithTensorBoard(const std::string& dir, const std::string& metrics) {
  std::string output;
  const int code = testing::RunCommand(std::string(FULCRUM_VENV_PYTHON) + " " +
                                           FULCRUM_SOURCE_DIR "/tests/recipes/tensorboard_check.py"
                                           " --logdir=" + dir + " --metrics=" + metrics,
                                       &output);
  EXPECT_EQ(code, 0) << output;
  return output;
}

std::vector<std::string> EventFiles(const std::string& dir) {
  std::vector<std::string> out;
  auto names = DefaultFileSystem()->ListDir(dir);
  EXPECT_TRUE(names.ok()) << names.status();
  for (const std::string& name : names.value_or(std::vector<std::string>{})) {
    if (name.find("tfevents") != std::string::npos) out.push_back(name);
  }
  return out;
}

TEST(SlowTensorBoardTest, OneProcessWritesEveryMetricWithValidation) {
  const std::string dir = testing::MakeTempDir("tensorboard_one");
  const std::string metrics = dir + "/metrics.jsonl";
  std::string output;
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, kTensorBoardCommon + " --train_iters=6 "
                                                      "--eval_interval=3 --metrics_file=" + metrics +
                                                      " --tensorboard_dir=" + dir + "/tb"),
                                &output),
            0)
      << output;
  ASSERT_EQ(testing::MetricsRecords(metrics).size(), 6u);
  EXPECT_EQ(EventFiles(dir + "/tb").size(), 1u);
  const std::string check = CheckWithTensorBoard(dir + "/tb", metrics);
  EXPECT_THAT(check, HasSubstr("steps 1..6, 1 event file(s)"));
  for (const char* tag : {"lm loss", "learning-rate", "grad-norm", "iteration-time",
                          "tokens-per-second", "consumed-samples", "lm loss validation",
                          "lm loss validation ppl"}) {
    EXPECT_THAT(check, HasSubstr(std::string("\ntag ") + tag + "\n"));
  }
}

TEST(SlowTensorBoardTest, PipelineRunWritesEachStagesLoadAndBubble) {
  const std::string dir = testing::MakeTempDir("tensorboard_pp");
  const std::string metrics = dir + "/metrics.jsonl";
  std::string output;
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, kTensorBoardCommon + " --train_iters=4 "
                                                      "--eval_interval=2 "
                                                      "--pipeline_model_parallel_size=2 "
                                                      "--metrics_file=" + metrics +
                                                      " --tensorboard_dir=" + dir + "/tb"),
                                &output),
            0)
      << output;
  ASSERT_EQ(testing::MetricsRecords(metrics).size(), 4u);
  EXPECT_EQ(EventFiles(dir + "/tb").size(), 1u) << "one file per job, from the logging rank";
  const std::string check = CheckWithTensorBoard(dir + "/tb", metrics);
  for (const char* tag : {"pipeline/stage0-load-ms", "pipeline/stage1-load-ms",
                          "pipeline/stage0-bubble-ratio", "pipeline/stage1-bubble-ratio",
                          "pipeline/bubble-ratio", "pipeline/imbalance", "lm loss validation"}) {
    EXPECT_THAT(check, HasSubstr(std::string("\ntag ") + tag + "\n"));
  }
}

TEST(SlowTensorBoardTest, AResumedRunAddsAFileAndItsIterationsReplaceTheOldOnes) {
  const std::string dir = testing::MakeTempDir("tensorboard_resume");
  const std::string metrics = dir + "/metrics.jsonl";
  const std::string run = kTensorBoardCommon + " --train_iters=8 --eval_interval=0 --metrics_file=" + metrics +
                          " --tensorboard_dir=" + dir + "/tb";
  std::string output;
  // Saved at 4 and stopped at 6; resumed from 4, so 5 and 6 are trained (and timed) twice.
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, run + " --save=" + dir + "/ckpt "
                                                      "--save_interval=4 --exit_interval=6"),
                                &output),
            0)
      << output;
  const std::vector<std::string> first = EventFiles(dir + "/tb");
  ASSERT_EQ(first.size(), 1u);
  const std::string first_bytes = DefaultFileSystem()->ReadFile(dir + "/tb/" + first[0]).value();
  ASSERT_EQ(testing::RunCommand(
                testing::TrainCommand(1, run + " --load=" + dir + "/ckpt/iter_0000004"), &output),
            0)
      << output;
  ASSERT_EQ(testing::MetricsRecords(metrics).size(), 6u + 4u);
  const std::vector<std::string> both = EventFiles(dir + "/tb");
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0], first[0]);
  EXPECT_EQ(DefaultFileSystem()->ReadFile(dir + "/tb/" + first[0]).value(), first_bytes)
      << "the first run's file is left as it was";
  // TensorBoard holds steps 1..8 once each, 5 and 6 from the resumed run (the script takes
  // the later metrics line of an iteration; iteration-time differs between the two runs).
  EXPECT_THAT(CheckWithTensorBoard(dir + "/tb", metrics), HasSubstr("steps 1..8, 2 event file(s)"));
}

TEST(TensorBoardFlagTest, ADirectoryThatCannotBeOneExitsTwoWithOneLine) {
  const std::string dir = testing::MakeTempDir("tensorboard_bad");
  const std::string file = dir + "/file";
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), file, "x").ok());
  for (const std::string& bad : {file, file + "/tb"}) {
    std::string output;
    EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, kTensorBoardCommon + " --train_iters=2 "
                                                        "--tensorboard_dir=" + bad),
                                  &output),
              2)
        << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_THAT(output, HasSubstr("fulcrum_train: --tensorboard_dir: cannot write event files to " +
                                  bad + ": "));
  }
}

}  // namespace
}  // namespace fulcrum
