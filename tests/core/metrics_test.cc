// core/metrics.h: TensorBoardScalars, the TensorBoard tags of a metrics record (the table in
// README's logging section). tests/recipes/tensorboard_test.cc checks real runs end to end.
#include "core/metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace fulcrum {
namespace {

using ::testing::DoubleNear;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

TEST(TensorBoardScalarsTest, RenamesMegatronsFiguresAndSpreadsListsAndObjects) {
  const nlohmann::json record = nlohmann::json::parse(R"({
      "iteration": 7, "loss": 2.5, "lr": 0.001, "grad_norm": 1.25, "iteration_ms": 250,
      "tokens_per_second": 4096, "consumed_samples": 56, "valid_loss": 1.0,
      "bubble_ratio": 0.25, "imbalance": 0.5, "layers_moved": 3,
      "stage_ms": [10, 20], "stage_bubble_ratio": [0.125, 0.375],
      "stage_ranges": [[0, 2], [2, 4]], "layer_loads": {"layers.0": 4, "layers.1": 5},
      "moe_aux_loss": 0.0625, "note": "text", "stopped": true})");
  EXPECT_THAT(TensorBoardScalars(record),
              UnorderedElementsAre(
                  Pair("lm loss", 2.5), Pair("learning-rate", 0.001), Pair("grad-norm", 1.25),
                  Pair("iteration-time", 0.25), Pair("tokens-per-second", 4096),
                  Pair("consumed-samples", 56), Pair("lm loss validation", 1.0),
                  Pair("lm loss validation ppl", DoubleNear(2.718281828459045, 1e-15)),
                  Pair("pipeline/bubble-ratio", 0.25), Pair("pipeline/imbalance", 0.5),
                  Pair("pipeline/layers-moved", 3), Pair("pipeline/stage0-load-ms", 10),
                  Pair("pipeline/stage1-load-ms", 20), Pair("pipeline/stage0-bubble-ratio", 0.125),
                  Pair("pipeline/stage1-bubble-ratio", 0.375), Pair("layer_loads/layers.0", 4),
                  Pair("layer_loads/layers.1", 5), Pair("moe_aux_loss", 0.0625)));
}

}  // namespace
}  // namespace fulcrum
