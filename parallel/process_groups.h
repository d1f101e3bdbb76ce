// This process's place in a tp × pp × ep × dp job: one communicator per group kind, built
// from the world communicator and a ParallelConfig, and the ParallelContext the trainer
// uses (tensor-parallel mappings, data-parallel gradient reduction, reductions of scalars),
// with this rank's roles (who logs and who writes checkpoints: parallel/rank_roles.h).
//
// Not thread-safe; Create is collective over the world.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/parallel_context.h"
#include "parallel/communicator.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_config.h"
#include "parallel/rank_roles.h"
#include "parallel/comm_tensor_parallel_group.h"

namespace fulcrum::parallel {

class ProcessGroupContext final : public ParallelContext {
 public:
  /// Splits `world` into this rank's tensor, pipeline, data, expert, expert-data and model
  /// groups (every rank calls Split once per kind, in the same order), and — when the model
  /// ties its output weight to the word embeddings and pp > 1 — the group of the first and
  /// last stage that sums their gradients. `config` must be valid and match the world size.
  static absl::StatusOr<std::unique_ptr<ProcessGroupContext>> Create(
      std::unique_ptr<Communicator> world, const ParallelConfig& config,
      bool tie_embeddings = true);

  const ParallelConfig& config() const { return config_; }
  const RankCoords& coords() const { return coords_; }
  Communicator& world() { return *world_; }
  Communicator& group(GroupKind kind);

  /// This rank's roles under config() (parallel/rank_roles.h).
  const RankRoles& roles() const { return roles_; }
  TensorParallelGroup* tensor_parallel() override {
    return config_.tp > 1 ? tensor_parallel_.get() : nullptr;
  }
  /// This rank's stage of the initial placement: SetInitialPlacement's, else the even split.
  StageSpec Stage(int64_t num_layers) const override;
  /// The placement training starts with (one [begin, end) per stage, covering the layers in
  /// order; e.g. --pipeline_initial_partition=params); by default the even split.
  void SetInitialPlacement(std::vector<std::pair<int64_t, int64_t>> ranges) {
    initial_placement_ = std::move(ranges);
  }
  /// Virtual pipeline stages (NOTE [model chunks] in core/gpt_model.h): (stage, chunk) of
  /// each of the p·v pieces in model order. Stage() then gives this rank's chunks of the
  /// initial placement (one range per virtual stage; by default the even split over p·v),
  /// and when one rank holds both the embedding and the head (ZB-V) the tied word
  /// embeddings need no sum over the pipeline. Empty (the default): one chunk per stage.
  void SetVirtualStages(std::vector<std::pair<int, int>> owners) {
    virtual_stages_ = std::move(owners);
  }
  /// The rank (pipeline stage) of each virtual stage in model order; empty with one chunk
  /// per stage (BalanceProblem::chunk_rank's form).
  std::vector<int> VirtualStageRanks() const {
    std::vector<int> ranks;
    for (const auto& [stage, chunk] : virtual_stages_) ranks.push_back(stage);
    return ranks;
  }
  void AllReduceGradients(const std::vector<Unit*>& units,
                          const ParameterFilter& reduced = nullptr) override;
  bool SummedOverModelParallel(const Unit& unit, const Parameter& p) const override;
  void AllReduceModelParallelGradients(const std::vector<Unit*>& units) override;
  void SumOverDataParallel(std::vector<double>& values) override;
  void SumOverModelParallel(std::vector<double>& values) override;
  void SumOverExpertParallel(std::vector<double>& values) override;
  std::vector<std::string> GatherOverPipeline(const std::string& mine) override;
  at::Tensor StackOverPipeline(const at::Tensor& row) override;
  void Barrier() override { world_->Barrier(); }
  void AllReduceSum(GroupRole role, at::Tensor& tensor) override;
  int GroupRank(GroupRole role) override { return group(KindOf(role)).rank(); }
  int GroupSize(GroupRole role) override { return group(KindOf(role)).size(); }
  at::Tensor ReduceScatterSum(GroupRole role, const at::Tensor& input) override;
  std::unique_ptr<PendingCollective> StartAllReduceSum(GroupRole role, at::Tensor tensor) override;
  std::unique_ptr<PendingCollective> StartReduceScatterSum(GroupRole role,
                                                           const at::Tensor& input) override;
  at::Tensor AllGather(GroupRole role, const at::Tensor& shard) override;
  Communicator* communicator(GroupRole role) override { return &group(KindOf(role)); }

  /// The group kind that plays `role` (NOTE [plugin doors] in core/parallel_context.h).
  static GroupKind KindOf(GroupRole role);

 private:
  ProcessGroupContext(std::unique_ptr<Communicator> world, const ParallelConfig& config);
  // The two parts of AllReduceModelParallelGradients.
  void AllReduceSequenceParallelGradients(const std::vector<Unit*>& units);
  void AllReduceTiedGradients(const std::vector<Unit*>& units);
  // Whether `p` is the tied word embedding (first stage) or its mirror (last stage) whose
  // gradients AllReduceTiedGradients sums.
  bool TiedAcrossStages(const Unit& unit, const Parameter& p) const;

  ParallelConfig config_;
  RankCoords coords_;
  RankRoles roles_;
  std::unique_ptr<Communicator> world_;
  std::vector<std::unique_ptr<Communicator>> groups_;  // Indexed by GroupKind.
  std::unique_ptr<CommTensorParallelGroup> tensor_parallel_;
  // First and last pipeline stage of this (tp, dp) position, which sum the gradients of
  // the word embeddings and of their mirror on the last stage; null elsewhere or pp == 1.
  std::unique_ptr<Communicator> embedding_group_;
  std::vector<std::pair<int64_t, int64_t>> initial_placement_;  // Empty: the even split.
  std::vector<std::pair<int, int>> virtual_stages_;  // Empty: one chunk per stage.
  std::unique_ptr<GradientReducer> gradient_reducer_;         // dense parameters over dp
  std::unique_ptr<GradientReducer> expert_gradient_reducer_;  // experts over edp
};

}  // namespace fulcrum::parallel
