// Checking a test binary's own cases re-run as workers under fulcrum_launch (each line of a
// rank's output prefixed "[rank K] "). A worker whose --gtest_filter matches nothing prints
// "[  PASSED  ] 0 tests." and exits 0, so the exit code and a "PASSED" alone prove nothing:
// each rank must have run, and passed, every case the filter selects.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/run_command.h"

namespace fulcrum::testing {

/// The number of cases of `binary` that `filter` selects, as --gtest_list_tests lists them;
/// -1 when the binary cannot be listed.
inline int CountSelectedTests(const std::string& binary, const std::string& filter) {
  std::string listing;
  if (RunCommand(binary + " --gtest_list_tests --gtest_filter='" + filter + "'", &listing) != 0) {
    return -1;
  }
  int count = 0;
  std::istringstream lines(listing);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("  ", 0) == 0) ++count;  // Cases are indented under their suite.
  }
  return count;
}

/// Whether each of `ranks` printed gtest's summary of running and passing `tests` cases
/// (which must be at least one) in `output`.
inline ::testing::AssertionResult RanksRanAndPassed(const std::string& output,
                                                    const std::vector<int>& ranks, int tests) {
  if (tests < 1) {
    return ::testing::AssertionFailure() << "the workers' filter selects " << tests << " cases";
  }
  static const std::regex kRan(R"(^\[rank (\d+)\] \[==========\] (\d+) tests? from .* ran\.)");
  static const std::regex kPassed(R"(^\[rank (\d+)\] \[  PASSED  \] (\d+) tests?\.)");
  std::map<int, int> ran, passed;
  std::istringstream lines(output);
  std::smatch m;
  for (std::string line; std::getline(lines, line);) {
    if (std::regex_search(line, m, kRan)) ran[std::stoi(m[1])] = std::stoi(m[2]);
    if (std::regex_search(line, m, kPassed)) passed[std::stoi(m[1])] = std::stoi(m[2]);
  }
  for (int rank : ranks) {
    if (ran.count(rank) == 0 || ran[rank] != tests || passed.count(rank) == 0 ||
        passed[rank] != tests) {
      return ::testing::AssertionFailure()
             << "rank " << rank << " ran " << (ran.count(rank) ? ran[rank] : 0) << " and passed "
             << (passed.count(rank) ? passed[rank] : 0) << " cases, expected " << tests;
    }
  }
  return ::testing::AssertionSuccess();
}

/// Ranks 0..n-1.
inline std::vector<int> FirstRanks(int n) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return ranks;
}

}  // namespace fulcrum::testing
