// Expert parallelism through the real binaries (fulcrum_launch, Gloo): the tiny_moe recipe
// for 20 iterations under ep=2, ep=4, ep=2×tp=2, pp=2×ep=2, a dropless capacity and
// per-expert (variable-size) buffers gives
// the single-process loss curve (NOTE [MoE layout equivalence] in moe/moe_layer.h); the
// hierarchical all-to-all gives exactly the flat one's; a checkpoint saved at ep=2 resumes
// at ep=1; the metrics report every expert's tokens; cached assignments (DynaMoE) agree
// over layouts, layer moves and resumes.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"

namespace fulcrum {
namespace {

// Expert-weight gradients are summed in another order when tokens come from several
// ranks (train_runs.h).
constexpr double kMoeRelativeTolerance = testing::kLayoutTolerance;

class SlowMoeTrainTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::MakeTempDir("moe_train"));
    std::string output;
    const int code = testing::RunCommand(
        testing::TrainCommand(1, Common() + " --metrics_file=" + *dir_ + "/single.jsonl"), &output);
    ASSERT_EQ(code, 0) << output;
    single_ = new std::vector<nlohmann::json>(testing::MetricsRecords(*dir_ + "/single.jsonl"));
    ASSERT_EQ(single_->size(), 20u);
  }
  static std::string Common() {
    // Inside the warm-up: past it, a rounding difference flips a routing choice (train_runs.h).
    return "--recipe=tiny_moe --train_iters=20 --eval_interval=0 --log_interval=10 "
           "--global_batch_size=16 --micro_batch_size=4";
  }
  // Runs `layout` on n processes; returns its losses after checking them against `reference`.
  std::vector<double> ExpectMatches(int n, const std::string& layout, const std::string& name,
                                    const std::vector<double>& reference, double tolerance) {
    std::vector<double> losses = testing::LossesOf(
        testing::TrainRecords(n, Common() + " " + layout, *dir_ + "/" + name + ".jsonl"));
    EXPECT_EQ(losses.size(), 20u) << "one metrics line per iteration, from one rank";
    const double worst = testing::MaxRelativeDifference(losses, reference);
    std::cout << name << ": max relative loss difference over 20 iterations: " << worst
              << std::endl;
    EXPECT_LE(worst, tolerance);
    return losses;
  }
  // Runs `layout` on 2 processes as it is and with `script` (--rebalance_script) moving
  // layers between the stages; every iteration's `fields` must be bit-identical in the two
  // runs. Returns the unmoved run's records.
  std::vector<nlohmann::json> ExpectMovesChangeNothing(const std::string& layout,
                                                       const std::string& script,
                                                       const std::string& name,
                                                       const std::vector<std::string>& fields) {
    std::vector<std::vector<nlohmann::json>> runs;
    for (const std::string& moves : {std::string(), " --rebalance_script='" + script + "'"}) {
      runs.push_back(testing::TrainRecords(
          2, Common() + " " + layout + moves,
          *dir_ + "/" + name + (moves.empty() ? "" : "_moved") + ".jsonl"));
      EXPECT_EQ(runs.back().size(), 20u);
    }
    // The moves happened (else "nothing changed" would hold vacuously): the moved run
    // counts every scripted move at its iteration, the other none.
    EXPECT_EQ(testing::LayersMovedOf(runs[1]), testing::ScriptedMovesByIteration(script, 20));
    EXPECT_EQ(testing::LayersMovedOf(runs[0]), std::vector<int64_t>(20, 0));
    for (size_t i = 0; i < std::min(runs[0].size(), runs[1].size()); ++i) {
      for (const std::string& field : fields) {
        EXPECT_EQ(runs[0][i][field], runs[1][i][field]) << field << ", iteration " << i + 1;
      }
    }
    return runs[0];
  }
  static std::vector<double> SingleLosses() { return testing::LossesOf(*single_); }
  static std::string* dir_;
  static std::vector<nlohmann::json>* single_;
};
std::string* SlowMoeTrainTest::dir_ = nullptr;
std::vector<nlohmann::json>* SlowMoeTrainTest::single_ = nullptr;

TEST_F(SlowMoeTrainTest, SingleProcessLearnsAndReportsExpertTokens) {
  const std::vector<double> losses = SingleLosses();
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "it learns";
  // tiny_moe: layers 0 and 2 of 4 are MoE (--moe_layer_freq=2), 8 experts, top-2 routing
  // of 16 × 128 tokens: every layer's expert tokens sum to k·T = 4096 each iteration.
  for (const auto& record : *single_) {
    ASSERT_TRUE(record.contains("expert_tokens")) << record.dump();
    const auto& per_layer = record["expert_tokens"];
    ASSERT_EQ(per_layer.size(), 2u) << per_layer.dump();
    for (const char* layer : {"layers.0", "layers.2"}) {
      const std::vector<double> tokens = per_layer[layer].get<std::vector<double>>();
      ASSERT_EQ(tokens.size(), 8u);
      double sum = 0;
      for (double t : tokens) sum += t;
      EXPECT_EQ(sum, 2.0 * 16 * 128) << layer;
    }
    EXPECT_GT(record["load_balancing_loss"].get<double>(), 0.0);
    EXPECT_GT(record["z_loss"].get<double>(), 0.0);
    // Capacity 1.25: each of the 4 micro-batches of 4 × 128 tokens gives an expert
    // C = 1.25 · 2 · 512 / 8 = 160 slots. An expert routed L tokens in an iteration (its
    // expert_tokens, counted before drops) dropped at least L - 4C (all micro-batches full)
    // and at most L - C (one micro-batch took them all); dropped_tokens sums both layers.
    constexpr double kCapacity = 160;
    constexpr int kMicroBatches = 4;
    double at_least = 0;
    double at_most = 0;
    for (const char* layer : {"layers.0", "layers.2"}) {
      for (double load : per_layer[layer].get<std::vector<double>>()) {
        at_least += std::max(0.0, load - kMicroBatches * kCapacity);
        at_most += std::max(0.0, load - kCapacity);
      }
    }
    const double dropped = record["dropped_tokens"].get<double>();
    EXPECT_EQ(dropped, std::round(dropped));
    EXPECT_GE(dropped, at_least) << record.dump();
    EXPECT_LE(dropped, at_most) << record.dump();
  }
}

TEST_F(SlowMoeTrainTest, ExpertParallelTwo) {
  const std::string metrics = *dir_ + "/ep2.jsonl";
  ExpectMatches(2, "--expert_model_parallel_size=2", "ep2", SingleLosses(), kMoeRelativeTolerance);
  // The same tokens meet the same experts: identical loads every iteration.
  const std::vector<nlohmann::json> records = testing::MetricsRecords(metrics);
  ASSERT_EQ(records.size(), single_->size());
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i]["expert_tokens"], (*single_)[i]["expert_tokens"]) << "iteration " << i + 1;
    EXPECT_EQ(records[i]["dropped_tokens"], (*single_)[i]["dropped_tokens"]);
  }
}

TEST_F(SlowMoeTrainTest, ExpertParallelFourAndHierarchicalAllToAll) {
  const std::vector<double> flat = ExpectMatches(4, "--expert_model_parallel_size=4", "ep4",
                                                 SingleLosses(), kMoeRelativeTolerance);
  // Two "nodes" of two ranks: the two-level exchange moves every element where the flat
  // one does, so the losses are bit-identical.
  ExpectMatches(4, "--expert_model_parallel_size=4 --moe_hierarchical_a2a_node_size=2",
                "ep4_hierarchical", flat, 0.0);
}

TEST_F(SlowMoeTrainTest, OverlappedAllToAllGivesTheSameCurve) {
  ExpectMatches(2, "--expert_model_parallel_size=2 --moe_a2a_overlap_degree=3", "ep2_overlap3",
                SingleLosses(), kMoeRelativeTolerance);
}

TEST_F(SlowMoeTrainTest, ExpertTimesTensorParallel) {
  ExpectMatches(4, "--expert_model_parallel_size=2 --tensor_model_parallel_size=2", "ep2tp2",
                SingleLosses(), kMoeRelativeTolerance);
}

TEST_F(SlowMoeTrainTest, ExpertTimesPipelineParallel) {
  ExpectMatches(4, "--expert_model_parallel_size=2 --pipeline_model_parallel_size=2 "
                   "--pipeline_schedule=zbh1",
                "ep2pp2", SingleLosses(), kMoeRelativeTolerance);
}

TEST_F(SlowMoeTrainTest, MovingMoeLayersKeepsTheLossCurveBitIdentical) {
  // aux_free's expert bias is updated from the step's loads after the optimizer step; a
  // layer that moves between stages mid-step carries the loads measured so far, and the
  // bias travels as a unit buffer. Layer 2 (MoE) goes to stage 0 and back, layer 1 (dense)
  // to stage 1 and back.
  ExpectMovesChangeNothing(
      "--pipeline_model_parallel_size=2 --pipeline_schedule=zbh1 --moe_router=aux_free "
      "--moe_router_bias_update_rate=1e-2",
      "3:2->0;7:2->1,1->1;12:1->0", "aux_free", {"loss", "expert_tokens"});
}

TEST_F(SlowMoeTrainTest, DroplessCapacityAgreesOverTheExpertGroup) {
  // Capacity factor 0: each rank pads to the largest need of the group, and nothing drops.
  std::string output;
  const std::string single = *dir_ + "/dropless_single.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + " --moe_capacity_factor=0 --metrics_file=" + single),
                                &output),
            0)
      << output;
  const std::vector<nlohmann::json> records = testing::MetricsRecords(single);
  for (const auto& r : records) EXPECT_EQ(r["dropped_tokens"].get<double>(), 0.0);
  // Each rank pads its experts' buffers to another size than one process does, so the
  // expert GEMMs round differently (measured 3.6e-6).
  ExpectMatches(2, "--expert_model_parallel_size=2 --moe_capacity_factor=0", "dropless_ep2",
                testing::LossesOf(records), 2e-5);
}

// Mixtral's MoE (--moe_router=mixtral, dropless, no z-loss, SwiGLU experts without biases):
// one process, then ep=2 and ep=2 x tp=2 on real processes give its curve, with identical
// expert loads and nothing dropped (NOTE [MoE layout equivalence]); under tp=2 each rank's
// contiguous half of an expert's interleaved fc1 rows is whole gate/up pairs (NOTE [SwiGLU
// rows]). Measured: 4.8e-8 (ep=2), 7.0e-8 (ep=2 x tp=2), 3.6e-8 (resumed in one process).
TEST_F(SlowMoeTrainTest, MixtralMoeAgreesOverExpertAndTensorParallel) {
  const std::string mixtral =
      " --moe_router=mixtral --moe_capacity_factor=0 --moe_z_loss_coeff=0 --swiglu "
      "--disable_bias_linear";
  std::string output;
  const std::string single = *dir_ + "/mixtral_single.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + mixtral + " --metrics_file=" + single),
                                &output),
            0)
      << output;
  const std::vector<nlohmann::json> records = testing::MetricsRecords(single);
  ASSERT_EQ(records.size(), 20u);
  for (const auto& r : records) {
    EXPECT_EQ(r["dropped_tokens"].get<double>(), 0.0);
    EXPECT_FALSE(r.contains("z_loss"));
  }
  const std::vector<double> losses = testing::LossesOf(records);
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "it learns";
  for (const auto& [n, layout, name] :
       std::vector<std::tuple<int, std::string, std::string>>{
           {2, "--expert_model_parallel_size=2", "mixtral_ep2"},
           {4, "--expert_model_parallel_size=2 --tensor_model_parallel_size=2", "mixtral_ep2tp2"}}) {
    ExpectMatches(n, mixtral + " " + layout, name, losses, kMoeRelativeTolerance);
    const std::vector<nlohmann::json> parallel = testing::MetricsRecords(*dir_ + "/" + name + ".jsonl");
    ASSERT_EQ(parallel.size(), records.size());
    for (size_t i = 0; i < records.size(); ++i) {
      EXPECT_EQ(parallel[i]["expert_tokens"], records[i]["expert_tokens"]) << name << " " << i + 1;
    }
  }
  // The checkpoint holds the full interleaved tensors: saved at ep=2 x tp=2, it resumes in
  // one process on the one-process curve.
  const std::string ckpt = testing::MakeTempDir("mixtral_ckpt");
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(4, Common() + mixtral +
                                                             " --expert_model_parallel_size=2 "
                                                             "--tensor_model_parallel_size=2 --save=" +
                                                             ckpt + " --exit_interval=10"),
                                &output),
            0)
      << output;
  const std::string resumed_metrics = ckpt + "/resumed.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + mixtral + " --load=" + ckpt +
                                                             " --metrics_file=" + resumed_metrics),
                                &output),
            0)
      << output;
  const std::vector<double> resumed = testing::LossesOf(testing::MetricsRecords(resumed_metrics));
  ASSERT_EQ(resumed.size(), 10u);
  const double worst = testing::MaxRelativeDifference(
      resumed, std::vector<double>(losses.begin() + 10, losses.end()));
  std::cout << "mixtral ep=2 x tp=2 -> 1 resume: max relative difference " << worst << std::endl;
  EXPECT_LE(worst, kMoeRelativeTolerance);
}

TEST_F(SlowMoeTrainTest, PerExpertCapacitySendsVariableSizeBuffers) {
  // Same tokens kept as the padded layout, so the same curve: in one process, and at ep=2
  // where the all-to-all exchanges counts first and then ragged buffers.
  ExpectMatches(1, "--moe_per_expert_capacity", "ragged_single", SingleLosses(), kMoeRelativeTolerance);
  ExpectMatches(2, "--moe_per_expert_capacity --expert_model_parallel_size=2", "ragged_ep2",
                SingleLosses(), kMoeRelativeTolerance);
}

TEST_F(SlowMoeTrainTest, CheckpointSavedAtExpertParallelTwoResumesAtOne) {
  const std::string ckpt = testing::MakeTempDir("moe_ckpt");
  std::string output;
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(2, Common() + " --expert_model_parallel_size=2 --save=" +
                                              ckpt + " --exit_interval=10"),
                                &output),
            0)
      << output;
  const std::string metrics = ckpt + "/resumed.jsonl";
  ASSERT_EQ(testing::RunCommand(
                testing::TrainCommand(1, Common() + " --load=" + ckpt + " --metrics_file=" + metrics), &output),
            0)
      << output;
  const std::vector<double> resumed = testing::LossesOf(testing::MetricsRecords(metrics));
  ASSERT_EQ(resumed.size(), 10u);
  const std::vector<double> all = SingleLosses();
  const double worst =
      testing::MaxRelativeDifference(resumed, std::vector<double>(all.begin() + 10, all.end()));
  std::cout << "ep=2 -> ep=1 resume: max relative difference " << worst << std::endl;
  EXPECT_LE(worst, kMoeRelativeTolerance);
  // Another MoE shape is refused, naming the flag.
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + " --num_experts=4 --load=" + ckpt), &output), 2)
      << output;
  EXPECT_NE(output.find("--num_experts=8"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + " --moe_router=sinkhorn --load=" + ckpt), &output), 2)
      << output;
  EXPECT_NE(output.find("--moe_router=topk"), std::string::npos) << output;
}

// DynaMoE's cached assignments (NOTE [assignment caching]). On a one-document training
// split (--split=5,95,0: 92 samples, under 6 steps an epoch) epoch 2 starts at step 13, and
// threshold 1 routes it by the cache. The cache is replicated over dp and keyed by corpus
// position, so ep=2 (dp=2) routes every token as one process does; under pp=2 with the MoE
// layer moving mid-step, the table and the step's records travel and the curve stays
// bit-identical; a checkpoint carries the table, so a resume continues bit for bit.
TEST_F(SlowMoeTrainTest, CachedAssignmentsAgreeOverLayoutsMovesAndResumes) {
  const std::string cache = " --split=5,95,0 --moe_assignment_cache_threshold=1";
  std::string output;
  const std::string single = *dir_ + "/cache_single.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + cache + " --metrics_file=" + single), &output), 0)
      << output;
  const std::vector<nlohmann::json> records = testing::MetricsRecords(single);
  ASSERT_EQ(records.size(), 20u);
  for (size_t i = 0; i < records.size(); ++i) {
    for (const char* layer : {"layers.0", "layers.2"}) {
      const std::vector<double> c = records[i]["assignment_cache"][layer].get<std::vector<double>>();
      ASSERT_EQ(c.size(), 4u);
      const int iteration = static_cast<int>(i) + 1;
      // [changed, met again, routed by cache] of 16·128 tokens: nothing met again in epoch
      // 0 (steps 1-5; step 6 runs into epoch 1); from step 7 (epoch 1) nearly every token
      // (not those of the tail the previous epoch left out); from step 13 (epoch 2) the
      // tokens met again are routed by the cache.
      if (iteration <= 5) {
        EXPECT_EQ(c[1], 0.0) << iteration;
      }
      if (iteration >= 7) {
        EXPECT_GE(c[1], 0.95 * 16 * 128) << iteration;
      }
      EXPECT_EQ(c[2], iteration >= 13 ? c[1] : 0.0) << iteration << " " << layer;
      // Micro-batches whose exchange started before the router: all 4 once fully cached.
      if (iteration < 13) {
        EXPECT_EQ(c[3], 0.0) << iteration;
      }
      if (iteration >= 14) {
        EXPECT_EQ(c[3], 4.0) << iteration;
      }
      EXPECT_LE(c[0], c[1]);
    }
  }
  const std::vector<double> losses = testing::LossesOf(records);
  ExpectMatches(2, cache + " --expert_model_parallel_size=2", "cache_ep2", losses, kMoeRelativeTolerance);

  const std::vector<nlohmann::json> pp2 = ExpectMovesChangeNothing(
      cache + " --pipeline_model_parallel_size=2 --pipeline_schedule=zbh1", "9:2->0;14:2->1",
      "cache_pp2", {"loss", "assignment_cache"});
  EXPECT_LE(testing::MaxRelativeDifference(testing::LossesOf(pp2), losses), kMoeRelativeTolerance);

  // Saved at step 10 (epoch 1, the table full of epoch 0 and 1 choices), resumed to 20.
  const std::string ckpt = testing::MakeTempDir("moe_cache_ckpt");
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + cache + " --save=" + ckpt +
                                                             " --exit_interval=10"),
                                &output),
            0)
      << output;
  const std::string resumed_metrics = ckpt + "/resumed.jsonl";
  ASSERT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + cache + " --load=" + ckpt +
                                                             " --metrics_file=" + resumed_metrics),
                                &output),
            0)
      << output;
  const std::vector<nlohmann::json> resumed = testing::MetricsRecords(resumed_metrics);
  ASSERT_EQ(resumed.size(), 10u);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i]["loss"], records[10 + i]["loss"]) << "iteration " << 11 + i;
    EXPECT_EQ(resumed[i]["assignment_cache"], records[10 + i]["assignment_cache"]) << 11 + i;
  }
  // Without the cache the checkpoint's state does not fit: refused, naming the flag.
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, Common() + " --split=5,95,0 --load=" + ckpt), &output), 2)
      << output;
  EXPECT_NE(output.find("--moe_assignment_cache_threshold"), std::string::npos) << output;
}

// The same over a two-document split (--split=12,88,0: 252 samples an epoch, 4 steps of 64):
// the documents are reshuffled every epoch, so the windows move and a token is known only
// by its corpus position; ranks may hold micro-batches with tokens never routed before
// (those take the router-first path) beside fully cached ones. ep=2 still routes every
// token as one process does.
TEST_F(SlowMoeTrainTest, CachedAssignmentsSurviveDocumentReshuffles) {
  // Routing counts are compared exactly: the layouts' fp32 rounding must stay below the
  // routers' top-2 margins for 16 steps, which it does with experts half the MLP's width
  // (with tiny_moe's full-width experts one or two of 8192 near-tied choices flip from
  // step 6 on — rounding, not the cache).
  const std::string args =
      "--recipe=tiny_moe --moe_ffn_hidden_size=256 --train_iters=16 --eval_interval=0 "
      "--log_interval=10 --global_batch_size=64 --micro_batch_size=8 --split=12,88,0 "
      "--moe_assignment_cache_threshold=1";
  std::vector<std::vector<nlohmann::json>> runs;
  for (const std::string& layout : {std::string(), std::string(" --expert_model_parallel_size=2")}) {
    std::string output;
    const std::string metrics = *dir_ + "/reshuffle" + std::to_string(runs.size()) + ".jsonl";
    ASSERT_EQ(testing::RunCommand(testing::TrainCommand(layout.empty() ? 1 : 2,
                                                        args + layout + " --metrics_file=" + metrics),
                                  &output),
              0)
        << output;
    runs.push_back(testing::MetricsRecords(metrics));
    ASSERT_EQ(runs.back().size(), 16u);
  }
  double cached = 0;
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(runs[0][i]["assignment_cache"], runs[1][i]["assignment_cache"]) << "iteration " << i + 1;
    for (const char* layer : {"layers.0", "layers.2"}) {
      const std::vector<double> c = runs[0][i]["assignment_cache"][layer].get<std::vector<double>>();
      cached += c[2];
      if (c[2] > 0) {
        EXPECT_EQ(c[2], c[1]) << "every token met again is routed by the cache";
      }
    }
  }
  EXPECT_GT(cached, 0) << "epoch 2 (from step 9) routes by the cache";
  const double worst = testing::MaxRelativeDifference(testing::LossesOf(runs[0]), testing::LossesOf(runs[1]));
  std::cout << "cached assignments, two documents, ep=2 vs 1: max relative difference " << worst
            << std::endl;
  EXPECT_LE(worst, kMoeRelativeTolerance);
}

TEST(MoeFlagsTest, BadExpertLayoutsAreRefusedBeforeAnyWork) {
  std::string output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, "--recipe=tiny_moe --num_experts=6 "
                                                         "--expert_model_parallel_size=4 --train_iters=1"),
                                &output),
            2);
  // One process cannot hold ep=4; the layout check names the sizes.
  EXPECT_NE(output.find("expert"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(
                testing::TrainCommand(1, "--recipe=tiny_moe --moe_router=nope --train_iters=1"), &output),
            2);
  EXPECT_NE(output.find("nope"), std::string::npos) << output;
  EXPECT_NE(output.find("topk"), std::string::npos) << "lists the known routers: " << output;
  EXPECT_EQ(testing::RunCommand(testing::TrainCommand(1, "--recipe=tiny --expert_model_parallel_size=2 "
                                                         "--train_iters=1"),
                                &output),
            2);
}

}  // namespace
}  // namespace fulcrum
