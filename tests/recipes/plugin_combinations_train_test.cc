// Every dynamism plugin, alone and in the combinations README documents (moe,freeze,prune and
// mod,early_exit), also on the Llama shape (llama_tiny), through the real binaries: each trains with layer 0 frozen from iteration 3
// (so its forward runs without gradients), evaluates at iterations 4, 8 and 12 (a no-grad
// forward of every layer), does its own work (experts get tokens, weights get pruned, tokens
// exit or skip, attention is block-sparse), and one process and pp=2 give the same training
// and validation losses within testing::kLayoutTolerance. The runs leave the warm-up after
// iteration 2 and decay to min_lr by iteration 12, so weight decay and the schedule act.
//
// A negative control shows the comparison can fail: the same pp=2 run without weight decay
// (what a layout that dropped it would train) lies far outside the tolerance.
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

constexpr int kCombinationIterations = 12;
const std::string kCombinationCommon =
    "--train_iters=12 --eval_interval=4 --eval_iters=1 --log_interval=4 --global_batch_size=16 "
    "--micro_batch_size=4 --freeze_schedule=3:0" +
    std::string(testing::kPastWarmup);
const std::string kPipeline = " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1";

struct Combination {
  std::string name;
  std::string flags;  // recipe, --plugins and the plugins' own flags
  // Asserts, on the last record of the one-process run, that the plugins did their work.
  void (*did_its_work)(const nlohmann::json& last);
};

void MoeRouted(const nlohmann::json& last) {
  double routed = 0;
  for (const auto& [layer, tokens] : last["expert_tokens"].items()) {
    for (const auto& t : tokens) routed += t.get<double>();
  }
  EXPECT_GT(routed, 0) << "experts received tokens";
}
void Pruned(const nlohmann::json& last) {
  EXPECT_NEAR(last["sparsity"].get<double>(), 0.5, 1e-5) << "pruned to the final sparsity";
}
void Exited(const nlohmann::json& last) {
  EXPECT_LT(last["early_exit_avg_layers"].get<double>(), 4.0) << "tokens exited early";
  EXPECT_LT(last["valid_early_exit_avg_layers"].get<double>(), 4.0) << "also when evaluating";
}
void Skipped(const nlohmann::json& last) {
  EXPECT_EQ(last["mod_tokens"]["layers.1"], nlohmann::json::parse("[128,512]"))
      << "a quarter of layer 1's tokens computed";
}
void Sparse(const nlohmann::json& last) {
  EXPECT_LT(last["sparse_attention_density"].get<double>(), 0.9) << "attention skipped blocks";
}
void OnlyFrozen(const nlohmann::json&) {}

const std::string kPrune =
    " --prune_start_iter=2 --prune_end_iter=6 --prune_interval=2 --prune_final_sparsity=0.5";
const std::string kExit = " --early_exit_confidence=state --early_exit_threshold=0.995";

const std::vector<Combination>& Combinations() {
  static const auto* all = new std::vector<Combination>{
      {"moe", "--recipe=tiny_moe --plugins=moe,freeze", MoeRouted},
      {"prune", "--recipe=tiny --plugins=prune,freeze" + kPrune, Pruned},
      {"freeze", "--recipe=tiny --plugins=freeze", OnlyFrozen},
      {"sparse_attention",
       "--recipe=tiny --plugins=sparse_attention,freeze --sparse_attention_buckets=4 "
       "--sparse_attention_block=16",
       Sparse},
      {"early_exit", "--recipe=tiny --plugins=early_exit,freeze" + kExit, Exited},
      {"mod", "--recipe=tiny --plugins=mod,freeze --mod_capacity=0.25", Skipped},
      {"moe_freeze_prune", "--recipe=tiny_moe --plugins=moe,freeze,prune" + kPrune,
       [](const nlohmann::json& last) {
         MoeRouted(last);
         Pruned(last);
       }},
      {"mod_early_exit", "--recipe=tiny --plugins=mod,early_exit,freeze --mod_capacity=0.25" + kExit,
       [](const nlohmann::json& last) {
         Skipped(last);
         Exited(last);
       }},
      // The Llama shape (RMSNorm, SwiGLU fc1 pruned as one weight, grouped-query attention
      // under sparse attention, rope with MoD's routed subsets and early exit's active tokens).
      {"mixtral", "--recipe=mixtral_tiny --plugins=moe,freeze", MoeRouted},
      {"llama_prune", "--recipe=llama_tiny --plugins=prune,freeze" + kPrune, Pruned},
      {"llama_sparse_attention",
       "--recipe=llama_tiny --plugins=sparse_attention,freeze --sparse_attention_buckets=4 "
       "--sparse_attention_block=16",
       Sparse},
      {"llama_mod_early_exit",
       "--recipe=llama_tiny --plugins=mod,early_exit,freeze --mod_capacity=0.25" + kExit,
       [](const nlohmann::json& last) {
         Skipped(last);
         Exited(last);
       }},
  };
  return *all;
}

std::vector<nlohmann::json> CombinationTrain(const std::string& dir, const std::string& tag, int n,
                                  const std::string& flags) {
  std::string output;
  std::vector<nlohmann::json> records =
      testing::TrainRecords(n, flags, dir + "/" + tag + ".jsonl", &output);
  EXPECT_NE(output.find("freeze: iteration 3: froze layers 0"), std::string::npos) << output;
  return records;
}

class SlowPluginCombinationTest : public ::testing::TestWithParam<Combination> {};

TEST_P(SlowPluginCombinationTest, TrainsFreezesEvaluatesAndAgreesAtTwoStages) {
  const Combination& c = GetParam();
  const std::string dir = testing::MakeTempDir("plugins_" + c.name);
  const std::string flags = c.flags + " " + kCombinationCommon;
  const std::vector<nlohmann::json> one = CombinationTrain(dir, "one", 1, flags);
  const std::vector<nlohmann::json> two = CombinationTrain(dir, "pp2", 2, flags + kPipeline);
  ASSERT_EQ(one.size(), size_t{kCombinationIterations});
  ASSERT_EQ(two.size(), size_t{kCombinationIterations});
  for (const auto* run : {&one, &two}) {
    for (int i = 0; i < kCombinationIterations; ++i) {
      const nlohmann::json& r = (*run)[i];
      EXPECT_EQ(r["frozen_layers"], i + 1 < 3 ? 0 : 1) << "iteration " << i + 1;
      EXPECT_EQ(r.contains("valid_loss"), (i + 1) % 4 == 0) << "iteration " << i + 1;
    }
  }
  EXPECT_LT(one.back()["loss"].get<double>(), one.front()["loss"].get<double>()) << "it learns";
  // The schedule really left the warm-up: iteration 2 is at the peak, iteration 12 at
  // min_lr (a tenth of the peak in both recipes).
  EXPECT_DOUBLE_EQ(one[0]["lr"].get<double>(), one[1]["lr"].get<double>() / 2);
  EXPECT_NEAR(one.back()["lr"].get<double>(), one[1]["lr"].get<double>() / 10, 1e-12);
  c.did_its_work(one.back());

  const double train = testing::MaxRelativeDifference(testing::LossesOf(two), testing::LossesOf(one));
  const double valid =
      testing::MaxRelativeDifference(testing::ValidLossesOf(two), testing::ValidLossesOf(one));
  std::cout << c.name << " pp2: max relative difference vs one process: train " << train
            << ", valid " << valid << std::endl;
  EXPECT_LE(train, testing::kLayoutTolerance);
  EXPECT_LE(valid, testing::kLayoutTolerance);
  ASSERT_EQ(testing::ValidLossesOf(two).size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(EveryPluginAndDocumentedCombination, SlowPluginCombinationTest,
                         ::testing::ValuesIn(Combinations()),
                         [](const ::testing::TestParamInfo<Combination>& info) {
                           return info.param.name;
                         });

// The negative control of the comparison above: a pp=2 run that trains without weight decay
// (as a layout that forgot it would) differs from the one-process run by far more than
// testing::kLayoutTolerance, so the layout tests would catch such a layout.
TEST(SlowLayoutToleranceTest, ALayoutWithoutWeightDecayFailsTheComparison) {
  const std::string dir = testing::MakeTempDir("layout_negative_control");
  const std::string flags = "--recipe=tiny --plugins=freeze " + kCombinationCommon;
  const std::vector<nlohmann::json> one = CombinationTrain(dir, "one", 1, flags);
  const std::vector<nlohmann::json> broken =
      CombinationTrain(dir, "pp2_no_decay", 2, flags + kPipeline + " --weight_decay=0");
  ASSERT_EQ(broken.size(), size_t{kCombinationIterations});
  const double train = testing::MaxRelativeDifference(testing::LossesOf(broken), testing::LossesOf(one));
  const double valid =
      testing::MaxRelativeDifference(testing::ValidLossesOf(broken), testing::ValidLossesOf(one));
  std::cout << "pp2 without weight decay: max relative difference vs one process: train " << train
            << ", valid " << valid << std::endl;
  EXPECT_GT(train, 2 * testing::kLayoutTolerance);
  EXPECT_GT(valid, 2 * testing::kLayoutTolerance);
}

}  // namespace
}  // namespace fulcrum
