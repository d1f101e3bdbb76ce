// Virtual pipeline stages through fulcrum_train (fulcrum_launch, Gloo): the tiny recipe at
// 8 layers under interleaved 1F1B (--virtual_pipeline_model_parallel_size=2, and the same
// through --num_layers_per_virtual_pipeline_stage), interleaved ZB-H1 and ZB-V (--pipeline_schedule=zbv) at
// pp = 2, and interleaved 1F1B at pp = 4, follows the one-process loss curve: the first
// loss (no optimizer step yet) bit for bit, the rest within the layout tolerance (the
// gradient norm is summed over the ranks in another order). The metrics name the p·v
// ranges. The flags' mistakes are refused naming the flag.
#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

constexpr int kIterations = 12;

std::string Common() { return testing::EightLayerTinyFlags(kIterations); }

class SlowVirtualPipelineTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTempDir("virtual_pipeline_train"));
    std::string output;
    const std::string metrics = *dir_ + "/single.jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + " --metrics_file=" + metrics),
                                  &output),
              0)
        << output;
    single_ = new std::vector<nlohmann::json>(testing::MetricsRecords(metrics));
  }
  // Runs `layout` on `n` ranks; returns its records after checking them against one process.
  std::vector<nlohmann::json> ExpectFollowsOneProcess(int n, const std::string& layout,
                                                      const std::string& name) {
    std::string output;
    const std::string metrics = *dir_ + "/" + name + ".jsonl";
    EXPECT_EQ(testing::RunCommand(
                  testing::TrainCommand(n, Common() + " " + layout + " --metrics_file=" + metrics),
                  &output),
              0)
        << output;
    std::vector<nlohmann::json> records = testing::MetricsRecords(metrics);
    const std::vector<double> losses = testing::LossesOf(records);
    const std::vector<double> single = testing::LossesOf(*single_);
    EXPECT_EQ(losses.size(), static_cast<size_t>(kIterations)) << output;
    if (losses.empty() || single.empty()) return records;
    EXPECT_EQ(losses.front(), single.front()) << name << ": the first loss, before any step";
    const double worst = testing::MaxRelativeDifference(losses, single);
    std::cout << name << ": max relative loss difference vs one process over " << kIterations
              << " iterations: " << worst << std::endl;
    EXPECT_LE(worst, testing::kLayoutTolerance) << name;
    const std::vector<double> valid = testing::ValidLossesOf(records);
    const std::vector<double> single_valid = testing::ValidLossesOf(*single_);
    EXPECT_EQ(valid.size(), single_valid.size()) << "evaluation ran through the chunks";
    EXPECT_LE(testing::MaxRelativeDifference(valid, single_valid), testing::kLayoutTolerance);
    return records;
  }
  static std::string* dir_;
  static std::vector<nlohmann::json>* single_;
};
std::string* SlowVirtualPipelineTrainTest::dir_ = nullptr;
std::vector<nlohmann::json>* SlowVirtualPipelineTrainTest::single_ = nullptr;

// stage_ranges lists the p·v virtual stages in model order: the even split.
void ExpectRanges(const std::vector<nlohmann::json>& records, const nlohmann::json& expected) {
  ASSERT_FALSE(records.empty());
  ASSERT_TRUE(records.back().contains("stage_ranges")) << records.back().dump();
  EXPECT_EQ(records.back()["stage_ranges"], expected);
}

TEST_F(SlowVirtualPipelineTrainTest, InterleavedTwoStages) {
  const auto records = ExpectFollowsOneProcess(
      2, "--pipeline_model_parallel_size=2 --virtual_pipeline_model_parallel_size=2",
      "pp2_interleaved");
  ExpectRanges(records, nlohmann::json::parse("[[0,2],[2,4],[4,6],[6,8]]"));
  // The same layout through Megatron's other flag.
  ExpectFollowsOneProcess(
      2, "--pipeline_model_parallel_size=2 --num_layers_per_virtual_pipeline_stage=2",
      "pp2_interleaved_per_stage");
  // Interleaved ZB-H1: the same layout with B and W split.
  ExpectFollowsOneProcess(
      2, "--pipeline_model_parallel_size=2 --virtual_pipeline_model_parallel_size=2 "
         "--pipeline_schedule=zbh1",
      "pp2_interleaved_zbh1");
}

TEST_F(SlowVirtualPipelineTrainTest, ZeroBubbleVTwoStages) {
  const auto records =
      ExpectFollowsOneProcess(2, "--pipeline_model_parallel_size=2 --pipeline_schedule=zbv", "pp2_zbv");
  ExpectRanges(records, nlohmann::json::parse("[[0,2],[2,4],[4,6],[6,8]]"));
}

TEST_F(SlowVirtualPipelineTrainTest, InterleavedFourStages) {
  const auto records = ExpectFollowsOneProcess(
      4, "--pipeline_model_parallel_size=4 --virtual_pipeline_model_parallel_size=2",
      "pp4_interleaved");
  ExpectRanges(records, nlohmann::json::parse("[[0,1],[1,2],[2,3],[3,4],[4,5],[5,6],[6,7],[7,8]]"));
}

// --pipeline_initial_partition=params under virtual stages: one range per virtual stage,
// balanced on parameters as Partition balances chunks. tiny_moe with MoE layers 0 and 1
// (each several dense layers' parameters): under ZB-V each MoE layer gets a chunk of its
// own — [0,1) on rank 0 with the embedding, [1,2) on rank 1 — and the six dense layers
// split 3 / 3 ([2,5) on rank 1, [5,8) on rank 0 with the final norm; the tied output weight
// is the embedding's own, no second copy). The losses are one process's.
TEST(SlowVirtualPipelineParamsTest, ZeroBubbleVStartsParameterBalanced) {
  const std::string model =
      "--recipe=tiny_moe --num_layers=8 --moe_layer_freq=[1,1,0,0,0,0,0,0] --train_iters=4 "
      "--eval_interval=0 --log_interval=1 --global_batch_size=8 --micro_batch_size=2" +
      std::string(testing::kPastWarmup);
  const std::string dir = testing::MakeTempDir("vp_params");
  std::string output;
  const auto single = testing::TrainRecords(1, model, dir + "/single.jsonl", &output);
  ASSERT_EQ(single.size(), 4u) << output;
  const auto zbv = testing::TrainRecords(
      2,
      model + " --pipeline_model_parallel_size=2 --pipeline_schedule=zbv "
              "--pipeline_initial_partition=params",
      dir + "/zbv.jsonl", &output);
  ASSERT_EQ(zbv.size(), 4u) << output;
  EXPECT_EQ(zbv.front()["stage_ranges"], nlohmann::json::parse("[[0,1],[1,2],[2,5],[5,8]]"))
      << output;
  EXPECT_EQ(zbv.front()["stage_range_ranks"], nlohmann::json::parse("[0,1,1,0]"));
  const std::vector<double> losses = testing::LossesOf(zbv);
  EXPECT_EQ(losses.front(), testing::LossesOf(single).front());
  EXPECT_LE(testing::MaxRelativeDifference(losses, testing::LossesOf(single)),
            testing::kLayoutTolerance);
}

// NOTE [ZB-V at measured costs]: the V's order rebuilt from the measured chunk costs (the
// default) trains the bits of the unit-cost order — word embeddings tied (NOTE [tied head
// on the embedding's rank]) — and the run says it rebuilt the order. That the order built
// at such costs differs from the unit one is MeasuredVOrderTest's.
TEST(SlowZbvOrderTest, MeasuredCostsTrainTheUnitOrdersBits) {
  const std::string flags =
      "--recipe=tiny --num_layers=8 --train_iters=8 --eval_interval=4 --log_interval=1 "
      "--global_batch_size=16 --micro_batch_size=2 --pipeline_model_parallel_size=2 "
      "--pipeline_schedule=zbv";
  const std::string dir = testing::MakeTempDir("zbv_order");
  std::string measured_output, unit_output;
  const auto measured = testing::TrainRecords(2, flags, dir + "/measured.jsonl", &measured_output);
  const auto unit =
      testing::TrainRecords(2, flags + " --zbv_order=unit", dir + "/unit.jsonl", &unit_output);
  ASSERT_EQ(measured.size(), 8u) << measured_output;
  EXPECT_EQ(testing::LossesOf(measured), testing::LossesOf(unit));
  EXPECT_EQ(testing::ValidLossesOf(measured), testing::ValidLossesOf(unit));
  EXPECT_EQ(testing::ValidLossesOf(measured).size(), 2u);
  // It ran other lists than the unit order's (B dearer than F and W cheaper, as these
  // layers measure on any machine, give the V another order: MeasuredVOrderTest).
  EXPECT_NE(measured_output.find("an order other than the unit-cost one"), std::string::npos)
      << measured_output;
  EXPECT_EQ(unit_output.find("zbv order rebuilt"), std::string::npos) << unit_output;
}

// Under a frozen prefix (layers 0-1: virtual stage 0 forward only from iteration 3) the
// measured V is chosen as it runs with that stage's backward removed (MeasuredVOrder::Build
// with the forward-only count) and still trains the unit order's bits; the run says it
// rebuilt the order, and its timeline shows rank 0's chunk 0 (virtual stage 0) running B and
// W in iterations 1-2 only, its chunk 1 (the head's) in every iteration.
TEST(SlowZbvOrderTest, UnderAFrozenPrefixTheMeasuredOrderTrainsTheUnitOrdersBits) {
  const std::string dir = testing::MakeTempDir("zbv_order_frozen");
  const std::string flags =
      "--recipe=tiny --num_layers=8 --train_iters=8 --eval_interval=0 --log_interval=1 "
      "--global_batch_size=16 --micro_batch_size=2 --pipeline_model_parallel_size=2 "
      "--pipeline_schedule=zbv --plugins=freeze --freeze_schedule='2:0-1'" +
      std::string(testing::kPastWarmup);
  std::string measured_output, unit_output;
  const std::string timeline = dir + "/t.json";
  const auto measured = testing::TrainRecords(2, flags + " --timeline=" + timeline,
                                              dir + "/measured.jsonl", &measured_output);
  const auto unit =
      testing::TrainRecords(2, flags + " --zbv_order=unit", dir + "/unit.jsonl", &unit_output);
  ASSERT_EQ(measured.size(), 8u) << measured_output;
  ASSERT_EQ(unit.size(), 8u) << unit_output;
  std::set<std::pair<int, int64_t>> backward;  // (rank 0's chunk, iteration) that ran B or W
  std::ifstream in(timeline);
  ASSERT_TRUE(in.good()) << timeline;
  const nlohmann::json trace = nlohmann::json::parse(in);
  for (const auto& e : trace.is_object() ? trace["traceEvents"] : trace) {
    if (!e.contains("args") || e.value("pid", -1) != 0) continue;
    const std::string kind = e["args"].value("kind", "");
    if (kind != "B" && kind != "W") continue;
    backward.insert({e["args"].value("chunk", -1), e["args"].value("iteration", int64_t{0})});
  }
  for (int64_t i = 1; i <= 8; ++i) {
    EXPECT_EQ(backward.count({0, i}), i <= 2 ? 1u : 0u) << "chunk 0, iteration " << i;
    EXPECT_EQ(backward.count({1, i}), 1u) << "chunk 1, iteration " << i;
  }
  EXPECT_EQ(testing::LossesOf(measured), testing::LossesOf(unit));
  EXPECT_EQ(measured.back()["frozen_prefix"], 2);
  EXPECT_NE(measured_output.find("zbv order rebuilt"), std::string::npos) << measured_output;
  EXPECT_EQ(unit_output.find("zbv order rebuilt"), std::string::npos) << unit_output;
}

// Each mistake exits non-zero with a message naming the flag (refused before any work).
TEST(VirtualPipelineFlagsTest, MistakesAreRefusedNamingTheFlag) {
  struct Case {
    int n;
    std::string flags;
    std::string message;
  };
  const std::vector<Case> cases = {
      {1, "--virtual_pipeline_model_parallel_size=2",
       "--virtual_pipeline_model_parallel_size=2 needs --pipeline_model_parallel_size > 1"},
      {1, "--virtual_pipeline_model_parallel_size=2 --num_layers_per_virtual_pipeline_stage=1",
       "not both"},
      {1, "--pipeline_schedule=zbv --virtual_pipeline_model_parallel_size=3",
       "--pipeline_schedule=zbv runs two chunks per stage"},
      {1, "--virtual_pipeline_model_parallel_size=-1", "must be ≥ 0"},
      {2, "--pipeline_model_parallel_size=2 --virtual_pipeline_model_parallel_size=2 "
          "--pipeline_schedule=zbh2",
       "it has no interleaved form"},
      {2, "--pipeline_model_parallel_size=2 --virtual_pipeline_model_parallel_size=3",
       "is below the 6 virtual pipeline stages"},
      {2, "--pipeline_model_parallel_size=2 --num_layers_per_virtual_pipeline_stage=3",
       "is not divisible by --pipeline_model_parallel_size × --num_layers_per_virtual_pipeline_stage"},
      // Megatron's rule for interleaved 1F1B: the micro-batch count (here 6 / 2 = 3) must be
      // a multiple of the stages (2).
      {2, "--pipeline_model_parallel_size=2 --virtual_pipeline_model_parallel_size=2 "
          "--global_batch_size=6 --micro_batch_size=2",
       "--pipeline_model_parallel_size"},
      // Layer moves work on the virtual stages (virtual_pipeline_moves_test.cc); a script
      // must place all p·v of them, and re-packing is still refused.
      {2, "--pipeline_model_parallel_size=2 --pipeline_schedule=zbv --rebalance_script=2:4,4",
       "gives 2 layer counts for 4 stages"},
      {1, "--pipeline_schedule=zbv --zbv_order=fast",
       "--zbv_order='fast' is unknown; expected measured or unit"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    std::string output;
    const int code = testing::RunCommand(
        testing::TrainCommand(c.n, "--recipe=tiny --num_layers=4 --train_iters=1 " + c.flags),
        &output);
    EXPECT_NE(code, 0) << output;
    EXPECT_NE(output.find(c.message), std::string::npos) << output;
  }
}

}  // namespace
}  // namespace fulcrum
