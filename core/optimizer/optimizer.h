// The optimizer's part of an iteration, from the accumulated gradients to updated
// parameters: reduce the gradients over the replicas, take the global gradient norm, clip,
// update, clear the gradients. The trainer calls it once per iteration whatever the
// optimizer: AdamW (core/optimizer/adamw.h) does the sequence on full replicas; a
// distributed optimizer (ZeRO-1: each data-parallel rank updating its slice of the state)
// goes beside it and owns the same sequence with its own reduce and step.
//
// Not thread-safe; ReduceAndStep is collective over the whole job.
#pragma once

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/optimizer/overlapped_reduction.h"
#include "core/optimizer/parameter_parts.h"
#include "core/parallel_context.h"
#include "core/unit.h"

namespace fulcrum {

/// One step's inputs beside the gradients.
struct StepRequest {
  /// The learning rate of this step.
  double lr = 0;
  /// Values summed over data parallelism with the gradients' reduction (the loss).
  std::vector<double> data_parallel_sums;
  /// Values summed over the whole job at no extra collective: over data parallelism with
  /// the above, then over the model-parallel ranks with the gradient norm (the stop flag,
  /// NOTE [graceful stop] in core/trainer.h).
  std::vector<double> job_sums;
  /// Runs once the gradients are complete and agree over the replicas, before the norm is
  /// taken (the plugins' AfterBackward, which may mask gradients), given this rank's parts
  /// of them (NOTE [reduced gradients]); may be empty. Its error ends the step before any
  /// update.
  std::function<absl::Status(ReducedGradients&)> after_reduce;
};

/// What a step measured.
struct StepResult {
  /// The global L2 norm of the gradients before clipping.
  double grad_norm = 0;
  /// False when the norm was not finite: then nothing was updated and the gradients are
  /// left as they were, for the caller to report with what it knows (the loss).
  bool stepped = false;
  /// Wall time from the step's start to the end of its data-parallel gradient reduction
  /// (the model-parallel sums included): with an overlapped reduction, waiting for what
  /// was in flight and running what was left (NOTE [overlapped gradient reduction]).
  double reduce_ms = 0;
  /// StepRequest's sums, summed.
  std::vector<double> data_parallel_sums;
  std::vector<double> job_sums;
};

/// The end of every optimizer's norm: `local_sq` (this rank's part of the squared global
/// norm, as the optimizer shards it) and the job sums — the tail of `sums`, after its first
/// `dp_count` (the data-parallel sums, already summed) — summed over the model-parallel
/// ranks. Fills every field of StepResult but `stepped`. Collective (SumOverModelParallel).
StepResult FinishNorm(double local_sq, const std::vector<double>& sums, size_t dp_count,
                      ParallelContext& collectives);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  /// One optimizer step over `units` (this rank's part of the model): reduce, norm, clip,
  /// update, zero the gradients. Collective over `collectives`' whole job; every rank must
  /// call it alike.
  virtual absl::StatusOr<StepResult> ReduceAndStep(const std::vector<Unit*>& units,
                                                   ParallelContext& collectives,
                                                   const StepRequest& request) = 0;

  // NOTE [overlapped gradient reduction] (core/optimizer/overlapped_reduction.h).

  /// Starts this iteration's overlapped gradient reduction (--overlap_grad_reduce), after
  /// the iteration's plugins changed the model and before its backward passes: buckets
  /// whose gradients GradientsFinal reports final start reducing at once, and ReduceAndStep
  /// waits for them. Collective over the data-parallel groups. The default does nothing:
  /// ReduceAndStep reduces everything itself.
  virtual absl::Status BeginGradientReduction(const std::vector<Unit*>& units,
                                              ParallelContext& collectives) {
    return absl::OkStatus();
  }
  /// `unit`'s gradients are final for this iteration: the buckets this completes start.
  /// A no-op without BeginGradientReduction.
  absl::Status GradientsFinal(const Unit& unit, ParallelContext& collectives) {
    return overlap_.UnitFinal(unit, collectives);
  }
  /// Drops this iteration's overlapped reduction (layers are about to move: nothing has
  /// started yet); ReduceAndStep then reduces everything itself.
  void CancelGradientReduction() { overlap_.Cancel(); }
  /// The overlapped reduction's buckets started before the last step (tests, metrics).
  int buckets_started_early() const { return overlap_.started_early(); }

  /// The names of the state tensors it keeps per parameter (Parameter::optimizer_state), in
  /// checkpoint order: what a resume reads for each parameter.
  virtual std::vector<std::string> StateSlots() const = 0;

  // NOTE [optimizer state residency]: every Parameter's optimizer_state (core/unit.h) is
  // where checkpoints, layer moves and plugins find a parameter's whole optimizer state. An
  // optimizer that keeps the state elsewhere (the distributed optimizer: a slice per
  // data-parallel rank) makes it whole there on GatherState and takes it back (keeping its
  // own copy) on ReleaseState; state it finds written there (a checkpoint load) it adopts
  // at its next call. AdamW keeps it there always: both are no-ops.

  /// Writes the whole optimizer state of `units` into their Parameters. Collective over
  /// the data-parallel groups: every rank calls it alike.
  virtual absl::Status GatherState(const std::vector<Unit*>& units, ParallelContext& collectives) {
    return absl::OkStatus();
  }
  /// Drops what GatherState wrote (the optimizer keeps its own slices).
  virtual void ReleaseState(const std::vector<Unit*>& units) {}
  /// Whether the Parameters lack the moments between steps because this optimizer holds
  /// them sliced: a sharded checkpoint then writes MomentSlices, and a full one gathers.
  virtual bool SlicesState() const { return false; }
  /// This rank's slices of the moments of `units`' parameters, after adopting state a load
  /// wrote into the Parameters (SlicesState optimizers; none otherwise). Not collective.
  virtual absl::StatusOr<std::vector<MomentSlice>> MomentSlices(const std::vector<Unit*>& units,
                                                                ParallelContext& collectives) {
    return std::vector<MomentSlice>{};
  }
  /// This rank's parts of the optimizer state of `units`' parameters, as writable views:
  /// for a plugin that edits state per element (pruning zeroes a pruned weight's moments)
  /// under any optimizer. This default: each Parameter's whole state (slots that are
  /// defined; none before the first step); a SlicesState optimizer: its MomentSlices. Not
  /// collective.
  virtual absl::StatusOr<std::vector<MomentSlice>> StateParts(const std::vector<Unit*>& units,
                                                              ParallelContext& collectives);
  /// Bytes of optimizer state (moments) this rank holds.
  virtual int64_t StateBytes(const std::vector<Unit*>& units) const = 0;

 protected:
  OverlappedReduction overlap_;
};

}  // namespace fulcrum
