// The data-parallel gradient reduction overlapped with the backward pass
// (--overlap_grad_reduce; Megatron-LM's overlap_grad_reduce, in our own terms).
//
// NOTE [overlapped gradient reduction]
// A bucket's data-parallel reduction starts as soon as every gradient in it is final for
// the iteration, on the non-blocking collectives (ParallelContext::StartAllReduceSum,
// StartReduceScatterSum), while the backward computes the rest; the optimizer step waits
// only for what is still in flight.
//  - When a gradient is final. A unit's gradients are final after its chunk's last
//    backward action of the iteration — under the B/W split after that chunk's last W, not
//    its B. GptModel::FlushReportingFinal runs the last W one unit at a time and reports
//    each unit as its own weight gradients finish (the untagged ones of the head and the
//    tied embedding first, then the layers last to first, the embedding last); the pipeline
//    executor calls it at each chunk's last action, one process on its last micro-batch
//    (whose weight gradients it defers for that: Trainer::TrainStep).
//  - Order. The optimizer cuts its buckets in reverse unit order (the head's first, the
//    embedding's last: the order in which gradients become final) and they are started
//    strictly in that order, a bucket once all its units are final and every bucket before
//    it started. Every rank of a data-parallel group runs the same schedule on the same
//    layers, so every rank starts the same collectives in the same order.
//  - What waits for the step. A gradient the model-parallel sums still change
//    (ParallelContext::SummedOverModelParallel: sequence-parallel parameters, the tied
//    embedding across stages) is reduced at the step, after those sums, as without overlap;
//    the optimizer puts such parameters in trailing buckets marked `at_step`.
//  - Values. Each gradient element is summed over the same ranks as without overlap; at
//    dp = 2 the sum is x_r + x_other either way, the same bits. With more ranks a ring's
//    association depends on where an element falls in its bucket, so the last bits may
//    differ from the blocking reduction's buckets.
//  - Not overlapped: an iteration that moves layers (the runner's before-move hook cancels
//    before anything started: the buckets would outlive the units), a layer whose
//    gradients are never reported (a forward-only chunk) and every bucket after it, which
//    all run at the step.
// On Gloo the collectives run on c10d's worker thread (the reduce-scatter as an
// all-reduce of a copy: Communicator::IReduceScatter). NCCL's communicator has no
// non-blocking forms yet: there the started collectives are its ordinary ones (asynchronous
// to the host, not measured for overlap with compute).
//
// Not thread-safe; used by one optimizer on the training thread.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/parallel_context.h"
#include "core/unit.h"

namespace fulcrum {

class OverlappedReduction {
 public:
  /// One parameter inside a bucket: elements [offset, offset + numel) of it.
  struct Member {
    Unit* unit = nullptr;
    Parameter* param = nullptr;
    int64_t offset = 0;
  };
  struct Bucket {
    ParallelContext::GroupRole group = ParallelContext::GroupRole::kData;
    at::ScalarType dtype = at::kFloat;
    c10::Device device = c10::Device(c10::kCPU);
    std::vector<Member> members;
    /// Elements reduced (with `scatter`, a multiple of the group's size).
    int64_t size = 0;
    /// Reduce-scatter: the result is this rank's chunk of the sum. Otherwise all-reduce.
    bool scatter = false;
    /// All-reduce only: one more element per member after `size`, 1 where this rank has the
    /// member's gradient, so the result counts the ranks that had it.
    bool presence = false;
    /// Never started before the step (NOTE [overlapped gradient reduction]).
    bool at_step = false;
  };

  /// Cuts the parameters `take` accepts, of `units` in reverse order, into buckets of whole
  /// parameters of one dtype and device, each closed once it holds `bucket_bytes`;
  /// parameters `at_step` accepts go into trailing buckets of their own, marked so. With
  /// `pad_to`, each bucket's size is rounded up to a multiple of it.
  static std::vector<Bucket> Cut(const std::vector<Unit*>& units,
                                 ParallelContext::GroupRole group,
                                 const std::function<bool(const Unit&, const Parameter&)>& take,
                                 const std::function<bool(const Unit&, const Parameter&)>& at_step,
                                 int64_t bucket_bytes, int64_t pad_to = 1);

  /// Starts an iteration over `buckets` (the same list on every rank of each bucket's group).
  void Begin(std::vector<Bucket> buckets);
  /// Whether an iteration is under way (Begin ran, Finish or Cancel not yet).
  bool active() const { return active_; }
  /// `unit`'s gradients are final for this iteration: starts every bucket, in order, whose
  /// units are all final, up to the first that is not. Units outside the buckets are
  /// ignored. A gradient whose dtype is not its bucket's is an error.
  absl::Status UnitFinal(const Unit& unit, ParallelContext& collectives);
  /// Runs the buckets not started yet (blocking) and waits for those in flight; returns
  /// each bucket's result in order (the whole sum, presence counts after `size`; or this
  /// rank's chunk). Ends the iteration.
  absl::StatusOr<std::vector<at::Tensor>> Finish(ParallelContext& collectives);
  /// Ends the iteration: waits for what is in flight and drops every result.
  void Cancel();
  /// The buckets of the iteration under way, or of the last one.
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// How many buckets the last iteration started before Finish.
  int started_early() const { return started_early_; }

 private:
  // The bucket's gradients, flattened (zeros where a member has none), with presence flags.
  absl::StatusOr<at::Tensor> Flatten(const Bucket& bucket) const;

  std::vector<Bucket> buckets_;
  std::vector<int> units_left_;  // per bucket: its distinct units not yet final
  std::map<const Unit*, std::vector<size_t>> buckets_of_;
  size_t next_ = 0;  // the first bucket not started
  std::vector<std::unique_ptr<PendingCollective>> in_flight_;  // per started bucket
  bool active_ = false;
  int started_early_ = 0;
};

}  // namespace fulcrum
