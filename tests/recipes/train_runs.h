// Running fulcrum_train from tests: the command line for n processes, reading back the
// metrics file it wrote, and the one-process / other-layouts / resume pattern of the
// plugins' train tests (PluginTrainRuns). Shared by the layout-equivalence tests of
// tests/recipes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"  // MakeTempDir
#include "tests/run_command.h"

namespace fulcrum::testing {

/// `fulcrum_train ARGS`, under fulcrum_launch (a free port) when n > 1.
inline std::string TrainCommand(int n, const std::string& args) {
  const std::string bin = FULCRUM_BIN_DIR;
  const std::string train = bin + "/fulcrum_train " + args;
  if (n == 1) return train;
  return bin + "/fulcrum_launch --nproc_per_node=" + std::to_string(n) + " --master_port=0 -- " +
         train;
}

/// Every line of a metrics file, parsed.
inline std::vector<nlohmann::json> MetricsRecords(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

inline std::vector<double> LossesOf(const std::vector<nlohmann::json>& records) {
  std::vector<double> losses;
  for (const auto& r : records) losses.push_back(r["loss"].get<double>());
  return losses;
}

/// The valid_loss of every record that evaluated, in order.
/// The smallest kept fraction over the layers of a record's `prune_layer_density` (1 when
/// none): below kSparseCrossoverDensity (core/sparse_linear.h) a weight runs sparse products.
inline double SparsestLayerDensity(const nlohmann::json& record) {
  double sparsest = 1;
  for (const auto& [layer, density] : record["prune_layer_density"].items()) {
    sparsest = std::min(sparsest, density.get<double>());
  }
  return sparsest;
}

inline std::vector<double> ValidLossesOf(const std::vector<nlohmann::json>& records) {
  std::vector<double> losses;
  for (const auto& r : records) {
    if (r.contains("valid_loss")) losses.push_back(r["valid_loss"].get<double>());
  }
  return losses;
}

/// How far apart, relative, two layouts of one fp32 run may end on any iteration's loss
/// (training or validation): reductions summed in another order round differently, and
/// training amplifies that. Measured on the tiny recipes past the warm-up (kPastWarmup):
/// 1.5e-8 to 6e-8 over 12 iterations with pipeline stages, up to 2.5e-6 over 20 iterations
/// with tensor parallelism (tp2dp2). Turning weight decay off moves the same runs by 2.8e-5
/// within 12 iterations, so a layout that dropped it fails (SlowLayoutToleranceTest is that
/// negative control).
///
/// Plugins that make discrete choices from the activations (MoE routing with capacity
/// drops, sparse attention's bucket blocks) flip a choice on such a rounding difference once
/// the learning rate is high, and from then on the curves part (1e-4 after 20 iterations:
/// their tests compare inside the warm-up, where the measured differences are below 1e-7,
/// except MoE's dropless capacity, which pads to another size).
inline constexpr double kLayoutTolerance = 5e-6;

/// Tensor parallelism splits every GEMM's reduction in two, and how far that moves an fp32
/// run depends on the CPU's GEMM kernels: the tiny recipe under tp=2 for 20 iterations past
/// the warm-up parts from one process by 2.5e-6 on an AVX2 CPU but by 1.6e-5 on an
/// AVX-512/AMX Xeon, as far as weight decay's whole effect. So the comparisons that involve
/// tensor or sequence parallelism run in fp64 (kFp64) and hold to kFp64LayoutTolerance: on
/// that Xeon tp=2, tp=2×dp=2 and pp=2×tp=2 then part from one process by 7e-15 at most
/// (one thread per process, as ctest runs them; 4.4e-10 when the one-process run used two
/// threads, whose reductions split too, and the gradient spike of iteration 6 — grad norm
/// 40 — amplified that ~1000×). 1e-8 leaves that room and is 2800× below what dropping
/// weight decay does (2.8e-5), so a layout bug of a part in a million fails it.
inline constexpr char kFp64[] = " --params_dtype=fp64";
inline constexpr double kFp64LayoutTolerance = 1e-8;

/// Appended to a short test run's flags so it leaves the learning-rate warm-up after
/// iteration 2 and decays to min_lr by the last iteration: the recipes' 20-iteration warm-up
/// would keep a <= 20-iteration run at a tiny learning rate where weight decay and min_lr
/// barely act.
inline constexpr char kPastWarmup[] = " --lr_warmup_iters=2";

/// The distributed optimizer (ZeRO-1: AdamW state sharded over data parallelism).
inline constexpr char kZero[] = " --use_distributed_optimizer";

/// The largest |a[i] − b[i]| / |b[i]| over the common length.
/// The tiny recipe at 8 layers (two per virtual stage at pp = 2, v = 2), 8 micro-batches of
/// 2, evaluated at the half: what the virtual-pipeline tests train for `iterations`.
inline std::string EightLayerTinyFlags(int iterations) {
  return "--recipe=tiny --num_layers=8 --seq_length=32 --train_iters=" +
         std::to_string(iterations) + " --eval_interval=" + std::to_string(iterations / 2) +
         " --eval_iters=1 --log_interval=" + std::to_string(iterations / 2) +
         " --global_batch_size=16 --micro_batch_size=2" + std::string(kPastWarmup);
}

inline double MaxRelativeDifference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  }
  return worst;
}

/// For a --rebalance_script "ITER:L->S[,L->S...][;...]", the number of layer moves made up
/// to and including each iteration 1..iterations (what the metrics field layers_moved
/// counts), so a test can assert that the moves really happened.
inline std::vector<int64_t> ScriptedMovesByIteration(const std::string& script, int iterations) {
  std::map<int64_t, int64_t> moves_at;
  size_t start = 0;
  while (start < script.size()) {
    size_t end = script.find(';', start);
    if (end == std::string::npos) end = script.size();
    const std::string step = script.substr(start, end - start);
    const size_t colon = step.find(':');
    if (colon != std::string::npos) {
      int64_t count = 0;
      for (size_t at = step.find("->"); at != std::string::npos; at = step.find("->", at + 2)) ++count;
      moves_at[std::stoll(step.substr(0, colon))] += count;
    }
    start = end + 1;
  }
  std::vector<int64_t> cumulative;
  int64_t total = 0;
  for (int i = 1; i <= iterations; ++i) {
    total += moves_at.count(i) ? moves_at[i] : 0;
    cumulative.push_back(total);
  }
  return cumulative;
}

/// The layers_moved field of every record.
inline std::vector<int64_t> LayersMovedOf(const std::vector<nlohmann::json>& records) {
  std::vector<int64_t> out;
  for (const auto& r : records) out.push_back(r.value("layers_moved", int64_t{-1}));
  return out;
}

/// Runs `fulcrum_train FLAGS --metrics_file=METRICS` on `n` processes and returns the
/// metrics records. A non-zero exit fails the test (not fatally; the message holds the
/// output); `output`, when given, receives what the run printed.
inline std::vector<nlohmann::json> TrainRecords(int n, const std::string& flags,
                                                const std::string& metrics,
                                                std::string* output = nullptr) {
  std::string printed;
  EXPECT_EQ(RunCommand(TrainCommand(n, flags + " --metrics_file=" + metrics), &printed), 0)
      << printed;
  if (output != nullptr) *output = std::move(printed);
  return MetricsRecords(metrics);
}

/// As TrainRecords, but a failed run is a fatal failure (call it under
/// ASSERT_NO_FATAL_FAILURE); the records go to `records`.
inline void RunTrainOrFail(int n, const std::string& flags, const std::string& metrics,
                           std::vector<nlohmann::json>* records, std::string* output) {
  ASSERT_EQ(RunCommand(TrainCommand(n, flags + " --metrics_file=" + metrics), output), 0)
      << *output;
  *records = MetricsRecords(metrics);
}

/// One layout a plugin's train test holds to the one-process run: its name (of the metrics
/// file, in messages) and the flags it adds to the test's common flags.
struct TrainLayout {
  std::string name;
  std::string flags;
};

// NOTE [plugin train runs]
// Every plugin's train test (tests/recipes/*_train_test.cc) proves its plugin the same way:
// one process trains, saving checkpoints; other layouts on two processes train the same
// losses (within kLayoutTolerance); a resume from a checkpoint continues the straight run
// bit for bit. PluginTrainRuns runs those three steps and asserts what they have in common;
// the test asserts what its plugin does (that a freeze froze, a prune pruned, ...) through
// the records and the output it hands back. A run that fails or logs the wrong number of
// iterations is a fatal failure inside the helper: call the steps under
// ASSERT_NO_FATAL_FAILURE so that the test stops there too.
class PluginTrainRuns {
 public:
  /// Layout check: the layout's name and its records.
  using LayoutCheck =
      std::function<void(const std::string& name, const std::vector<nlohmann::json>& records)>;

  /// `plugin` names the temp dir (PLUGIN_train) and the printed differences; `common` holds
  /// the flags every run shares, with --train_iters=`iterations`.
  PluginTrainRuns(std::string plugin, std::string common, size_t iterations)
      : plugin_(std::move(plugin)),
        common_(std::move(common)),
        iterations_(iterations),
        dir_(MakeTempDir(plugin_ + "_train")) {}

  /// Trains in one process, saving a checkpoint every `save_interval` iterations; fatal
  /// unless it exits 0 and logs one record per iteration. Then one() and output() hold them.
  void RunOneProcess(int save_interval) {
    const std::string save =
        " --save=" + checkpoints() + " --save_interval=" + std::to_string(save_interval);
    ASSERT_NO_FATAL_FAILURE(
        RunTrainOrFail(1, common_ + save, dir_ + "/one.jsonl", &one_, &output_));
    ASSERT_EQ(one_.size(), iterations_);
  }

  /// Trains each layout on two processes: fatal unless it exits 0 and logs one record per
  /// iteration; its losses must be within kLayoutTolerance (relative) of the one-process
  /// run's. Then `check`, if any, asserts the plugin's own agreement.
  void ExpectLayoutsTrainTheOneProcessLosses(const std::vector<TrainLayout>& layouts,
                                             const LayoutCheck& check = nullptr) {
    for (const TrainLayout& layout : layouts) {
      std::vector<nlohmann::json> records;
      ASSERT_NO_FATAL_FAILURE(RunTrainOrFail(2, common_ + layout.flags,
                                             dir_ + "/" + layout.name + ".jsonl", &records,
                                             &output_));
      ASSERT_EQ(records.size(), iterations_) << layout.name;
      const double worst = MaxRelativeDifference(LossesOf(records), LossesOf(one_));
      std::cout << plugin_ << " " << layout.name
                << ": max relative loss difference vs one process " << worst << std::endl;
      EXPECT_LE(worst, kLayoutTolerance) << layout.name;
      if (check) check(layout.name, records);
    }
  }

  /// Resumes in one process from the checkpoint of iteration `from`: fatal unless it logs
  /// the remaining iterations; each one's loss and `fields` must equal the straight run's
  /// bit for bit. Returns the resumed records.
  std::vector<nlohmann::json> ExpectResumeContinuesBitForBit(
      int from, const std::vector<std::string>& fields = {}) {
    std::vector<nlohmann::json> after;
    RunResume(from, fields, &after);
    return after;
  }

  const std::vector<nlohmann::json>& one() const { return one_; }
  /// What the last run printed.
  const std::string& output() const { return output_; }
  const std::string& dir() const { return dir_; }
  /// Where the one-process run saves, and its checkpoint of `iteration`.
  std::string checkpoints() const { return dir_ + "/ckpt"; }
  std::string checkpoint(int iteration) const {
    char name[32];
    std::snprintf(name, sizeof(name), "/iter_%07d", iteration);
    return checkpoints() + name;
  }

 private:
  void RunResume(int from, const std::vector<std::string>& fields,
                 std::vector<nlohmann::json>* after) {
    ASSERT_NO_FATAL_FAILURE(RunTrainOrFail(1, common_ + " --load=" + checkpoint(from),
                                           dir_ + "/resumed.jsonl", after, &output_));
    ASSERT_EQ(after->size(), iterations_ - from);
    for (size_t i = 0; i < after->size(); ++i) {
      EXPECT_EQ((*after)[i]["loss"], one_[from + i]["loss"]) << "iteration " << from + i + 1;
      for (const std::string& field : fields) {
        EXPECT_EQ((*after)[i][field], one_[from + i][field])
            << field << ", iteration " << from + i + 1;
      }
    }
  }

  std::string plugin_;
  std::string common_;
  size_t iterations_;
  std::string dir_;
  std::vector<nlohmann::json> one_;
  std::string output_;
};

}  // namespace fulcrum::testing
