// The benchmarks' comparisons against references run and agree: fulcrum_bench_moe's layer
// table (moe::MoeLayer against the eager batched-GEMM layer built from the same weights) and
// fulcrum_bench_train --compare_reference (PyTorch eager and torch.compile on the venv's
// torch, the same LibTorch).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <regex>
#include <string>

#include "core/usable_cores.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

const std::string kBin = FULCRUM_BIN_DIR;

TEST(BenchMoeTest, LayerMatchesTheEagerBatchedReference) {
  std::string out;
  ASSERT_EQ(testing::RunCommand(kBin + "/fulcrum_bench_moe --tables=layer --layer_tokens=1024 "
                                       "--hidden=64 --ffn_hidden=32 --layer_rounds=1 --threads=1",
                                &out),
            0)
      << out;
  // "MoeLayer ms  eager ref ms  ratio  max |diff| out, dx  goal" then the numbers.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m,
                                std::regex(R"(\n([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.e+-]+) +)"
                                           R"(([0-9.e+-]+) +(met|not met)\n)")))
      << out;
  EXPECT_GT(std::stod(m[1]), 0.0);
  EXPECT_GT(std::stod(m[2]), 0.0);
  // The same weights, routing and GEMMs: the two layers agree to rounding.
  EXPECT_LT(std::stod(m[4]), 1e-5) << "output differs from the eager reference\n" << out;
  EXPECT_LT(std::stod(m[5]), 1e-5) << "input gradient differs from the eager reference\n" << out;
}

TEST(BenchMoeTest, RejectsAnUnknownTable) {
  std::string out;
  EXPECT_EQ(testing::RunCommand(kBin + "/fulcrum_bench_moe --tables=layers", &out), 2) << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--tables takes 'layer' and/or 'dispatch'"));
}

// --ops=p2p: a ping-pong between two real processes over Gloo, one row per size with a
// positive one-way time; one rank has no peer and is refused before any work.
TEST(BenchCommTest, PointToPointTimesOneWayBetweenRankPairs) {
  std::string out;
  ASSERT_EQ(testing::RunCommand(kBin + "/fulcrum_launch --nproc_per_node=2 --master_port=0 -- " +
                                    kBin + "/fulcrum_bench_comm --ops=p2p --min_bytes=1024 "
                                           "--max_bytes=4096 --step_factor=4 --iters=3 --warmup=1",
                                &out),
            0)
      << out;
  EXPECT_THAT(out, ::testing::HasSubstr("# p2p"));
  int rows = 0;
  const std::regex row(R"(\] +([0-9]+) +([0-9]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)
)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), row); it != std::sregex_iterator();
       ++it) {
    ++rows;
    EXPECT_GT(std::stod((*it)[3]), 0.0) << out;
  }
  EXPECT_EQ(rows, 2) << out;  // 1024 and 4096 bytes.
  EXPECT_EQ(testing::RunCommand(kBin + "/fulcrum_launch --nproc_per_node=1 --master_port=0 -- " +
                                    kBin + "/fulcrum_bench_comm --ops=p2p",
                                &out),
            2)
      << out;
  EXPECT_THAT(out, ::testing::HasSubstr("--ops=p2p needs at least 2 ranks"));
}

// The references run on the venv's torch (tools/setup.sh), the LibTorch this build uses,
// and torch.compile builds its C++ with the machine's g++ and Python.h (python3-dev, also
// from tools/setup.sh). Only a build against a LibTorch outside a venv (FULCRUM_TORCH_DIR)
// has no such python, and skips, saying so; with the venv, a reference that cannot run
// fails the test.
TEST(SlowBenchTrainTest, ComparesWithPyTorchEagerAndCompiled) {
  const std::string python = FULCRUM_VENV_PYTHON;
  if (python.empty()) {
    GTEST_SKIP() << "this build's LibTorch is not in a venv (FULCRUM_TORCH_DIR): no python "
                    "with the same torch for the reference";
  }
  std::string out;
  ASSERT_EQ(testing::RunCommand(kBin + "/fulcrum_bench_train --models=tiny --layouts= "
                                       "--compare_reference --rounds=1 --iters_per_round=1 "
                                       "--warmup_iters=1 --threads=1 --reference_python=" +
                                       python,
                                &out),
            0)
      << out;
  ASSERT_EQ(out.find("cannot import torch"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      out, m,
      std::regex(R"(tiny +ms/step: fulcrum ([0-9.]+) \| plain libtorch ([0-9.]+) \| pytorch )"
                 R"(eager ([0-9.]+) \| fulcrum/eager time ([0-9.]+))")))
      << out;
  for (int i = 1; i <= 4; ++i) EXPECT_GT(std::stod(m[i]), 0.0) << out;
  ASSERT_TRUE(std::regex_search(
      out, m,
      std::regex(R"(tiny +ms/step: fulcrum ([0-9.]+) \| torch.compile ([0-9.]+) \| )"
                 R"(fulcrum/compiled time ([0-9.]+))")))
      << out;
  for (int i = 1; i <= 3; ++i) EXPECT_GT(std::stod(m[i]), 0.0) << out;
}

// --memory_features: one round of each pair, short runs. The rows carry measured figures:
// the distributed optimizer halves the optimizer bytes at dp=2 (the goal's ±5%),
// recomputation lowers the activation peak, a sharded save spreads the bytes over the ranks.
TEST(SlowBenchTrainTest, MemoryFeaturesPrintTheirRows) {
  std::string out;
  ASSERT_EQ(testing::RunCommand(kBin + "/fulcrum_bench_train --models=tiny --layouts= "
                                       "--rounds=1 --iters_per_round=1 --warmup_iters=1 "
                                       "--memory_features --memory_rounds=1 --layout_iters=8",
                                &out),
            0)
      << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      out, m, std::regex(R"(--use_distributed_optimizer +optimizer bytes/rank ([0-9]+) -> ([0-9]+) \(ratio ([0-9.]+))")))
      << out;
  EXPECT_GT(std::stod(m[1]), 0.0);
  EXPECT_NEAR(std::stod(m[3]), 0.5, 0.025) << out;
  ASSERT_TRUE(std::regex_search(
      out, m, std::regex(R"(full -> sharded +bytes the busiest rank writes ([0-9]+) -> ([0-9]+) \(ratio ([0-9.]+)\) \| all files ([0-9]+) -> ([0-9]+) \| save s ([0-9.]+) -> ([0-9.]+))")))
      << out;
  // tp=2 x dp=2 with ZeRO: the full save's one writer holds everything; sharded, the busiest
  // rank (tp rank 0 of dp rank 0: its weights' shards, the replicated tensors, its moment
  // slices) writes about a third of that (0.34 measured, 2026-11-27).
  EXPECT_GT(std::stod(m[1]), 0.0);
  EXPECT_LT(std::stod(m[3]), 0.6) << out;
  EXPECT_NEAR(std::stod(m[5]) / std::stod(m[4]), 1.0, 0.05) << "the same state, cut otherwise";
  for (const char* feature : {"--recompute_granularity=full", "--sequence_parallel"}) {
    ASSERT_TRUE(std::regex_search(
        out, m,
        std::regex(std::string(feature) +
                   R"( +activation peak ([0-9.]+) -> ([0-9.]+) MB \(ratio ([0-9.]+)\) \| ms/iter ([0-9.]+) -> ([0-9.]+))")))
        << feature << "\n" << out;
    EXPECT_GT(std::stod(m[1]), 0.0) << feature;
    EXPECT_GT(std::stod(m[2]), 0.0) << feature;
    EXPECT_GT(std::stod(m[4]), 0.0) << feature;
    // Recomputation's peak is a fifth of the plain one's; sequence parallelism's 0.86 of
    // 4 ranks on 2 cores reads within the noise of Gloo's buffers here (README: the
    // meter's caveat), so its row is checked at the layer (TpWorker.SequenceParallel*).
    if (std::string(feature) == "--recompute_granularity=full") {
      EXPECT_LT(std::stod(m[3]), 0.5) << out;
    }
  }
  // What a save costs the loop, with and without --async_save, on every core and on all but
  // one. One period per run here: the figures are noise at this length (the README's come
  // from 51 periods per side), so only the rows are checked, not their ratio.
  const std::regex save_row(
      R"(([0-9]+) of ([0-9]+) cores --async_save +what a save costs the loop: -?[0-9]+ -> -?[0-9]+ ms \(ratio [-0-9.a-z]+; [0-9]+ periods)");
  int rows = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), save_row);
       it != std::sregex_iterator(); ++it) {
    ++rows;
  }
  EXPECT_EQ(rows, UsableCores() > 1 ? 2 : 1) << out;
}

}  // namespace
}  // namespace fulcrum
