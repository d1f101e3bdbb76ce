// Layer loads of two plugins on the same layers, through the real binary (NOTE [layer load
// composition] in core/transformer_layer.h): pruning and Mixture-of-Depths multiply on a
// routed layer; Mixture-of-Depths and early exit each speak for their own layers (exits save
// nothing on a routed layer). Each expected value comes from the plugins' own counts in the
// same metrics record, not from the loads.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// Routed layers 1 and 3 (--mod_layer_freq=2) compute 32 of each sequence's 128 tokens.
const std::string kCompositionCommon =
    "--recipe=tiny --train_iters=8 --eval_interval=0 --log_interval=4 --global_batch_size=16 "
    "--micro_batch_size=4 --mod_capacity=0.25" + std::string(testing::kPastWarmup);

std::vector<nlohmann::json> CompositionTrain(const std::string& name, const std::string& flags) {
  const std::string dir = testing::MakeTempDir("load_composition_" + name);
  std::string output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, kCompositionCommon + " " + flags +
                                                             " --metrics_file=" + dir + "/m.jsonl"),
                                &output),
            0)
      << output;
  return testing::MetricsRecords(dir + "/m.jsonl");
}

// [computed, seen, ...] → computed / seen.
double Fraction(const nlohmann::json& counts) {
  return counts[0].get<double>() / counts[1].get<double>();
}

TEST(SlowLoadCompositionTrainTest, PruningAndMixtureOfDepthsMultiplyInEitherOrder) {
  for (const std::string plugins : {"prune,mod", "mod,prune"}) {
    SCOPED_TRACE(plugins);
    // Pruned to 70% sparsity before the first step (global magnitude: layers differ).
    const std::vector<nlohmann::json> records =
        CompositionTrain(plugins == "prune,mod" ? "prune_mod" : "mod_prune",
              "--plugins=" + plugins +
                  " --prune_start_iter=0 --prune_end_iter=0 --prune_final_sparsity=0.7");
    ASSERT_EQ(records.size(), 8u);
    for (const nlohmann::json& r : records) {
      SCOPED_TRACE(r["iteration"].dump());
      const nlohmann::json& loads = r["layer_loads"];
      const nlohmann::json& density = r["prune_layer_density"];
      for (const char* dense : {"layers.0", "layers.2"}) {
        EXPECT_LT(density[dense].get<double>(), 0.9) << "pruned";
        EXPECT_DOUBLE_EQ(loads[dense].get<double>(), density[dense].get<double>()) << dense;
      }
      for (const char* routed : {"layers.1", "layers.3"}) {
        const double tokens = Fraction(r["mod_tokens"][routed]);
        EXPECT_DOUBLE_EQ(tokens, 0.25);
        EXPECT_LT(density[routed].get<double>(), 0.9) << "pruned";
        EXPECT_DOUBLE_EQ(loads[routed].get<double>(), density[routed].get<double>() * tokens)
            << routed;
      }
    }
  }
}

TEST(SlowLoadCompositionTrainTest, MixtureOfDepthsAndEarlyExitEachSpeakForTheirLayers) {
  const std::vector<nlohmann::json> records =
      CompositionTrain("mod_early_exit",
            "--plugins=mod,early_exit --early_exit_confidence=state --early_exit_threshold=0.995");
  ASSERT_EQ(records.size(), 8u);
  const nlohmann::json& last = records.back();
  const nlohmann::json& loads = last["layer_loads"];
  const nlohmann::json& exits = last["early_exit_tokens"];
  // Tokens exited at layers 0 and 1, so layer 2 (not routed) computed fewer: its load is
  // early exit's fraction.
  ASSERT_LT(Fraction(exits["layers.2"]), 1.0) << last.dump();
  EXPECT_DOUBLE_EQ(loads["layers.2"].get<double>(), Fraction(exits["layers.2"]));
  EXPECT_EQ(loads["layers.0"].get<double>(), 1.0) << "every token runs layer 0";
  // Routed layers run every token through Mixture-of-Depths' wrapper: its fraction alone.
  for (const char* routed : {"layers.1", "layers.3"}) {
    EXPECT_DOUBLE_EQ(loads[routed].get<double>(), Fraction(last["mod_tokens"][routed])) << routed;
    EXPECT_DOUBLE_EQ(loads[routed].get<double>(), 0.25) << routed;
  }
}

}  // namespace
}  // namespace fulcrum
