// One math, many layouts (DESIGN.md invariant 5), through the real binaries: the tiny recipe
// trained for 20 iterations under tp=2, dp=2, tp=2×dp=2, pp=2 (every schedule), pp=4,
// pp=2×tp=2 and pp=2×dp=2 (fulcrum_launch, Gloo) gives the single-process loss curve in fp64
// (and in bf16 within bf16's rounding); checkpoints move between layouts; a rank killed mid-run stops the job within seconds.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// Sums split across ranks round differently from one process; in fp64 that stays below
// kFp64LayoutTolerance whatever the CPU's GEMM kernels (train_runs.h).
constexpr double kRelativeTolerance = testing::kFp64LayoutTolerance;

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
  // The layout comparisons' flags: fp64 (testing::kFp64).
  static std::string Common() { return Base() + testing::kFp64; }
  // The bf16 layout tests' flags: --lr=1e-3, not the recipe's 3e-3, which after the
  // two-iteration warm-up spikes the gradient norm to 40 (iteration 6) and a bf16 run
  // further (a loss of 8.5 at iteration 17 on an AMX Xeon, whose bf16 GEMMs round
  // otherwise than an AVX2 CPU's fp32-emulated ones): a spike turns a last-bit
  // difference into any size at all.
  static std::string Bf16Flags() { return Base() + " --bf16 --lr=1e-3"; }
  // Without a dtype.
  static std::string Base() {
    return "--recipe=tiny --train_iters=20 --eval_interval=0 --log_interval=10 "
           "--global_batch_size=16 --micro_batch_size=4" +
           std::string(testing::kPastWarmup);
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

// --bf16 across two pipeline stages (fulcrum_launch + Gloo): the activations and their
// gradients travel in bf16 (receive buffers of the compute dtype: a buffer of another
// dtype would not match the message's size and the receive fails), and the run follows
// the one-process bf16 run. Not bit-exact: as in fp32, the gradient norm is summed over
// the stages in another order, so the clip factor can differ in its last bit — and bf16
// activations turn such a difference into a larger one. Measured at --lr=1e-3 (Bf16Flags)
// on an AMX Xeon: the first two iterations bit-identical, then 3e-5 at most but 3e-4 at
// iteration 11 (a batch whose loss jumps from 4.3 to 5.3, grad norm 124 before clipping, in
// fp32 as in bf16); the first iteration, before any optimizer step, must be exact.
constexpr double kBf16LayoutTolerance = 1e-3;

TEST_F(SlowParallelTrainTest, Bf16PipelineTwoStagesFollowsOneProcessBf16) {
  std::string output;
  const std::string single = *dir_ + "/bf16_single.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Bf16Flags() + " --metrics_file=" + single),
                                &output),
            0)
      << output;
  const std::vector<double> reference = Losses(single);
  ASSERT_EQ(reference.size(), 20u);
  for (const char* schedule : {"1f1b", "zbh1"}) {
    const std::string metrics = *dir_ + "/bf16_pp2_" + schedule + ".jsonl";
    ASSERT_EQ(testing::RunCommand(
                  testing::TrainCommand(2, Bf16Flags() + " --pipeline_model_parallel_size=2 "
                                           "--pipeline_schedule=" + schedule +
                                           " --metrics_file=" + metrics),
                  &output),
              0)
        << output;
    const std::vector<double> losses = Losses(metrics);
    ASSERT_EQ(losses.size(), 20u);
    EXPECT_EQ(losses[0], reference[0]) << "the first forward crosses the stages exactly";
    const double worst = testing::MaxRelativeDifference(losses, reference);
    std::cout << "bf16 pp2 " << schedule << ": max relative loss difference vs one bf16 process "
              << "over 20 iterations: " << worst << std::endl;
    EXPECT_LE(worst, kBf16LayoutTolerance);
    EXPECT_LT(losses.back(), losses.front()) << "it learns";
  }
}

// --bf16 with tensor parallelism (two processes, Gloo): the column-parallel GEMMs run on
// bf16 shards and the row-parallel partial products are summed over the group in bf16, as
// Megatron's tp all-reduce is; the vocabulary-parallel loss widens to fp32. It cannot be
// bit-exact (one bf16 GEMM accumulating in fp32 rounds once; two half-width products summed
// in bf16 round three times), and iteration 11's batch (loss 4.3 -> 5.3, grad norm 124
// before clipping, in fp32 and bf16 alike) amplifies any last-bit difference for one
// iteration. Measured over 20 iterations at --lr=1e-3 (Bf16Flags) on an AMX Xeon, tp=2 bf16
// vs one bf16 process: 3e-5 over the first five, 8e-5 on every iteration but iteration 11,
// 4e-3 there (at the recipe's 3e-3 the spikes were 1e-2 and five iterations above 1e-3).
// The bounds: 5e-4 over the first five, 1e-3 on all but at most two iterations, 2.5e-2 on
// any.
TEST_F(SlowParallelTrainTest, Bf16TensorParallelTwoFollowsOneProcessBf16) {
  std::string output;
  const std::string single = *dir_ + "/bf16_single_for_tp.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Bf16Flags() + " --metrics_file=" + single),
                                &output),
            0)
      << output;
  const std::vector<double> reference = Losses(single);
  ASSERT_EQ(reference.size(), 20u);
  const std::string metrics = *dir_ + "/bf16_tp2.jsonl";
  ASSERT_EQ(testing::RunCommand(
                testing::TrainCommand(2, Bf16Flags() + " --tensor_model_parallel_size=2 "
                                         "--metrics_file=" + metrics),
                &output),
            0)
      << output;
  const std::vector<double> losses = Losses(metrics);
  ASSERT_EQ(losses.size(), 20u);
  const std::vector<double> first(losses.begin(), losses.begin() + 5);
  const double early = testing::MaxRelativeDifference(first, reference);
  const double worst = testing::MaxRelativeDifference(losses, reference);
  int above = 0;
  for (size_t i = 0; i < losses.size(); ++i) {
    above += std::abs(losses[i] - reference[i]) / std::abs(reference[i]) > 1e-3;
  }
  std::cout << "bf16 tp2 vs one bf16 process, max relative loss difference: first 5 iterations "
            << early << ", all 20 " << worst << " (" << above << " iterations above 1e-3)"
            << std::endl;
  EXPECT_LE(early, 5e-4);
  EXPECT_LE(above, 2);
  EXPECT_LE(worst, 2.5e-2);
  EXPECT_LT(losses.back(), losses.front()) << "it learns";
}

// PyTorch's own launcher: torchrun's elastic agent hosts the rendezvous store and the ranks
// join it as clients (TORCHELASTIC_USE_AGENT_STORE). A pp=2 job under it trains exactly the
// losses it trains under fulcrum_launch.
TEST_F(SlowParallelTrainTest, PipelineUnderTorchrunMatchesFulcrumLaunch) {
  const std::string torchrun = FULCRUM_TORCHRUN;
  if (torchrun.empty()) GTEST_SKIP() << "no torchrun next to the LibTorch this was built with";
  const std::string layout = " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";
  std::string output;
  const std::string ours = *dir_ + "/pp2_launch.jsonl";
  ASSERT_EQ(testing::RunCommand(
                testing::TrainCommand(2, Common() + layout + " --metrics_file=" + ours), &output),
            0)
      << output;
  const std::string theirs = *dir_ + "/pp2_torchrun.jsonl";
  ASSERT_EQ(testing::RunCommand("OMP_NUM_THREADS=1 " + torchrun +
                                    " --standalone --nproc_per_node=2 --no-python " + kBin +
                                    "/fulcrum_train " + Common() + layout +
                                    " --metrics_file=" + theirs,
                                &output),
            0)
      << output;
  EXPECT_NE(output.find("joined torchrun's the store"), std::string::npos)
      << "the ranks must have used the agent's store: " << output;
  const std::vector<double> launched = Losses(ours);
  ASSERT_EQ(launched.size(), 20u);
  EXPECT_EQ(Losses(theirs), launched) << "bit-identical: the same ranks compute the same steps";
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
// exactly the loss curve of the run without moves; a checkpoint saved while the layers are
// away from the even split records that placement and resumes under pp=4 and one process.
TEST_F(SlowParallelTrainTest, MigrationKeepsTheLossCurveBitIdentical) {
  const std::string pipeline = "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";
  std::string output;
  // In fp32: the clip norm is summed in fp64 per stage, and a placement groups that sum
  // otherwise; scaling fp32 gradients rounds the difference away, fp64 ones keep it (an fp64
  // run with these moves parts from the still one in the last bits from iteration 6).
  const std::string single32 = *dir_ + "/single_fp32.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Base() + " --metrics_file=" + single32), &output), 0)
      << output;
  const std::vector<double> reference = Losses(single32);
  ASSERT_EQ(reference.size(), 20u);
  const std::string still = *dir_ + "/still.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, Base() + " " + pipeline + " --metrics_file=" + still), &output), 0)
      << output;
  const std::string ckpt = testing::MakeTempDir("moved_ckpt");
  const std::string moved = *dir_ + "/moved.jsonl";
  // [0,2)|[2,4) → (3) [0,1)|[1,4) → (6) [0,3)|[3,4) → saved at 10 → (12) [0,2)|[2,4)
  // → (15) [0,1)|[1,4) → (18) [0,2)|[2,4)
  const std::string moves = "3:1->1;6:1->0,2->0;12:2->1;15:1->1;18:1->0";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, Base() + " " + pipeline + " --rebalance_script='" + moves +
                                              "' --save=" + ckpt + " --save_interval=10 --metrics_file=" + moved),
                                &output),
            0)
      << output;
  const std::vector<nlohmann::json> still_records = testing::MetricsRecords(still);
  const std::vector<nlohmann::json> moved_records = testing::MetricsRecords(moved);
  // The moves happened: every one counted at its iteration, none in the still run.
  EXPECT_EQ(testing::LayersMovedOf(moved_records), testing::ScriptedMovesByIteration(moves, 20));
  EXPECT_EQ(testing::LayersMovedOf(still_records), std::vector<int64_t>(20, 0));
  EXPECT_NE(output.find("moved layer 2 from stage 1 to stage 0"), std::string::npos) << output;
  std::vector<double> a = testing::LossesOf(still_records), b = testing::LossesOf(moved_records);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "iteration " << i + 1;
  EXPECT_LE(testing::MaxRelativeDifference(b, reference), testing::kLayoutTolerance);

  // Saved at iteration 10 with layers [0,3)|[3,4), not the even split.
  std::ifstream manifest_file(ckpt + "/iter_0000010/manifest.json");
  ASSERT_TRUE(manifest_file.good());
  const nlohmann::json manifest = nlohmann::json::parse(manifest_file);
  const nlohmann::json expected_placement = nlohmann::json::array(
      {{{"stage", 0}, {"layer_begin", 0}, {"layer_end", 3}},
       {{"stage", 1}, {"layer_begin", 3}, {"layer_end", 4}}});
  EXPECT_EQ(manifest["layer_placement"], expected_placement) << manifest["layer_placement"].dump();
  for (const auto& [n, layout] : std::vector<std::pair<int, std::string>>{
           {4, "--pipeline_model_parallel_size=4"}, {1, ""}}) {
    const std::string metrics = ckpt + "/resumed_" + std::to_string(n) + ".jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(n, Base() + " " + layout + " --load=" + ckpt + "/iter_0000010" +
                                                " --metrics_file=" + metrics),
                                  &output),
              0)
        << output;
    std::vector<double> resumed = Losses(metrics);
    ASSERT_EQ(resumed.size(), 10u);
    EXPECT_LE(testing::MaxRelativeDifference(resumed, std::vector<double>(reference.begin() + 10, reference.end())),
              testing::kLayoutTolerance)
        << layout;
  }
}

// Plans of any distance (pipeline/rebalancer.h): placements reached in one iteration with
// several layers leaving one stage and layers crossing several stages (layer 3 from stage
// 1 to stage 3; layer 4 from stage 2 to stage 0), under pp=4 and pp=2×dp=2, give the loss
// curve of the run without moves bit for bit; the moves happened and the metrics file
// shows each iteration's placement.
TEST_F(SlowParallelTrainTest, PlansOfAnyDistanceChangeNoLossBit) {
  struct Case {
    int n;
    std::string layout;
    std::string script;
    std::vector<std::vector<std::vector<int>>> ranges_after;  // at iterations 3, 6, 9
  };
  const std::vector<Case> cases = {
      {4, "--pipeline_model_parallel_size=4 --pipeline_schedule=zbh1", "3:1,1,1,5;6:2,2,2,2;9:5,1,1,1",
       {{{0, 1}, {1, 2}, {2, 3}, {3, 8}}, {{0, 2}, {2, 4}, {4, 6}, {6, 8}}, {{0, 5}, {5, 6}, {6, 7}, {7, 8}}}},
      {4, "--pipeline_model_parallel_size=2 --pipeline_schedule=1f1b", "3:1,7;6:6,2;9:3,5",
       {{{0, 1}, {1, 8}}, {{0, 6}, {6, 8}}, {{0, 3}, {3, 8}}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.layout);
    const std::string common = "--recipe=tiny --num_layers=8 --train_iters=12 --eval_interval=0 "
                               "--log_interval=6 --global_batch_size=16 --micro_batch_size=4 " +
                               c.layout;
    std::string output;
    const std::string still = *dir_ + "/any_still.jsonl";
    const std::string moved = *dir_ + "/any_moved.jsonl";
    std::remove(still.c_str());
    std::remove(moved.c_str());
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(c.n, common + " --metrics_file=" + still), &output), 0)
        << output;
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(c.n, common + " --rebalance_script='" + c.script +
                                                                 "' --metrics_file=" + moved),
                                  &output),
              0)
        << output;
    const std::vector<nlohmann::json> a = testing::MetricsRecords(still);
    const std::vector<nlohmann::json> b = testing::MetricsRecords(moved);
    ASSERT_EQ(a.size(), 12u);
    ASSERT_EQ(b.size(), 12u);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "iteration " << i + 1;
      EXPECT_EQ(a[i]["layers_moved"], 0);
    }
    for (size_t step = 0; step < 3; ++step) {
      const size_t iteration = 3 * (step + 1);
      EXPECT_EQ(b[iteration - 1]["stage_ranges"], nlohmann::json(c.ranges_after[step]))
          << "iteration " << iteration;
    }
    EXPECT_GT(b.back()["layers_moved"].get<int64_t>(), 6) << "several layers per stage moved";
  }
}

// Layouts drift apart from one process over longer runs in fp32 (sums split over ranks
// round differently, and a loss spike amplifies it). The same comparison in fp64 shows the
// drift is rounding, not a bug: every layout then agrees to ~1e-12 over the whole run.
TEST_F(SlowParallelTrainTest, Float64ShowsTheLayoutDriftIsRounding) {
  constexpr int kIterations = 20;
  const std::string common = "--recipe=tiny --train_iters=20 --eval_interval=0 --log_interval=10 "
                             "--global_batch_size=16 --micro_batch_size=4";
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1"},
      {2, ""},  // dp=2
      {2, "--tensor_model_parallel_size=2"}};
  for (const char* dtype : {"fp32", "fp64"}) {
    const std::string flags = common + " --params_dtype=" + dtype;
    std::string output;
    const std::string single = *dir_ + "/drift_single_" + dtype + ".jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, flags + " --metrics_file=" + single), &output), 0)
        << output;
    const std::vector<double> reference = Losses(single);
    ASSERT_EQ(reference.size(), static_cast<size_t>(kIterations));
    double worst = 0;
    for (const auto& [n, layout] : layouts) {
      const std::string metrics = *dir_ + "/drift_" + std::to_string(n) + "_" +
                                  std::to_string(layout.size()) + "_" + dtype + ".jsonl";
      ASSERT_EQ(testing::RunCommand(testing::TrainCommand(n, flags + " " + layout + " --metrics_file=" + metrics),
                                    &output),
                0)
          << output;
      const std::vector<double> losses = Losses(metrics);
      ASSERT_EQ(losses.size(), static_cast<size_t>(kIterations));
      const double difference = testing::MaxRelativeDifference(losses, reference);
      std::cout << dtype << " '" << (layout.empty() ? "dp=2" : layout)
                << "': max relative loss difference vs one process over " << kIterations
                << " iterations: " << difference << std::endl;
      worst = std::max(worst, difference);
    }
    if (std::string(dtype) == "fp64") {
      EXPECT_LE(worst, 1e-11) << "fp64 layouts must agree to rounding";
    } else {
      EXPECT_LE(worst, 1e-3) << "fp32 drift beyond what rounding explains";
    }
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
