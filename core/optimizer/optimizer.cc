#include "core/optimizer/optimizer.h"

namespace fulcrum {

absl::StatusOr<std::vector<MomentSlice>> Optimizer::StateParts(const std::vector<Unit*>& units,
                                                               ParallelContext& collectives) {
  if (SlicesState()) return MomentSlices(units, collectives);
  return WholeStateParts(units);
}

}  // namespace fulcrum
