// --recompute_granularity=full (NOTE [activation recomputation] in core/transformer_layer.h)
// in real runs: the losses of the run without it, bit for bit — one process, and pp=2 under
// ZB-H1 (the B/W split) with dropout on and layers moving — at a smaller activation peak;
// every dynamism plugin under it; and what it refuses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "core/sparse_linear.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

std::string RecomputeCommon() {
  return "--recipe=tiny --train_iters=10 --eval_interval=0 --log_interval=5 "
         "--global_batch_size=16 --micro_batch_size=4 --hidden_dropout=0.1 "
         "--attention_dropout=0.1" +
         std::string(testing::kPastWarmup);
}

std::vector<nlohmann::json> RecomputeTrain(int n, const std::string& args, const std::string& dir,
                                  const std::string& name) {
  return testing::TrainRecords(n, args, dir + "/" + name + ".jsonl");
}

TEST(SlowRecomputeTrainTest, OneProcessTrainsTheSameLossesBitForBit) {
  const std::string dir = testing::MakeTempDir("recompute_one");
  const auto plain = RecomputeTrain(1, RecomputeCommon(), dir, "plain");
  const auto again = RecomputeTrain(1, RecomputeCommon() + " --recompute_granularity=full", dir, "full");
  const auto selective = RecomputeTrain(1, RecomputeCommon() + " --recompute_granularity=selective", dir, "selective");
  ASSERT_EQ(plain.size(), 10u);
  EXPECT_EQ(testing::LossesOf(again), testing::LossesOf(plain));
  EXPECT_EQ(testing::LossesOf(selective), testing::LossesOf(plain));
}

// pp=2 under ZB-H1: the recomputed layers' weight gradients still wait for W; a scripted
// plan moves a layer in iteration 4 (it leaves after its last W, its recomputation long
// done). Every loss equals the plain run's, full or selective; the largest stage's
// activation peak is lower, all layers recomputed lower than one per stage, selective
// between the plain run and full.
TEST(SlowRecomputeTrainTest, PipelineWithTheSplitAndMovesTrainsTheSameLossesAtALowerPeak) {
  const std::string dir = testing::MakeTempDir("recompute_pp2");
  const std::string layout = RecomputeCommon() +
                             " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1"
                             " --rebalance_script='4:1->1'";
  const auto plain = RecomputeTrain(2, layout, dir, "plain");
  const auto one = RecomputeTrain(2, layout + " --recompute_granularity=full --recompute_num_layers=1", dir, "one");
  const auto all = RecomputeTrain(2, layout + " --recompute_granularity=full", dir, "all");
  const auto selective = RecomputeTrain(2, layout + " --recompute_granularity=selective", dir, "selective");
  ASSERT_EQ(plain.size(), 10u);
  EXPECT_EQ(testing::LossesOf(one), testing::LossesOf(plain));
  EXPECT_EQ(testing::LossesOf(all), testing::LossesOf(plain));
  EXPECT_EQ(testing::LossesOf(selective), testing::LossesOf(plain));
  EXPECT_EQ(all.back()["stage_ranges"].dump(), "[[0,1],[1,4]]") << "the layer moved";
  auto peak = [](const std::vector<nlohmann::json>& run) {
    double worst = 0;
    for (const auto& r : run) worst = std::max(worst, r["activation_peak_mb"].get<double>());
    return worst;
  };
  std::cout << "activation peak MB: plain " << peak(plain) << ", one layer per stage "
            << peak(one) << ", all " << peak(all) << ", selective " << peak(selective) << "\n";
  EXPECT_LT(peak(all), peak(plain));
  EXPECT_LE(peak(all), peak(one));
  // With attention dropout on, the attention cores' s×s tensors are what selective drops.
  EXPECT_LT(peak(selective), peak(plain));
  EXPECT_GT(peak(selective), peak(all));
}

// MoE layers (tiny_moe at pp=2 under ZB-H1): the recomputed
// forward routes the same tokens to the same experts and records its loads once, so the
// losses and every MoE figure of the metrics (expert loads, auxiliary losses) equal the
// plain run's.
TEST(SlowRecomputeTrainTest, MoeLayersRecordTheirLoadsOnce) {
  const std::string dir = testing::MakeTempDir("recompute_moe");
  const std::string layout =
      "--recipe=tiny_moe --train_iters=8 --eval_interval=0 --log_interval=4 "
      "--global_batch_size=16 --micro_batch_size=4 --pipeline_model_parallel_size=2 "
      "--pipeline_schedule=zbh1" + std::string(testing::kPastWarmup);
  const auto plain = RecomputeTrain(2, layout, dir, "plain");
  const auto again = RecomputeTrain(2, layout + " --recompute_granularity=full", dir, "full");
  ASSERT_EQ(plain.size(), 8u);
  ASSERT_EQ(again.size(), 8u);
  int compared = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(again[i]["loss"], plain[i]["loss"]) << "iteration " << i + 1;
    for (const char* field : {"expert_tokens", "load_balancing_loss", "z_loss", "dropped_tokens"}) {
      if (!plain[i].contains(field)) continue;
      ++compared;
      EXPECT_EQ(again[i][field], plain[i][field]) << field << ", iteration " << i + 1;
    }
  }
  EXPECT_GE(compared, 16) << "the MoE figures were in the metrics";
  EXPECT_LT(again.back()["activation_peak_mb"].get<double>(), plain.back()["activation_peak_mb"].get<double>());
}

// Every dynamism plugin under full recomputation, at pp=2 under ZB-H1 (the token state of
// early exit crossing the stages, layer 0 frozen from iteration 3): a recomputed layer
// prunes, routes, hashes and exits exactly as its first forward did and counts once, so
// every figure the plugins write equals the plain run's, and the losses and validation
// losses are the plain run's bit for bit — but for early exit: its exit heads share one
// copy of the head, whose gradient the plain backward sums over the exits before adding it
// to the micro-batches' sum, and recomputed layers add exit by exit (separate backward
// passes), so the last bits differ (measured 3.0e-8 relative over the run; the
// iteration-1 gradient norm 2e-10). A recomputed early-exit layer that lost its input token
// state would recompute exited tokens (another function's gradients); one that counted
// again would double its figures.
TEST(SlowRecomputeTrainTest, EveryPluginTrainsThePlainRunsLossesAndFigures) {
  const std::string dir = testing::MakeTempDir("recompute_plugins");
  struct Case {
    std::string name;
    std::string flags;
    std::vector<std::string> figures;  // metrics fields that must be equal (and present)
    double tolerance = 0;              // on the losses, relative; 0: bit for bit
  };
  const std::string exit = " --early_exit_confidence=state --early_exit_threshold=0.995";
  const std::vector<Case> cases = {
      {"prune",
       "--plugins=prune,freeze --prune_start_iter=2 --prune_end_iter=6 --prune_interval=2 "
       "--prune_final_sparsity=0.8",
       {"sparsity", "prune_layer_density", "frozen_layers"}},
      {"sparse_attention",
       "--plugins=sparse_attention,freeze --sparse_attention_buckets=4 --sparse_attention_block=16",
       {"sparse_attention_density", "sparse_attention_blocks", "frozen_layers"}},
      {"mod", "--plugins=mod,freeze --mod_capacity=0.25", {"mod_tokens", "frozen_layers"}},
      {"mod_early_exit", "--plugins=mod,early_exit,freeze --mod_capacity=0.25" + exit,
       {"mod_tokens", "early_exit_avg_layers", "early_exit_tokens", "frozen_layers"},
       1e-6},
  };
  for (const Case& c : cases) {
    const std::string args =
        "--recipe=tiny --train_iters=8 --eval_interval=4 --eval_iters=1 --log_interval=4 "
        "--global_batch_size=16 --micro_batch_size=4 --hidden_dropout=0.1 --freeze_schedule=3:0 "
        "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1 " + c.flags +
        std::string(testing::kPastWarmup);
    const auto plain = RecomputeTrain(2, args, dir, c.name + "_plain");
    const auto again = RecomputeTrain(2, args + " --recompute_granularity=full", dir, c.name + "_full");
    ASSERT_EQ(plain.size(), 8u) << c.name;
    ASSERT_EQ(again.size(), 8u) << c.name;
    const double worst = testing::MaxRelativeDifference(testing::LossesOf(again), testing::LossesOf(plain));
    std::cout << c.name << ": recomputed vs plain, max relative loss difference " << worst << "\n";
    EXPECT_LE(worst, c.tolerance) << c.name;
    for (size_t i = 0; i < plain.size(); ++i) {
      if (plain[i].contains("valid_loss")) {
        const double valid = plain[i]["valid_loss"].get<double>();
        EXPECT_LE(std::abs(again[i]["valid_loss"].get<double>() - valid), c.tolerance * valid)
            << c.name << ", iteration " << i + 1;
      }
      for (const std::string& field : c.figures) {
        ASSERT_TRUE(plain[i].contains(field)) << c.name << ": " << field;
        EXPECT_EQ(again[i][field], plain[i][field]) << c.name << ": " << field << ", iteration " << i + 1;
      }
    }
    EXPECT_LT(again.back()["activation_peak_mb"].get<double>(), plain.back()["activation_peak_mb"].get<double>())
        << c.name;
    // What each case exercises did happen: weights sparse enough for the sparse products
    // (core/sparse_linear.h: below kSparseCrossoverDensity), tokens exiting.
    if (c.name == "prune") {
      EXPECT_LT(testing::SparsestLayerDensity(plain.back()), kSparseCrossoverDensity)
          << "some layer runs sparse products";
    }
    if (c.name == "mod_early_exit") {
      EXPECT_LT(plain.back()["early_exit_avg_layers"].get<double>(), 4.0) << "tokens exited";
    }
  }
}

TEST(RecomputeFlagsTest, BadFlagsExitTwoNamingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--recompute_granularity=selective --recompute_num_layers=2",
       "--recompute_num_layers is for --recompute_granularity=full"},
      {"--recompute_granularity=partial", "--recompute_granularity='partial' is unknown"},
      {"--recompute_num_layers=2", "--recompute_num_layers needs --recompute_granularity=full"},
      {"--recompute_granularity=full --recompute_num_layers=-1", "must be ≥ 0"},
      {"--recipe=tiny_moe --recompute_granularity=full --moe_assignment_cache_threshold=0.1",
       "plugin 'moe' does not support recomputation yet"},
  };
  for (const auto& [flags, message] : cases) {
    std::string output;
    EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, "--recipe=tiny --train_iters=2 " + flags), &output), 2)
        << flags << "\n" << output;
    EXPECT_THAT(output, HasSubstr(message)) << flags;
  }
}

}  // namespace
}  // namespace fulcrum
