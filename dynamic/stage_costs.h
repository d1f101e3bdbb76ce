// What each stage of a placement runs per micro-batch, from per-layer costs: the one
// conversion the re-packing decision (repack.cc) and the scale simulator (simulation.cc)
// hand pipeline::Simulate.
#pragma once

#include <vector>

#include "dynamic/balance_problem.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::dynamic {

/// The sum of values[l] over the layers of `range`; an empty `values` is all zeros.
double RangeSum(const std::vector<double>& values, StageRange range);

/// Per stage of `placement` (one range per stage, or per virtual stage in model order): the
/// F, B and W of its layers — `forward`, `backward`, `weight` per layer, empty meaning zeros
/// — plus `first_stage` on the first range (the embedding) and `last_stage` on the last
/// (norm, head, loss), both on a single range; `p2p` per transfer on every stage.
std::vector<pipeline::ActionCosts> PlacementStageCosts(const std::vector<double>& forward,
                                                       const std::vector<double>& backward,
                                                       const std::vector<double>& weight,
                                                       const pipeline::ActionCosts& first_stage,
                                                       const pipeline::ActionCosts& last_stage,
                                                       const Placement& placement, double p2p);

}  // namespace fulcrum::dynamic
