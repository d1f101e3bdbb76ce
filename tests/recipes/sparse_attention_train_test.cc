// The sparse_attention plugin (plugins/sparse_attention.cc) through the real binaries: it
// trains, computes well under the dense attention's scores and reports it; pp=2 (also with
// layers migrating between the stages) and tp=2 train the one-process losses and compute
// the same blocks (the hash of a head does not depend on the layout or on where the layer
// runs); a resume continues the straight run bit for bit (the rotations are checkpointed).
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

const std::string kSparseAttentionCommon =
    "--recipe=tiny --train_iters=10 --eval_interval=0 --log_interval=5 --global_batch_size=16 "
    "--micro_batch_size=4 --plugins=sparse_attention --sparse_attention_buckets=4 "
    "--sparse_attention_block=16";  // inside the warm-up: train_runs.h

TEST(SlowSparseAttentionTrainTest, PipelineAndTensorParallelTrainTheOneProcessLosses) {
  testing::PluginTrainRuns runs("sparse_attention", kSparseAttentionCommon, 10);
  ASSERT_NO_FATAL_FAILURE(runs.RunOneProcess(/*save_interval=*/5));
  EXPECT_NE(runs.output().find("attn density"), std::string::npos) << runs.output();
  const std::vector<nlohmann::json>& one = runs.one();
  for (const nlohmann::json& r : one) {
    ASSERT_TRUE(r.contains("sparse_attention_blocks")) << r.dump();
    ASSERT_TRUE(r.contains("layer_loads")) << r.dump();
    EXPECT_EQ(r["sparse_attention_blocks"].size(), 4u);
    for (const auto& [layer, blocks] : r["sparse_attention_blocks"].items())
      EXPECT_GT(blocks.get<int64_t>(), 0) << layer;
    EXPECT_GT(r["layer_loads"]["layers.0"].get<double>(), 0);
    // 4 buckets compute well under half the dense scores (s = 128, blocks of 16).
    EXPECT_LT(r["sparse_attention_density"].get<double>(), 0.5);
    // Every layer's own density; the layers see the same dense scores, so the model's
    // density is their mean.
    ASSERT_EQ(r["sparse_attention_layer_density"].size(), 4u) << r.dump();
    double sum = 0;
    for (const auto& [layer, density] : r["sparse_attention_layer_density"].items()) {
      EXPECT_GT(density.get<double>(), 0) << layer;
      EXPECT_LT(density.get<double>(), 1) << layer;
      sum += density.get<double>();
    }
    EXPECT_NEAR(sum / 4, r["sparse_attention_density"].get<double>(), 1e-12);
  }
  ASSERT_NO_FATAL_FAILURE(runs.ExpectLayoutsTrainTheOneProcessLosses(
      {{"pp2", " --pipeline_model_parallel_size=2"},
       // Layer 1 moves to stage 1 in iteration 3, layer 2 back to stage 0 in iteration 6.
       {"pp2_migrating", " --pipeline_model_parallel_size=2 --rebalance_script='3:1->1;6:2,2'"},
       {"tp2", " --tensor_model_parallel_size=2"}},
      [&](const std::string& name, const std::vector<nlohmann::json>& records) {
        for (size_t i = 0; i < records.size(); ++i) {
          EXPECT_EQ(records[i]["sparse_attention_blocks"], one[i]["sparse_attention_blocks"])
              << name << " iteration " << i + 1;
          EXPECT_EQ(records[i]["sparse_attention_layer_density"],
                    one[i]["sparse_attention_layer_density"])
              << name << " iteration " << i + 1;
        }
        if (name == "pp2_migrating") {
          EXPECT_GT(records.back().value("layers_moved", int64_t{0}), 0) << "layers really moved";
        }
      }));
  // A resume from iteration 5 continues the straight run bit for bit.
  ASSERT_NO_FATAL_FAILURE(runs.ExpectResumeContinuesBitForBit(5, {"sparse_attention_blocks"}));
}

}  // namespace
}  // namespace fulcrum
