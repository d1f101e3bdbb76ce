// Running fulcrum_train from tests: the command line for n processes, and reading back the
// metrics file it wrote. Shared by the layout-equivalence tests of tests/recipes.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
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

/// The largest |a[i] − b[i]| / |b[i]| over the common length.
inline double MaxRelativeDifference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  }
  return worst;
}

}  // namespace fulcrum::testing
