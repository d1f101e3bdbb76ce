// What the training loop needs from the parallel layout. core/ knows no communicators: the
// implementation over process groups lives in parallel/ (parallel/process_groups.h) and is
// injected into the Trainer. A null ParallelContext* means one process. This rank's roles
// (sizes, who logs, who saves what) are a value of their own: core/rank_roles.h.
//
// Not thread-safe; every ParallelContext method except tensor_parallel() and Stage() is
// collective over the group it names.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "core/gpt_model.h"
#include "core/tensor_parallel.h"
#include "core/unit.h"

namespace fulcrum::parallel {
class Communicator;  // Opaque here: NOTE [plugin doors].
}  // namespace fulcrum::parallel

namespace fulcrum {

/// One iteration's micro-batches of this data-parallel rank.
struct MicroBatchPlan {
  int count = 0;
  /// Tokens [b, s+1] of micro-batch `m` (inputs and labels).
  std::function<at::Tensor(int m)> tokens;
  /// Global index of micro-batch `m`'s first sample (keys its dropout masks).
  std::function<int64_t(int m)> first_sample;
  /// Training: micro-batch `m`'s ForwardContext::token_positions [s, b], asked only by
  /// stages whose model needs them (GptModel::needs_token_positions); empty in evaluation.
  std::function<at::Tensor(int m)> token_positions;
  /// Training: ForwardContext::epoch of every micro-batch.
  int64_t epoch = 0;
  /// Training, optional: called with each unit of the stage as soon as its gradients are
  /// final for the iteration — after its chunk's last weight gradients (GptModel::
  /// ReportFinalGradients) — so an overlapped reduction can start (NOTE [overlapped
  /// gradient reduction] in core/optimizer/overlapped_reduction.h). Its error ends the run.
  std::function<absl::Status(const Unit&)> gradients_final;
};

/// Runs the forward and backward passes of one iteration over a pipeline of stages
/// (pipeline/ implements it); the trainer's own loop is the one-stage case.
class ForwardBackwardRunner {
 public:
  virtual ~ForwardBackwardRunner() = default;
  /// Leaves this stage's gradients accumulated (each micro-batch's loss sum scaled by
  /// `loss_scale`). Returns the summed token loss and token count of the micro-batches on
  /// the stage holding the head, zeros elsewhere.
  virtual absl::StatusOr<std::pair<double, int64_t>> Run(GptModel& stage, int64_t iteration,
                                                         const MicroBatchPlan& plan,
                                                         double loss_scale) = 0;
  /// Forward passes only, without autograd (evaluation); returns as Run does.
  virtual absl::StatusOr<std::pair<double, int64_t>> Evaluate(GptModel& stage,
                                                              const MicroBatchPlan& plan) = 0;
  /// Measurements of the last Run for the metrics file (a JSON object, e.g.
  /// {"bubble_ratio": 0.2, "stage_ranges": [[0, 2], [2, 4]]}) and a short text for the
  /// iteration's log line (" | bubble 0.210 | imbalance 0.08").
  virtual void Metrics(nlohmann::json* record, std::string* log_line) const = 0;
  /// A dynamism changed the model in `iteration` (pruned, froze, ...): the per-layer costs
  /// measured so far are stale (pipeline/rebalancer.h, Rebalancer::OnModelChanged). Called on
  /// every rank, between iterations.
  virtual void ModelChanged(int64_t iteration, const std::string& reason) {}
  /// `hook` runs on every rank at the start of each Run whose plan changes the placement,
  /// before any layer leaves its stage: the optimizer makes the layers' whole state
  /// travel-ready there (NOTE [optimizer state residency] in core/optimizer/optimizer.h).
  /// Collective, as the plan is the same on every rank. A later call replaces it.
  virtual void SetBeforeLayersMove(std::function<absl::Status()> hook) {}
  /// Called once when training stops, on every rank (collective): flush what was recorded.
  virtual absl::Status Finish() { return absl::OkStatus(); }
  /// One line of --load_trace after the last Run: the per-layer costs of the latest complete
  /// measurement (a pipeline's: pipeline/load_trace.h); left empty when there is none.
  virtual void LoadTrace(nlohmann::json* record) const {}
};

/// A collective started and not yet finished (ParallelContext::StartAllReduceSum and
/// StartReduceScatterSum): its tensors must not be touched until Wait returns.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  /// Blocks until the collective is done; returns its result.
  virtual at::Tensor Wait() = 0;
};

/// A collective that was done when it was started (the blocking fallback).
class FinishedCollective final : public PendingCollective {
 public:
  explicit FinishedCollective(at::Tensor result) : result_(std::move(result)) {}
  at::Tensor Wait() override { return result_; }

 private:
  at::Tensor result_;
};

/// The collectives of the parallel layout the training loop uses. Who this rank is — its
/// sizes, ranks, and duties — is a plain value beside it (core/rank_roles.h), and the
/// pipeline runner is handed to the trainer directly (TrainerPlacement in core/trainer.h).
class ParallelContext {
 public:
  virtual ~ParallelContext() = default;

  /// The tensor-parallel group the model shards over; null when tp == 1.
  virtual TensorParallelGroup* tensor_parallel() = 0;

  /// The part of a `num_layers`-layer model this rank holds.
  virtual StageSpec Stage(int64_t num_layers) const = 0;

  /// Sums every defined gradient of `units` over the data-parallel group, in place, and
  /// does the model-parallel sums of AllReduceModelParallelGradients. Parameters for which
  /// `reduced` (when given) is true are left out of the data-parallel sums: an overlapped
  /// reduction summed them already.
  using ParameterFilter = std::function<bool(const Parameter&)>;
  virtual void AllReduceGradients(const std::vector<Unit*>& units,
                                  const ParameterFilter& reduced = nullptr) = 0;
  /// The model-parallel part of AllReduceGradients, in place: the gradients of parameters
  /// used on sequence shards (ShardingSpec::sequence_parallel, NOTE [sequence parallelism]
  /// in core/tensor_parallel.h) summed over the tensor-parallel group, and, with an output
  /// weight tied to the word embeddings across pipeline stages, the gradients of the
  /// embedding (first stage) and its mirror (last stage) summed over the two. A sharded
  /// optimizer (core/optimizer/distributed_adamw.h) calls it before its own data-parallel
  /// reduction: the sums commute (up to the order of the fp adds).
  virtual void AllReduceModelParallelGradients(const std::vector<Unit*>& units) = 0;
  /// Whether AllReduceModelParallelGradients sums `p`'s gradient (a sequence-parallel
  /// parameter under tp > 1, the tied embedding and its mirror across stages): such a
  /// gradient is final only at the step, so an overlapped reduction leaves it to the step.
  virtual bool SummedOverModelParallel(const Unit& unit, const Parameter& p) const {
    return false;
  }
  /// Sums each value over the data-parallel group, in place.
  virtual void SumOverDataParallel(std::vector<double>& values) = 0;
  /// Sums each value over the ranks that hold different parts of one model replica
  /// (tensor × pipeline parallel), in place; RankRoles::model_parallel_rank orders them.
  virtual void SumOverModelParallel(std::vector<double>& values) = 0;
  /// Sums each value over the expert-parallel group (the ranks that share out the experts
  /// of one stage), in place; identity when ep == 1.
  virtual void SumOverExpertParallel(std::vector<double>& values) = 0;
  /// Every pipeline stage's `mine`, in stage order (collective over the pipeline group).
  virtual std::vector<std::string> GatherOverPipeline(const std::string& mine) = 0;
  /// Every pipeline stage's `row` (a 1-D tensor of the same size and dtype on every stage),
  /// stacked in stage order: [stages, size] (collective over the pipeline group). What
  /// GatherChunkRanges (core/gpt_model.h) gathers the layer placement with.
  virtual at::Tensor StackOverPipeline(const at::Tensor& row) = 0;
  /// Waits for every rank of the job.
  virtual void Barrier() = 0;

  // ---- Doors for plugins ---------------------------------------------------------------
  // NOTE [plugin doors]
  // Plugins (plugins/) reach the parallel layout only through this interface: they never
  // include parallel/, and they learn the layout through Plugin::OnLayout (core/plugin.h),
  // which the Trainer calls again whenever the layout changes (a live shrink), so nothing a
  // plugin holds outlives the groups it came from.
  //  - A sum over a group is AllReduceSum with the group's role: enough for every plugin
  //    that only agrees on values (early exit's head copies).
  //  - A library below the plugins that speaks to a group itself (moe/: the experts'
  //    all-to-all, built by the MoE plugin) gets the group's communicator as an opaque
  //    parallel::Communicator*, forward-declared above. core/ never dereferences it and keeps
  //    no dependency on parallel/'s headers; only code that already links parallel/ (moe/)
  //    uses it. The alternative, a core interface mirroring the communicator (all-to-all
  //    with uneven splits, sub-groups for the hierarchical exchange, non-blocking handles),
  //    would duplicate parallel/'s whole API for one user.
  // The pointers are valid until the next OnLayout; a plugin must not keep them longer.

  /// The groups a plugin may address. kExpertData: the ranks holding the same experts.
  enum class GroupRole { kTensor, kPipeline, kData, kExpert, kExpertData, kModel };
  /// Sums `tensor` (contiguous, on the model's device) over this rank's group of `role`, in
  /// place; identity on a group of one. Collective over that group.
  virtual void AllReduceSum(GroupRole role, at::Tensor& tensor) = 0;
  /// This rank's index in its group of `role`, and the group's size.
  virtual int GroupRank(GroupRole role) = 0;
  virtual int GroupSize(GroupRole role) = 0;
  /// Reduce-scatter over the group of `role`: chunk GroupRank(role) of the sum of every
  /// rank's `input` (1-D, contiguous, on the model's device, its length a multiple of
  /// GroupSize(role)). Collective over that group; on a group of one, a copy of `input`.
  virtual at::Tensor ReduceScatterSum(GroupRole role, const at::Tensor& input) = 0;
  /// AllReduceSum and ReduceScatterSum that return at once, the collective running while
  /// the caller computes where the backend can (Gloo: on c10d's worker; NOTE [overlapped
  /// gradient reduction] in core/optimizer/overlapped_reduction.h). Every rank of the group
  /// starts them, and the other collectives on it, in the same order. `tensor` is summed in
  /// place and Wait returns it; the reduce-scatter's input may be reused at once. The
  /// defaults run the blocking call.
  virtual std::unique_ptr<PendingCollective> StartAllReduceSum(GroupRole role, at::Tensor tensor) {
    AllReduceSum(role, tensor);
    return std::make_unique<FinishedCollective>(std::move(tensor));
  }
  virtual std::unique_ptr<PendingCollective> StartReduceScatterSum(GroupRole role,
                                                                   const at::Tensor& input) {
    return std::make_unique<FinishedCollective>(ReduceScatterSum(role, input));
  }
  /// Every rank's `shard` (1-D, the same length and dtype on every rank) concatenated in
  /// rank order. Collective over the group of `role`; on a group of one, `shard` itself.
  virtual at::Tensor AllGather(GroupRole role, const at::Tensor& shard) = 0;
  /// Whether each of `mine` holds on some rank of the group of `role` (which parameters
  /// have a gradient, or train, anywhere in it): one sum of 0/1 flags over the group on
  /// `device` (where its communicator works), read back to the host once. Collective over
  /// that group; `mine` has the same length on every rank.
  std::vector<bool> AnyRank(GroupRole role, const std::vector<bool>& mine, c10::Device device);
  /// This rank's communicator of group `role`, for libraries that communicate themselves
  /// (NOTE [plugin doors]). Never null; valid until the layout changes.
  virtual parallel::Communicator* communicator(GroupRole role) = 0;
};

/// The one-process layout: every group is this process alone, so every collective is the
/// identity (a sum over one rank is the value itself). The trainer runs its collectives
/// through it when it is given no context, so it has one code path for every layout.
/// Plugins are still told "one process" by a null context (Plugin::OnLayout), and this one
/// has no communicators to hand out.
class SingleProcessContext final : public ParallelContext {
 public:
  TensorParallelGroup* tensor_parallel() override { return nullptr; }
  StageSpec Stage(int64_t num_layers) const override { return StageSpec(); }
  void AllReduceGradients(const std::vector<Unit*>& units,
                          const ParameterFilter& reduced = nullptr) override {}
  void AllReduceModelParallelGradients(const std::vector<Unit*>& units) override {}
  void SumOverDataParallel(std::vector<double>& values) override {}
  void SumOverModelParallel(std::vector<double>& values) override {}
  void SumOverExpertParallel(std::vector<double>& values) override {}
  std::vector<std::string> GatherOverPipeline(const std::string& mine) override { return {mine}; }
  at::Tensor StackOverPipeline(const at::Tensor& row) override { return row.unsqueeze(0); }
  void Barrier() override {}
  void AllReduceSum(GroupRole role, at::Tensor& tensor) override {}
  int GroupRank(GroupRole role) override { return 0; }
  int GroupSize(GroupRole role) override { return 1; }
  at::Tensor ReduceScatterSum(GroupRole role, const at::Tensor& input) override {
    return input.clone();
  }
  at::Tensor AllGather(GroupRole role, const at::Tensor& shard) override { return shard; }
  /// Null: one process has no communicators (plugins get a null context instead).
  parallel::Communicator* communicator(GroupRole role) override { return nullptr; }
};

}  // namespace fulcrum
