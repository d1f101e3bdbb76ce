// AdamW with decoupled weight decay (Loshchilov & Hutter, ICLR 2019, Algorithm 2) and
// global gradient-norm clipping, over units. The optimizer object holds only
// hyper-parameters: every moment and step counter lives in the unit it belongs to
// (invariant 2), so the same call works on whatever units a stage holds today. Every
// data-parallel replica holds and updates the whole state (core/optimizer/optimizer.h).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/optimizer/optimizer.h"
#include "core/parallel_context.h"
#include "core/unit.h"

namespace fulcrum {

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const OptimizerOptions& options) : options_(options) {}

  /// Reduces the gradients over data parallelism, takes the global norm (over model and
  /// expert parallelism), clips to options().clip_grad, steps at request.lr and zeroes
  /// the gradients.
  absl::StatusOr<StepResult> ReduceAndStep(const std::vector<Unit*>& units,
                                           ParallelContext& collectives,
                                           const StepRequest& request) override;

  /// Sum over the units' gradients of their squared L2 norms (computed in double): this
  /// rank's part of the global norm, which parallel callers sum over model-parallel ranks.
  /// Only the copies ShardingSpec::CountedOn this rank count (NOTE [parameter sharding]:
  /// replicated parameters on tensor-parallel rank 0, slices everywhere, mirrors never).
  /// With `expert_parallel` true only the expert-parallel ones count (which callers also
  /// sum over the expert-parallel group), with false only the others.
  static double GradSquaredSum(const std::vector<Unit*>& units, bool expert_parallel);
  /// Every parameter (dense and expert-parallel).
  static double GradSquaredSum(const std::vector<Unit*>& units) {
    return GradSquaredSum(units, false) + GradSquaredSum(units, true);
  }

  /// Σ x² over every tensor of `pieces` (fp32 or other), in fp64: each CPU fp32 tensor in
  /// one pass without temporaries, device tensors in one multi-tensor call read once
  /// (NOTE [gradient norm on a device]).
  static double SumOfSquares(const std::vector<at::Tensor>& pieces);

  /// Multiplies every gradient by `factor`.
  static void ScaleGradients(const std::vector<Unit*>& units, double factor);

  /// The factor that clips a global norm `grad_norm` to options().clip_grad (1 when
  /// clipping is off or the norm is within bounds), as Megatron: clip/(norm + 1e-6).
  double ClipFactor(double grad_norm) const;

  /// One AdamW update of every parameter that has a gradient, at learning rate `lr`.
  /// Each unit's step counter advances by one. NOTE [fused AdamW on a device].
  void Step(const std::vector<Unit*>& units, double lr) const;

  /// How Step updates (NOTE [fused AdamW on a device]): kAuto fuses on accelerators and
  /// runs the per-tensor ops on the CPU; the others force one way (tests compare them).
  enum class Kernel { kAuto, kPerTensor, kFused };
  void set_kernel(Kernel kernel) { kernel_ = kernel; }

  /// One AdamW update of `value` (any shape; written in place) from `grad`, with moments
  /// `exp_avg`/`exp_avg_sq` (same shape, updated in place) at step `step` (≥ 1): Step's
  /// per-tensor kernel, shared with the distributed optimizer, which runs it on slices.
  void Update(at::Tensor value, const at::Tensor& grad, at::Tensor exp_avg,
              at::Tensor exp_avg_sq, int64_t step, double lr, bool decays) const;

  /// Cuts buckets of the parameters that train on some rank of their data-parallel group
  /// (one small sum agrees on them), each with presence flags (NOTE [overlapped gradient
  /// reduction]); nothing on groups of one.
  absl::Status BeginGradientReduction(const std::vector<Unit*>& units,
                                      ParallelContext& collectives) override;

  int64_t StateBytes(const std::vector<Unit*>& units) const override;

  /// AdamW's state per parameter (Parameter::optimizer_state): the first and second moments.
  static constexpr const char* kExpAvg = "exp_avg";
  static constexpr const char* kExpAvgSq = "exp_avg_sq";
  std::vector<std::string> StateSlots() const override { return {kExpAvg, kExpAvgSq}; }

  const OptimizerOptions& options() const { return options_; }

 private:
  // Waits for the overlapped reduction and writes its sums into the gradients (defining
  // those some other rank had); returns the parameters it summed.
  absl::StatusOr<std::set<const Parameter*>> FinishOverlappedReduction(ParallelContext& collectives);

  OptimizerOptions options_;
  Kernel kernel_ = Kernel::kAuto;
};

}  // namespace fulcrum
