#include "core/optimizer/parameter_parts.h"

namespace fulcrum {

std::vector<GradientPart> WholeGradientParts(const std::vector<Unit*>& units) {
  std::vector<GradientPart> parts;
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      at::Tensor& g = p.value.mutable_grad();
      if (!g.defined()) continue;
      if (!g.is_contiguous()) g = g.contiguous();
      parts.push_back(GradientPart{unit, &p, 0, g.numel(), g.view({-1}),
                                   p.sharding.ReducedOverExpertData()});
    }
  }
  return parts;
}

std::vector<MomentSlice> WholeStateParts(const std::vector<Unit*>& units) {
  std::vector<MomentSlice> parts;
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      MomentSlice part{unit, &p, 0, p.value.numel(), {}};
      for (auto& [slot, tensor] : p.optimizer_state) {
        if (!tensor.defined()) continue;
        if (!tensor.is_contiguous()) tensor = tensor.contiguous();  // so that the view writes it
        part.state.emplace_back(slot, tensor.view({-1}));
      }
      if (!part.state.empty()) parts.push_back(std::move(part));
    }
  }
  return parts;
}

}  // namespace fulcrum
