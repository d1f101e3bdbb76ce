// Running fulcrum_train from tests: the command line for n processes, and reading back the
// metrics file it wrote. Shared by the layout-equivalence tests of tests/recipes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

/// Appended to a short test run's flags so it leaves the learning-rate warm-up after
/// iteration 2 and decays to min_lr by the last iteration: the recipes' 20-iteration warm-up
/// would keep a <= 20-iteration run at a tiny learning rate where weight decay and min_lr
/// barely act.
inline constexpr char kPastWarmup[] = " --lr_warmup_iters=2";

/// The largest |a[i] − b[i]| / |b[i]| over the common length.
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

}  // namespace fulcrum::testing
