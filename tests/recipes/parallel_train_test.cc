// One math, many layouts (DESIGN.md invariant 5), through the real binaries: the tiny recipe
// trained for 20 iterations under tp=2, dp=2, tp=2×dp=2, pp=2 (every schedule), pp=4,
// pp=2×tp=2 and pp=2×dp=2 (fulcrum_launch, Gloo) gives the single-process loss curve;
// checkpoints move between layouts; a rank killed mid-run stops the job within seconds.
#include <chrono>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// fp32 sums split across ranks round differently from one process; this bounds the
// relative difference of every iteration's loss after 20 steps.
constexpr double kRelativeTolerance = 1e-5;

const std::string kBin = FULCRUM_BIN_DIR;

std::vector<double> Losses(const std::string& metrics) {
  return testing::LossesOf(testing::MetricsRecords(metrics));
}

class SlowParallelTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTempDir("parallel_train"));
    std::string output;
    const int code = testing::RunCommand(
        testing::TrainCommand(1, Common() + " --metrics_file=" + *dir_ + "/single.jsonl"), &output);
    ASSERT_EQ(code, 0) << output;
    single_ = new std::vector<double>(Losses(*dir_ + "/single.jsonl"));
    ASSERT_EQ(single_->size(), 20u);
  }
  static std::string Common() {
    return "--recipe=tiny --train_iters=20 --eval_interval=0 --log_interval=10 "
           "--global_batch_size=16 --micro_batch_size=4";
  }
  void ExpectMatchesSingleProcess(int n, const std::string& layout, const std::string& name) {
    std::string output;
    const std::string metrics = *dir_ + "/" + name + ".jsonl";
    const int code = testing::RunCommand(
        testing::TrainCommand(n, Common() + " " + layout + " --metrics_file=" + metrics), &output);
    ASSERT_EQ(code, 0) << output;
    std::vector<double> losses = Losses(metrics);
    ASSERT_EQ(losses.size(), 20u) << "one metrics line per iteration, from one rank";
    const double worst = testing::MaxRelativeDifference(losses, *single_);
    std::cout << name << ": max relative loss difference vs one process over 20 iterations: "
              << worst << std::endl;
    EXPECT_LE(worst, kRelativeTolerance);
    EXPECT_LT(losses.back(), losses.front()) << "it learns";
  }
  static std::string* dir_;
  static std::vector<double>* single_;
};
std::string* SlowParallelTrainTest::dir_ = nullptr;
std::vector<double>* SlowParallelTrainTest::single_ = nullptr;

TEST_F(SlowParallelTrainTest, TensorParallelTwo) {
  ExpectMatchesSingleProcess(2, "--tensor_model_parallel_size=2", "tp2");
}

TEST_F(SlowParallelTrainTest, DataParallelTwo) {
  ExpectMatchesSingleProcess(2, "", "dp2");
}

TEST_F(SlowParallelTrainTest, TensorTimesDataParallel) {
  ExpectMatchesSingleProcess(4, "--tensor_model_parallel_size=2", "tp2dp2");
}

TEST_F(SlowParallelTrainTest, PipelineTwoStagesEverySchedule) {
  for (const char* schedule : {"1f1b", "zbh1", "zbh2"}) {
    ExpectMatchesSingleProcess(
        2, std::string("--pipeline_model_parallel_size=2 --pipeline_schedule=") + schedule,
        std::string("pp2_") + schedule);
  }
}

TEST_F(SlowParallelTrainTest, PipelineFourStages) {
  ExpectMatchesSingleProcess(4, "--pipeline_model_parallel_size=4 --pipeline_schedule=zbh1",
                             "pp4_zbh1");
}

TEST_F(SlowParallelTrainTest, PipelineTimesTensorAndDataParallel) {
  ExpectMatchesSingleProcess(
      4, "--pipeline_model_parallel_size=2 --tensor_model_parallel_size=2 --pipeline_schedule=zbh1",
      "pp2tp2");
  ExpectMatchesSingleProcess(4, "--pipeline_model_parallel_size=2 --pipeline_schedule=1f1b", "pp2dp2");
}

// Invariant 3: a scripted plan that moves layers back and forth between the two stages
// every few iterations (through the real p2p migration, during the backward tail) gives
// exactly the loss curve of the run without moves; a checkpoint saved after the moves
// records the new placement and resumes under pp=4 and under one process.
TEST_F(SlowParallelTrainTest, MigrationKeepsTheLossCurveBitIdentical) {
  const std::string pipeline = "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";
  std::string output;
  const std::string still = *dir_ + "/still.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, Common() + " " + pipeline + " --metrics_file=" + still), &output), 0)
      << output;
  const std::string ckpt = testing::MakeTempDir("moved_ckpt");
  const std::string moved = *dir_ + "/moved.jsonl";
  // [0,2)|[2,4) → [0,1)|[1,4) → [0,3)|[3,4) → [0,2)|[2,4) → [0,1)|[1,4) → [0,2)|[2,4) → [0,1)|[1,4)
  const std::string script =
      "--rebalance_script='3:1->1;6:1->0,2->0;9:2->1;12:1->1;15:1->0;18:1->1'";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, Common() + " " + pipeline + " " + script + " --save=" + ckpt +
                                              " --save_interval=10 --metrics_file=" + moved),
                                &output),
            0)
      << output;
  std::vector<double> a = Losses(still), b = Losses(moved);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "iteration " << i + 1;
  EXPECT_LE(testing::MaxRelativeDifference(b, *single_), kRelativeTolerance);

  // Saved at iteration 10 with layers [0,2)|[2,4) after four moves; resumed elsewhere.
  for (const auto& [n, layout] : std::vector<std::pair<int, std::string>>{
           {4, "--pipeline_model_parallel_size=4"}, {1, ""}}) {
    const std::string metrics = ckpt + "/resumed_" + std::to_string(n) + ".jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(n, Common() + " " + layout + " --load=" + ckpt + "/iter_0000010" +
                                                " --metrics_file=" + metrics),
                                  &output),
              0)
        << output;
    std::vector<double> resumed = Losses(metrics);
    ASSERT_EQ(resumed.size(), 10u);
    EXPECT_LE(testing::MaxRelativeDifference(resumed, std::vector<double>(single_->begin() + 10, single_->end())),
              kRelativeTolerance)
        << layout;
  }
}

// Saved under tp=2×dp=2 at iteration 10, resumed under one process (and the reverse):
// iterations 11-20 match the single-process run.
TEST_F(SlowParallelTrainTest, CheckpointsMoveBetweenLayouts) {
  struct Case {
    int save_n;
    std::string save_layout;
    int load_n;
    std::string load_layout;
  };
  for (const Case& c : {Case{4, "--tensor_model_parallel_size=2", 1, ""},
                        Case{1, "", 2, "--tensor_model_parallel_size=2"},
                        Case{2, "", 2, "--tensor_model_parallel_size=2"},
                        Case{2, "--pipeline_model_parallel_size=2", 4, "--pipeline_model_parallel_size=4"},
                        Case{4, "--pipeline_model_parallel_size=4", 1, ""}}) {
    const std::string ckpt = testing::MakeTempDir("layout_ckpt");
    std::string output;
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(c.save_n, Common() + " " + c.save_layout + " --save=" + ckpt +
                                                       " --exit_interval=10"),
                                  &output),
              0)
        << output;
    const std::string metrics = ckpt + "/resumed.jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(c.load_n, Common() + " " + c.load_layout + " --load=" + ckpt +
                                                       " --metrics_file=" + metrics),
                                  &output),
              0)
        << output;
    std::vector<double> resumed = Losses(metrics);
    ASSERT_EQ(resumed.size(), 10u);
    std::vector<double> expected(single_->begin() + 10, single_->end());
    const double worst = testing::MaxRelativeDifference(resumed, expected);
    std::cout << c.save_n << " procs '" << c.save_layout << "' -> " << c.load_n << " procs '"
              << c.load_layout << "': max relative difference " << worst << std::endl;
    EXPECT_LE(worst, kRelativeTolerance);
  }
}

TEST(SlowParallelFaultTest, KilledRankStopsTheJobWithinSeconds) {
  // Rank 1 is killed (SIGKILL) 6 s into a long run; rank 0 is then blocked in a collective.
  const std::string train = kBin + "/fulcrum_train --recipe=tiny --train_iters=100000 "
                                   "--eval_interval=0";
  const std::string command =
      kBin + "/fulcrum_launch --nproc_per_node=2 --master_port=0 -- /bin/sh -c '"
             "if [ \"$RANK\" = 1 ]; then exec timeout -s KILL 6 " + train + "; else exec " + train + "; fi'";
  const auto start = std::chrono::steady_clock::now();
  std::string output;
  const int code = testing::RunCommand(command, &output);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(code, 0) << output;
  EXPECT_LT(seconds, 6 + 15) << "the launcher must stop the survivor within seconds\n" << output;
}

}  // namespace
}  // namespace fulcrum
