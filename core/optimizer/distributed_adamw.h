// The distributed optimizer (--use_distributed_optimizer; ZeRO stage 1, Rajbhandari et al.
// 2020, as Megatron-LM's distributed optimizer): AdamW whose moments are sharded over the
// data-parallel group — and, for expert-parallel parameters, over the expert-data-parallel
// group — so a rank holds 1/dp of the optimizer state instead of all of it.
//
// NOTE [distributed optimizer]
// Layout. A rank's parameters, last unit first (NOTE [overlapped gradient reduction]: the
// order gradients become final; the ones the model-parallel sums change in trailing
// buckets), are cut into buckets of whole
// parameters (up to a byte budget, one group and dtype per bucket), each padded to a
// multiple of the group's size n; rank r owns the r-th n-th of every bucket (Megatron's
// per-bucket sharding: no rank waits on one large shard, and a bucket's reduction and
// gather are one collective each). The moments of the owned slice live here, fp32, as
// large as the slice; nothing else of the state is kept.
// A step, collective over the job:
//   1. the model-parallel sums (ParallelContext::AllReduceModelParallelGradients): the
//      gradients of parameters used on sequence shards over the tensor-parallel group, and
//      the tied embedding's over the first and last stage (before, not after, the
//      data-parallel sum: the sums commute);
//   2. per bucket, the gradients flattened (zeros where a rank has none) and
//      reduce-scattered: each rank gets the sum of its own slice only (with
//      --overlap_grad_reduce, the buckets started during the backward are waited for);
//   3. the plugins' after-reduce hook, given the owned slices as the parts of the reduced
//      gradients (NOTE [reduced gradients] in core/optimizer/parameter_parts.h; a plugin that
//      reads Parameter grads instead says Plugin::ReadsWholeGradients and is refused);
//   4. the global norm from the owned slices, summed over the data-parallel group (dense)
//      and the expert-data and expert-parallel groups (experts), then over the model;
//   5. clip, then AdamW (the same per-tensor kernel as AdamW::Update) on the owned slices
//      of the weights, in place;
//   6. per bucket, the updated slices all-gathered into every rank's weights.
// A parameter that no rank of its group has a gradient for takes no step (as AdamW,
// which skips it), and a frozen one (requires_grad false) neither.
// Bit-exactness: at dp = 2 the reduce-scatter adds x_r + x_other, the all_reduce's bits,
// and the update is AdamW's per-tensor kernel on slices, so with clipping inactive the
// weights equal AdamW's bit for bit; the norm sums in another order, so its last bits (and
// a clip factor's) may differ.
// State residency (NOTE [optimizer state residency] in core/optimizer/optimizer.h):
// GatherState all-gathers the moments into every Parameter (for a full checkpoint's
// save), ReleaseState drops them again; a sharded save writes each rank's own slices
// (MomentSlices, NOTE [sharded checkpoints]), gathering nothing. Moments a checkpoint load
// wrote into a Parameter are adopted (this rank's slice copied, the rest dropped) at the
// next call, so a checkpoint saved at any dp, with or without this optimizer, resumes
// under any other.
// Layer moves: before layers move (ForwardBackwardRunner::SetBeforeLayersMove) the state
// is gathered whole into the Parameters, so a moving layer carries it as under AdamW
// (pipeline/migration.cc); the next step finds another set of parameters, cuts a new
// layout and adopts its slices from the Parameters. The whole state is held only in
// iterations that move layers. A live shrink (recipes/elastic.cc) gathers the same way
// before the state exchange (Trainer::GatherOptimizerState), and the survivors' next step
// cuts the layout of their new model.
// Plugins that edit the moments per element (pruning) reach the owned slices through
// Optimizer::StateParts.
// Not yet: plugins that read Parameter grads directly (refused), the fused kernel on a device (the
// per-tensor kernel runs everywhere), a gather
// of only the moving layers (all of a stage's state is made whole).
//
// Not thread-safe; every call but StateBytes is collective.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/optimizer/adamw.h"
#include "core/optimizer/optimizer.h"
#include "core/optimizer/overlapped_reduction.h"

namespace fulcrum {

class DistributedAdamW final : public Optimizer {
 public:
  /// `bucket_bytes`: the byte budget of one bucket; 0: options.BucketBytes() (25 MiB by
  /// default, our gradient reducer's; Megatron's default, 40M parameters, is larger).
  explicit DistributedAdamW(const OptimizerOptions& options, int64_t bucket_bytes = 0)
      : adamw_(options), bucket_bytes_(bucket_bytes > 0 ? bucket_bytes : options.BucketBytes()) {}

  absl::StatusOr<StepResult> ReduceAndStep(const std::vector<Unit*>& units,
                                           ParallelContext& collectives,
                                           const StepRequest& request) override;
  absl::Status GatherState(const std::vector<Unit*>& units, ParallelContext& collectives) override;
  void ReleaseState(const std::vector<Unit*>& units) override;
  /// Overlaps the reduce-scatter of its own buckets (NOTE [overlapped gradient reduction]).
  absl::Status BeginGradientReduction(const std::vector<Unit*>& units,
                                      ParallelContext& collectives) override;
  bool SlicesState() const override { return true; }
  absl::StatusOr<std::vector<MomentSlice>> MomentSlices(const std::vector<Unit*>& units,
                                                        ParallelContext& collectives) override;
  /// The moments of the owned slices (the layout's, once built; 0 before).
  int64_t StateBytes(const std::vector<Unit*>& units) const override;
  std::vector<std::string> StateSlots() const override { return adamw_.StateSlots(); }

  /// The number of buckets of the current layout (tests).
  size_t num_buckets() const { return buckets_.size(); }

 private:
  using Member = OverlappedReduction::Member;
  // One bucket of the layout: what it reduces (`cut`, a reduce-scatter, padded to a multiple
  // of the group's size), this rank's slice of it and the fp32 moments of that slice.
  struct Bucket {
    OverlappedReduction::Bucket cut;
    int64_t shard_begin = 0;  // this rank's slice [shard_begin, shard_begin + shard_size)
    int64_t shard_size = 0;
    at::Tensor exp_avg, exp_avg_sq;
  };

  // Builds the layout on first use, and again for a changed set of parameters (layers
  // moved) when the state was gathered before they moved; refuses one otherwise.
  absl::Status EnsureLayout(const std::vector<Unit*>& units, ParallelContext& collectives);
  // Copies this rank's slice of moments a load wrote into Parameters, then drops them; a
  // unit whose step counter went back to 0 (loaded without state) has its slices zeroed.
  void AdoptWrittenState();
  // The part of member `m` inside bucket `b`'s owned slice: [begin, end) in bucket
  // coordinates, empty when begin ≥ end.
  static std::pair<int64_t, int64_t> OwnedPart(const Bucket& b, const Member& m);
  // This rank's parts of the reduced gradients (NOTE [reduced gradients]): the owned part
  // of every member some rank has a gradient for (`present`), viewed in `grad_slices`.
  std::vector<GradientPart> OwnedGradients(const std::vector<at::Tensor>& grad_slices,
                                           const std::vector<std::vector<bool>>& present) const;
  // ReducedGradients::SumOverHolders: over the data-parallel group, or the expert-data-
  // parallel one.
  void SumOverHolders(ParallelContext& collectives, bool expert, std::vector<double>& values) const;
  // The buckets' reductions, for OverlappedReduction::Begin.
  std::vector<OverlappedReduction::Bucket> Reductions() const;

  AdamW adamw_;
  int64_t bucket_bytes_;
  std::vector<Bucket> buckets_;
  // Where the expert buckets live; empty when this stage holds no expert-parallel parameter
  // (then no expert-data-parallel sum runs).
  std::optional<c10::Device> expert_device_;
  std::vector<const c10::TensorImpl*> signature_;  // the parameters the layout was built on
  std::map<const Unit*, int64_t> steps_;           // each unit's step counter after our last step
  // GatherState ran and nothing took the state back since: every Parameter holds its whole
  // state, so a changed set of parameters (layers moved) can be re-sliced.
  bool gathered_ = false;
};

}  // namespace fulcrum
