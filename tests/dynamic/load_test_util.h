// Synthetic stage loads for the load-model and rebalancer tests (tests/dynamic): what the
// pipeline runner would hand the rebalancer hook (pipeline::StageLoad), built from per-layer
// times and a placement, so a test knows the right answer in closed form.
#pragma once

#include <cstdint>
#include <vector>

#include "dynamic/balance_problem.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic::balance_testing {

/// Per global layer F+B+W in ms, plus the pinned times; the stage totals are the sums.
struct SyntheticTimes {
  std::vector<double> layer_ms;
  double first_ms = 0;  ///< Embedding: on stage 0's forward.
  double last_ms = 0;   ///< Head and loss: on the last stage's forward.
};

/// The loads of a pipeline whose stages hold `now` and ran the measured iteration on
/// `ran_on` (the same as `now` unless layers moved at its end: StageLoad's totals are those
/// of the stage as it ran). Each layer's time is split F = ¼, B = ½, W = ¼ (exact in binary
/// for the tests' values); layer_parameters and state bytes are empty, peak_in_flight 1.
std::vector<pipeline::StageLoad> MakeLoads(const Placement& now, const Placement& ran_on,
                                           const SyntheticTimes& times);
/// MakeLoads(now, now, times).
std::vector<pipeline::StageLoad> MakeLoads(const Placement& now, const SyntheticTimes& times);

/// Loads of the first iteration: ranges only, every time zero.
std::vector<pipeline::StageLoad> UnmeasuredLoads(const Placement& now);

}  // namespace fulcrum::dynamic::balance_testing
