#include "dynamic/stage_costs.h"

namespace fulcrum::dynamic {

double RangeSum(const std::vector<double>& values, StageRange range) {
  double sum = 0;
  if (values.empty()) return sum;
  for (int64_t l = range.begin; l < range.end; ++l) sum += values[l];
  return sum;
}

std::vector<pipeline::ActionCosts> PlacementStageCosts(const std::vector<double>& forward,
                                                       const std::vector<double>& backward,
                                                       const std::vector<double>& weight,
                                                       const pipeline::ActionCosts& first_stage,
                                                       const pipeline::ActionCosts& last_stage,
                                                       const Placement& placement, double p2p) {
  const int p = static_cast<int>(placement.size());
  std::vector<pipeline::ActionCosts> out(p);
  for (int s = 0; s < p; ++s) {
    pipeline::ActionCosts& c = out[s];
    c.forward = RangeSum(forward, placement[s]);
    c.backward_input = RangeSum(backward, placement[s]);
    c.backward_weight = RangeSum(weight, placement[s]);
    c.p2p = p2p;
    for (const pipeline::ActionCosts* pinned :
         {s == 0 ? &first_stage : nullptr, s == p - 1 ? &last_stage : nullptr}) {
      if (pinned == nullptr) continue;
      c.forward += pinned->forward;
      c.backward_input += pinned->backward_input;
      c.backward_weight += pinned->backward_weight;
    }
  }
  return out;
}

}  // namespace fulcrum::dynamic
