// Parts of parameters' gradients and optimizer state that one rank holds: the doors
// through which plugins read and edit reduced gradients and optimizer state whatever the
// optimizer (AdamW's whole tensors or the distributed optimizer's slices). Only LibTorch
// and core/unit.h below it, so core/plugin.h can include it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/unit.h"

namespace fulcrum {

// NOTE [reduced gradients]
// What StepRequest::after_reduce (the plugins' AfterBackward, PluginContext::gradients)
// sees of the reduced gradients, whatever the optimizer: parts, each a flat view of
// elements [begin, end) of one parameter's reduced gradient that this rank holds. Under
// AdamW every rank holds every whole gradient: one part per parameter that has one, begin
// 0. Under the distributed optimizer a rank holds only the slices it owns, and the parts of
// one gradient are spread over the data-parallel group (dense parameters) or the
// expert-data-parallel group (the experts'): a value computed from this rank's parts —
// a sum of squares, a count — becomes the whole gradient's after SumOverHolders. Element-
// wise edits of a part (a mask, an addition) are what the norm, the clip and the update
// read, on either optimizer, so a plugin written against the parts runs under both.

/// One part of a parameter's reduced gradient held by this rank.
struct GradientPart {
  const Unit* unit = nullptr;
  Parameter* param = nullptr;
  /// Elements [begin, end) of the parameter's row-major elements.
  int64_t begin = 0;
  int64_t end = 0;
  /// 1-D, end − begin elements: a view of what the step reads; writes are seen by it.
  at::Tensor grad;
  /// ShardingSpec::ReducedOverExpertData: an expert's parameter, whose parts are spread
  /// over the expert-data-parallel group (not the data-parallel one).
  bool expert = false;
};

/// This rank's parts of the reduced gradients, during StepRequest::after_reduce.
class ReducedGradients {
 public:
  /// How values over parts are summed over the holders of the other parts (null: every
  /// part is a whole gradient; nothing to sum).
  using HolderSum = std::function<void(bool expert, std::vector<double>& values)>;
  explicit ReducedGradients(std::vector<GradientPart> parts, HolderSum sum = nullptr)
      : parts_(std::move(parts)), sum_(std::move(sum)) {}

  /// Every part this rank holds, of every parameter that has a reduced gradient (on any
  /// rank of its group). Under the distributed optimizer a rank may hold no part of a
  /// parameter that has one.
  const std::vector<GradientPart>& parts() const { return parts_; }
  /// Whether the parts are slices spread over ranks (the distributed optimizer).
  bool sliced() const { return static_cast<bool>(sum_); }
  /// Sums `values`, computed from this rank's parts of dense (`expert` false) or experts'
  /// gradients, over the ranks holding the other parts of the same gradients: afterwards
  /// they are the whole gradients' values, the same on every holder. A no-op when the parts
  /// are whole. Collective over that group (every rank of it calls it alike, with `values`
  /// of the same length), so call it on every rank whether or not it holds parts.
  void SumOverHolders(bool expert, std::vector<double>& values) const {
    if (sum_) sum_(expert, values);
  }

 private:
  std::vector<GradientPart> parts_;
  HolderSum sum_;
};

/// Every defined gradient of `units`, whole, as the parts of NOTE [reduced gradients] (one
/// per parameter; a non-contiguous gradient is made contiguous first, so the view writes it).
std::vector<GradientPart> WholeGradientParts(const std::vector<Unit*>& units);

/// A part of one parameter's optimizer state that this rank holds: elements [begin, end)
/// of the parameter's row-major elements on this rank — the distributed optimizer's owned
/// slice of its moments (Optimizer::MomentSlices), or the whole state (WholeStateParts).
struct MomentSlice {
  const Unit* unit = nullptr;
  const Parameter* param = nullptr;
  int64_t begin = 0;
  int64_t end = 0;
  /// The optimizer's own state of the slice, by slot (StateSlots): 1-D, end − begin
  /// elements each.
  std::vector<std::pair<std::string, at::Tensor>> state;
};

/// Every Parameter's whole optimizer state (the slots that are defined) as 1-D views, one
/// MomentSlice per parameter with state: Optimizer::StateParts of an optimizer that keeps
/// the state in the Parameters.
std::vector<MomentSlice> WholeStateParts(const std::vector<Unit*>& units);

}  // namespace fulcrum
