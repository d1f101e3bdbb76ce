#include "parallel/process_groups.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum::parallel {
namespace {

constexpr GroupKind kGroupKinds[] = {GroupKind::kTensor, GroupKind::kPipeline, GroupKind::kData,
                                     GroupKind::kExpert, GroupKind::kExpertData, GroupKind::kModel};
constexpr const char* kGroupNames[] = {"tp", "pp", "dp", "ep", "edp", "mp"};

void SumDoubles(Communicator& comm, std::vector<double>& values) {
  if (comm.size() == 1 || values.empty()) return;
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kDouble);
  std::copy(values.begin(), values.end(), t.data_ptr<double>());
  comm.AllReduce(t, ReduceOp::kSum);
  std::copy(t.data_ptr<double>(), t.data_ptr<double>() + values.size(), values.begin());
}

}  // namespace

ProcessGroupContext::ProcessGroupContext(std::unique_ptr<Communicator> world,
                                         const ParallelConfig& config)
    : config_(config),
      coords_(config.Coords(world->rank())),
      roles_(RankRolesOf(config, world->rank())),
      world_(std::move(world)) {}

absl::StatusOr<std::unique_ptr<ProcessGroupContext>> ProcessGroupContext::Create(
    std::unique_ptr<Communicator> world, const ParallelConfig& config, bool tie_embeddings) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (config.world_size != world->size()) {
    return absl::InvalidArgumentError(absl::StrCat("parallel layout ", config.ToString(),
                                                   " does not match the ", world->size(),
                                                   " processes of the job"));
  }
  std::unique_ptr<ProcessGroupContext> ctx(new ProcessGroupContext(std::move(world), config));
  const int rank = ctx->world_->rank();
  for (size_t i = 0; i < std::size(kGroupKinds); ++i) {
    ctx->groups_.push_back(
        ctx->world_->Split(config.GroupOf(kGroupKinds[i], rank), kGroupNames[i]));
  }
  if (config.pp > 1 && tie_embeddings) {
    const RankCoords& c = ctx->coords_;
    if (c.pp == 0 || c.pp == config.pp - 1) {
      ctx->embedding_group_ = ctx->world_->Split(
          {config.Rank(c.tp, c.dp, 0), config.Rank(c.tp, c.dp, config.pp - 1)}, "embedding");
    }
  }
  // RankRoles::model_parallel_rank is computed, not asked of the group: both must agree.
  TORCH_INTERNAL_ASSERT(ctx->group(GroupKind::kModel).rank() == ctx->roles_.model_parallel_rank,
                        "model-parallel rank ", ctx->group(GroupKind::kModel).rank(),
                        " differs from the layout's ", ctx->roles_.model_parallel_rank);
  ctx->tensor_parallel_ = std::make_unique<CommTensorParallelGroup>(&ctx->group(GroupKind::kTensor));
  ctx->gradient_reducer_ = std::make_unique<GradientReducer>(
      &ctx->group(GroupKind::kData), GradientReducer::Select::kDense);
  ctx->expert_gradient_reducer_ = std::make_unique<GradientReducer>(
      &ctx->group(GroupKind::kExpertData), GradientReducer::Select::kExpertParallel);
  return ctx;
}

StageSpec ProcessGroupContext::Stage(int64_t num_layers) const {
  if (!virtual_stages_.empty()) {
    const int pieces = static_cast<int>(virtual_stages_.size());
    std::vector<std::pair<int64_t, int64_t>> ranges = initial_placement_;
    TORCH_INTERNAL_ASSERT(ranges.empty() || static_cast<int>(ranges.size()) == pieces,
                          "initial placement of ", ranges.size(), " ranges for ", pieces,
                          " virtual stages");
    for (int k = 0; initial_placement_.empty() && k < pieces; ++k) {
      const StageSpec even = EvenStage(num_layers, pieces, k);
      ranges.emplace_back(even.layer_begin, even.layer_end);
    }
    return StageOfChunks(ranges, virtual_stages_, coords_.pp);
  }
  if (initial_placement_.empty()) return EvenStage(num_layers, config_.pp, coords_.pp);
  TORCH_INTERNAL_ASSERT(static_cast<int>(initial_placement_.size()) == config_.pp,
                        "initial placement of ", initial_placement_.size(), " stages for pp=",
                        config_.pp);
  StageSpec spec;
  spec.layer_begin = initial_placement_[coords_.pp].first;
  spec.layer_end = initial_placement_[coords_.pp].second;
  spec.has_embedding = coords_.pp == 0;
  spec.has_head = coords_.pp == config_.pp - 1;
  return spec;
}

Communicator& ProcessGroupContext::group(GroupKind kind) {
  for (size_t i = 0; i < std::size(kGroupKinds); ++i) {
    if (kGroupKinds[i] == kind) return *groups_[i];
  }
  TORCH_INTERNAL_ASSERT(false, "unknown group kind");
}

void ProcessGroupContext::AllReduceGradients(const std::vector<Unit*>& units,
                                             const ParameterFilter& reduced) {
  AllReduceSequenceParallelGradients(units);
  gradient_reducer_->AllReduce(units, reduced);
  expert_gradient_reducer_->AllReduce(units, reduced);
  AllReduceTiedGradients(units);
}

bool ProcessGroupContext::SummedOverModelParallel(const Unit& unit, const Parameter& p) const {
  return (p.sharding.sequence_parallel && config_.tp > 1) || TiedAcrossStages(unit, p);
}

bool ProcessGroupContext::TiedAcrossStages(const Unit& unit, const Parameter& p) const {
  if (embedding_group_ == nullptr) return false;
  // ZB-V: the embedding and the head are on one rank; its gradient is whole there.
  if (!virtual_stages_.empty() && virtual_stages_.front().first == virtual_stages_.back().first) {
    return false;
  }
  return (unit.name() == "embedding" && p.name == "word_embeddings.weight") ||
         p.sharding.mirror_of == "embedding.word_embeddings.weight";
}

namespace {

// A started collective of a communicator: its result once the work is done.
class CommunicatorCollective final : public PendingCollective {
 public:
  explicit CommunicatorCollective(PendingTensor pending) : pending_(std::move(pending)) {}
  at::Tensor Wait() override {
    pending_.work->Wait();
    return pending_.tensor;
  }

 private:
  PendingTensor pending_;
};

}  // namespace

std::unique_ptr<PendingCollective> ProcessGroupContext::StartAllReduceSum(GroupRole role,
                                                                          at::Tensor tensor) {
  Communicator& comm = group(KindOf(role));
  if (comm.size() == 1) return std::make_unique<FinishedCollective>(std::move(tensor));
  std::unique_ptr<CommWork> work = comm.IAllReduce(tensor, ReduceOp::kSum);
  return std::make_unique<CommunicatorCollective>(PendingTensor{tensor, std::move(work)});
}

std::unique_ptr<PendingCollective> ProcessGroupContext::StartReduceScatterSum(
    GroupRole role, const at::Tensor& input) {
  Communicator& comm = group(KindOf(role));
  if (comm.size() == 1) return std::make_unique<FinishedCollective>(input.clone());
  return std::make_unique<CommunicatorCollective>(comm.IReduceScatter(input, ReduceOp::kSum));
}

void ProcessGroupContext::AllReduceModelParallelGradients(const std::vector<Unit*>& units) {
  AllReduceSequenceParallelGradients(units);
  AllReduceTiedGradients(units);
}

void ProcessGroupContext::AllReduceSequenceParallelGradients(const std::vector<Unit*>& units) {
  Communicator& tp = group(GroupKind::kTensor);
  if (tp.size() == 1) return;
  // NOTE [sequence parallelism]: each rank's gradient covers its sequence rows. Every rank
  // of the group runs the same layers, so the same gradients are defined on each: one
  // all-reduce per dtype of them all, flattened.
  std::map<at::ScalarType, std::vector<at::Tensor>> grads;
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      if (!p.sharding.sequence_parallel || !p.value.grad().defined()) continue;
      grads[p.value.grad().scalar_type()].push_back(p.value.mutable_grad());
    }
  }
  for (auto& [dtype, list] : grads) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& g : list) flat.push_back(g.reshape({-1}));
    at::Tensor sum = at::cat(flat);
    tp.AllReduce(sum, ReduceOp::kSum);
    int64_t offset = 0;
    for (at::Tensor& g : list) {
      g.copy_(sum.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

void ProcessGroupContext::AllReduceTiedGradients(const std::vector<Unit*>& units) {
  // Tied output weight across stages: the embedding (first stage) and its mirror (last
  // stage) each hold part of the gradient; both take the sum, so both take the same step.
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      if (!TiedAcrossStages(*unit, p)) continue;
      at::Tensor& g = p.value.mutable_grad();
      if (!g.defined()) g = at::zeros_like(p.value);
      embedding_group_->AllReduce(g, ReduceOp::kSum);
    }
  }
}

GroupKind ProcessGroupContext::KindOf(GroupRole role) {
  switch (role) {
    case GroupRole::kTensor: return GroupKind::kTensor;
    case GroupRole::kPipeline: return GroupKind::kPipeline;
    case GroupRole::kData: return GroupKind::kData;
    case GroupRole::kExpert: return GroupKind::kExpert;
    case GroupRole::kExpertData: return GroupKind::kExpertData;
    case GroupRole::kModel: return GroupKind::kModel;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown group role ", static_cast<int>(role));
}

void ProcessGroupContext::AllReduceSum(GroupRole role, at::Tensor& tensor) {
  Communicator& comm = group(KindOf(role));
  if (comm.size() > 1) comm.AllReduce(tensor, ReduceOp::kSum);
}

at::Tensor ProcessGroupContext::ReduceScatterSum(GroupRole role, const at::Tensor& input) {
  Communicator& comm = group(KindOf(role));
  if (comm.size() == 1) return input.clone();
  return comm.ReduceScatter(input, ReduceOp::kSum);
}

at::Tensor ProcessGroupContext::AllGather(GroupRole role, const at::Tensor& shard) {
  Communicator& comm = group(KindOf(role));
  if (comm.size() == 1) return shard;
  return comm.AllGather(shard);
}

void ProcessGroupContext::SumOverDataParallel(std::vector<double>& values) {
  SumDoubles(group(GroupKind::kData), values);
}

void ProcessGroupContext::SumOverModelParallel(std::vector<double>& values) {
  SumDoubles(group(GroupKind::kModel), values);
}

void ProcessGroupContext::SumOverExpertParallel(std::vector<double>& values) {
  SumDoubles(group(GroupKind::kExpert), values);
}

std::vector<std::string> ProcessGroupContext::GatherOverPipeline(const std::string& mine) {
  Communicator& pp = group(GroupKind::kPipeline);
  if (pp.size() == 1) return {mine};
  // Lengths first, then every string padded to the longest.
  at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lengths = pp.AllGather(length);
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor bytes = at::zeros({1, longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(bytes.data_ptr<uint8_t>()));
  at::Tensor all = pp.AllGather(bytes);
  std::vector<std::string> out;
  for (int64_t s = 0; s < all.size(0); ++s) {
    const char* row = reinterpret_cast<const char*>(all[s].data_ptr<uint8_t>());
    out.emplace_back(row, static_cast<size_t>(lengths[s].item<int64_t>()));
  }
  return out;
}

at::Tensor ProcessGroupContext::StackOverPipeline(const at::Tensor& row) {
  return group(GroupKind::kPipeline).AllGather(row.contiguous().unsqueeze(0));
}

}  // namespace fulcrum::parallel
