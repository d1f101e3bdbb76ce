#include "core/optimizer/distributed_adamw.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/optimizer/overlapped_reduction.h"
#include "core/status.h"

namespace fulcrum {
namespace {

using GroupRole = ParallelContext::GroupRole;

bool Trainable(const Unit& unit) {
  for (const Parameter& p : unit.parameters()) {
    if (p.value.requires_grad()) return true;
  }
  return false;
}

}  // namespace

std::pair<int64_t, int64_t> DistributedAdamW::OwnedPart(const Bucket& b, const Member& m) {
  const int64_t begin = std::max(m.offset, b.shard_begin);
  const int64_t end = std::min(m.offset + m.param->value.numel(), b.shard_begin + b.shard_size);
  return {begin, end};
}

absl::Status DistributedAdamW::EnsureLayout(const std::vector<Unit*>& units,
                                            ParallelContext& collectives) {
  std::vector<const c10::TensorImpl*> signature;
  for (Unit* unit : units) {
    for (const Parameter& p : unit->parameters()) signature.push_back(p.value.unsafeGetTensorImpl());
  }
  if (!buckets_.empty() || !signature_.empty()) {
    if (signature == signature_) return absl::OkStatus();
    if (!gathered_) {
      return absl::FailedPreconditionError(
          "the distributed optimizer's parameters changed between steps without its state "
          "gathered first (layers moved without ForwardBackwardRunner::SetBeforeLayersMove's "
          "hook, or the job was re-packed): not supported yet with --use_distributed_optimizer");
    }
    // Layers moved; every Parameter holds its whole state (the old buckets may point at
    // units that left: dropped unread).
    buckets_.clear();
    steps_.clear();
  }
  signature_ = std::move(signature);
  expert_device_.reset();
  for (Unit* unit : units) {
    for (const Parameter& p : unit->parameters()) {
      if (!p.value.is_contiguous()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--use_distributed_optimizer: parameter ", unit->GlobalName(p.name),
            " is not contiguous; the optimizer updates it through a flat view"));
      }
    }
  }
  // Last unit first, the parameters the model-parallel sums change in trailing buckets
  // (NOTE [overlapped gradient reduction]): the order gradients become final.
  auto at_step = [&](const Unit& unit, const Parameter& p) {
    return collectives.SummedOverModelParallel(unit, p);
  };
  for (GroupRole group : {GroupRole::kData, GroupRole::kExpertData}) {
    const int n = collectives.GroupSize(group);
    const int r = collectives.GroupRank(group);
    auto of_group = [&](const Unit&, const Parameter& p) {
      return p.sharding.ReducedOverExpertData() == (group == GroupRole::kExpertData);
    };
    for (OverlappedReduction::Bucket& cut :
         OverlappedReduction::Cut(units, group, of_group, at_step, bucket_bytes_, n)) {
      Bucket bucket;
      bucket.cut = std::move(cut);
      bucket.cut.scatter = true;
      bucket.shard_size = bucket.cut.size / n;
      bucket.shard_begin = r * bucket.shard_size;
      const auto options = at::TensorOptions().dtype(bucket.cut.dtype).device(bucket.cut.device);
      bucket.exp_avg = at::zeros({bucket.shard_size}, options);
      bucket.exp_avg_sq = at::zeros({bucket.shard_size}, options);
      if (group == GroupRole::kExpertData) expert_device_ = bucket.cut.device;
      buckets_.push_back(std::move(bucket));
    }
  }
  for (Unit* unit : units) steps_[unit] = unit->optimizer_step();
  return absl::OkStatus();
}

void DistributedAdamW::AdoptWrittenState() {
  at::NoGradGuard no_grad;
  for (Bucket& b : buckets_) {
    for (const Member& m : b.cut.members) {
      Parameter& p = *m.param;
      const auto [begin, end] = OwnedPart(b, m);
      const at::Tensor exp_avg = p.OptimizerState(AdamW::kExpAvg);
      const at::Tensor exp_avg_sq = p.OptimizerState(AdamW::kExpAvgSq);
      const bool written = exp_avg.defined() && exp_avg_sq.defined();
      const bool reset = !written && m.unit->optimizer_step() == 0 && steps_[m.unit] > 0;
      if (begin < end && (written || reset)) {
        at::Tensor mine = b.exp_avg.narrow(0, begin - b.shard_begin, end - begin);
        at::Tensor mine_sq = b.exp_avg_sq.narrow(0, begin - b.shard_begin, end - begin);
        if (written) {
          mine.copy_(exp_avg.reshape({-1}).narrow(0, begin - m.offset, end - begin));
          mine_sq.copy_(exp_avg_sq.reshape({-1}).narrow(0, begin - m.offset, end - begin));
        } else {
          mine.zero_();
          mine_sq.zero_();
        }
      }
      p.optimizer_state.clear();
    }
  }
  for (auto& [unit, step] : steps_) step = unit->optimizer_step();
  gathered_ = false;
}

std::vector<OverlappedReduction::Bucket> DistributedAdamW::Reductions() const {
  std::vector<OverlappedReduction::Bucket> reductions;
  reductions.reserve(buckets_.size());
  for (const Bucket& b : buckets_) reductions.push_back(b.cut);
  return reductions;
}

absl::Status DistributedAdamW::BeginGradientReduction(const std::vector<Unit*>& units,
                                                      ParallelContext& collectives) {
  FULCRUM_RETURN_IF_ERROR(EnsureLayout(units, collectives));
  AdoptWrittenState();
  overlap_.Begin(Reductions());
  return absl::OkStatus();
}

std::vector<GradientPart> DistributedAdamW::OwnedGradients(
    const std::vector<at::Tensor>& grad_slices, const std::vector<std::vector<bool>>& present) const {
  std::vector<GradientPart> parts;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    for (size_t j = 0; j < b.cut.members.size(); ++j) {
      const Member& m = b.cut.members[j];
      const auto [begin, end] = OwnedPart(b, m);
      if (!present[i][j] || begin >= end) continue;
      parts.push_back(GradientPart{m.unit, m.param, begin - m.offset, end - m.offset,
                                   grad_slices[i].narrow(0, begin - b.shard_begin, end - begin),
                                   b.cut.group == GroupRole::kExpertData});
    }
  }
  return parts;
}

void DistributedAdamW::SumOverHolders(ParallelContext& collectives, bool expert,
                                      std::vector<double>& values) const {
  if (!expert) {
    collectives.SumOverDataParallel(values);
    return;
  }
  // Every rank of an expert-data-parallel group is on one stage: all hold experts or none.
  if (!expert_device_ || values.empty()) return;
  at::Tensor t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(*expert_device_);
  collectives.AllReduceSum(GroupRole::kExpertData, t);
  t = t.cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = t.data_ptr<double>()[i];
}

absl::StatusOr<StepResult> DistributedAdamW::ReduceAndStep(const std::vector<Unit*>& units,
                                                           ParallelContext& collectives,
                                                           const StepRequest& request) {
  FULCRUM_RETURN_IF_ERROR(EnsureLayout(units, collectives));
  AdoptWrittenState();
  const auto start = std::chrono::steady_clock::now();
  collectives.AllReduceModelParallelGradients(units);

  // Which parameters have a gradient on some rank of their group (as GradientReducer
  // agrees): the others stay without one and take no step.
  std::vector<std::vector<bool>> present(buckets_.size());
  for (GroupRole group : {GroupRole::kData, GroupRole::kExpertData}) {
    std::vector<std::pair<size_t, size_t>> where;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      if (buckets_[i].cut.group != group) continue;
      present[i].assign(buckets_[i].cut.members.size(), false);
      for (size_t j = 0; j < buckets_[i].cut.members.size(); ++j) where.emplace_back(i, j);
    }
    if (where.empty()) continue;
    std::vector<bool> mine(where.size());
    for (size_t k = 0; k < where.size(); ++k) {
      mine[k] = buckets_[where[k].first].cut.members[where[k].second].param->value.grad().defined();
    }
    const std::vector<bool> any =
        collectives.AnyRank(group, mine, buckets_[where.front().first].cut.device);
    for (size_t k = 0; k < where.size(); ++k) present[where[k].first][where[k].second] = any[k];
  }

  // Each bucket's gradients, summed over its group: this rank's slice only — those that
  // started during the backward are waited for (NOTE [overlapped gradient reduction]).
  if (!overlap_.active()) overlap_.Begin(Reductions());  // nothing started early: all now
  FULCRUM_ASSIGN_OR_RETURN(std::vector<at::Tensor> grad_slices, overlap_.Finish(collectives));
  const double reduce_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (request.after_reduce) {
    ReducedGradients owned(OwnedGradients(grad_slices, present), [&](bool expert, std::vector<double>& values) {
      SumOverHolders(collectives, expert, values);
    });
    FULCRUM_RETURN_IF_ERROR(request.after_reduce(owned));
  }

  // The norm from the owned slices (NOTE [parameter sharding]: slices of tensor-parallel
  // parameters on every tensor-parallel rank, replicas once).
  std::vector<at::Tensor> dense_pieces, expert_pieces;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    for (size_t j = 0; j < b.cut.members.size(); ++j) {
      const Member& m = b.cut.members[j];
      if (!present[i][j] || !m.param->sharding.CountedOn(m.unit->tp_rank(), m.unit->tp_size())) {
        continue;
      }
      const auto [begin, end] = OwnedPart(b, m);
      if (begin >= end) continue;
      at::Tensor piece = grad_slices[i].narrow(0, begin - b.shard_begin, end - begin);
      (b.cut.group == GroupRole::kExpertData ? expert_pieces : dense_pieces).push_back(piece);
    }
  }
  const size_t dp_count = request.data_parallel_sums.size();
  std::vector<double> sums = request.data_parallel_sums;
  sums.insert(sums.end(), request.job_sums.begin(), request.job_sums.end());
  sums.push_back(AdamW::SumOfSquares(dense_pieces));
  collectives.SumOverDataParallel(sums);
  const double dense_sq = sums.back();
  sums.pop_back();
  // The experts' slices: summed over the ranks holding the same experts, then over the
  // ranks holding the others (AdamW sums whole expert gradients over the latter only).
  std::vector<double> expert_sq{AdamW::SumOfSquares(expert_pieces)};
  SumOverHolders(collectives, /*expert=*/true, expert_sq);
  collectives.SumOverExpertParallel(expert_sq);
  StepResult result = FinishNorm(dense_sq + expert_sq[0], sums, dp_count, collectives);
  result.reduce_ms = reduce_ms;
  if (!std::isfinite(result.grad_norm)) return result;
  const double clip = adamw_.ClipFactor(result.grad_norm);
  if (clip < 1.0) {
    for (at::Tensor& g : grad_slices) g.mul_(clip);
  }

  // AdamW on the owned slices, in place in the weights.
  at::NoGradGuard no_grad;
  for (Unit* unit : units) {
    if (Trainable(*unit)) unit->set_optimizer_step(unit->optimizer_step() + 1);
  }
  const OptimizerOptions& o = adamw_.options();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    for (size_t j = 0; j < b.cut.members.size(); ++j) {
      const Member& m = b.cut.members[j];
      Parameter& p = *m.param;
      if (!present[i][j] || !p.value.requires_grad()) continue;
      const auto [begin, end] = OwnedPart(b, m);
      if (begin >= end) continue;
      const int64_t at_slice = begin - b.shard_begin;
      const int64_t len = end - begin;
      adamw_.Update(p.value.view({-1}).narrow(0, begin - m.offset, len),
                    grad_slices[i].narrow(0, at_slice, len), b.exp_avg.narrow(0, at_slice, len),
                    b.exp_avg_sq.narrow(0, at_slice, len), m.unit->optimizer_step(), request.lr,
                    p.weight_decay && o.weight_decay != 0.0);
    }
    // Every rank's updated slice into every rank's weights.
    at::Tensor slice = at::zeros({b.shard_size}, at::TensorOptions().dtype(b.cut.dtype).device(b.cut.device));
    for (const Member& m : b.cut.members) {
      const auto [begin, end] = OwnedPart(b, m);
      if (begin >= end) continue;
      slice.narrow(0, begin - b.shard_begin, end - begin)
          .copy_(m.param->value.view({-1}).narrow(0, begin - m.offset, end - begin));
    }
    // Only the members that took a step: the others are equal on every rank already, and
    // copying over them would bump their version counters for nothing.
    const at::Tensor whole = collectives.AllGather(b.cut.group, slice);
    for (size_t j = 0; j < b.cut.members.size(); ++j) {
      const Member& m = b.cut.members[j];
      if (!present[i][j] || !m.param->value.requires_grad()) continue;
      const int64_t numel = m.param->value.numel();
      m.param->value.view({-1}).copy_(whole.narrow(0, m.offset, numel));
    }
  }
  for (Unit* unit : units) {
    unit->ZeroGrad();
    steps_[unit] = unit->optimizer_step();
  }
  result.stepped = true;
  return result;
}

absl::Status DistributedAdamW::GatherState(const std::vector<Unit*>& units,
                                           ParallelContext& collectives) {
  FULCRUM_RETURN_IF_ERROR(EnsureLayout(units, collectives));
  AdoptWrittenState();
  for (const Bucket& b : buckets_) {
    const at::Tensor exp_avg = collectives.AllGather(b.cut.group, b.exp_avg);
    const at::Tensor exp_avg_sq = collectives.AllGather(b.cut.group, b.exp_avg_sq);
    for (const Member& m : b.cut.members) {
      Parameter& p = *m.param;
      const int64_t numel = p.value.numel();
      p.OptimizerState(AdamW::kExpAvg) =
          exp_avg.narrow(0, m.offset, numel).view(p.value.sizes()).clone();
      p.OptimizerState(AdamW::kExpAvgSq) =
          exp_avg_sq.narrow(0, m.offset, numel).view(p.value.sizes()).clone();
    }
  }
  gathered_ = true;
  return absl::OkStatus();
}

void DistributedAdamW::ReleaseState(const std::vector<Unit*>& units) {
  for (const Bucket& b : buckets_) {
    for (const Member& m : b.cut.members) m.param->optimizer_state.clear();
  }
  gathered_ = false;
}

absl::StatusOr<std::vector<MomentSlice>> DistributedAdamW::MomentSlices(
    const std::vector<Unit*>& units, ParallelContext& collectives) {
  FULCRUM_RETURN_IF_ERROR(EnsureLayout(units, collectives));
  AdoptWrittenState();
  std::vector<MomentSlice> out;
  for (const Bucket& b : buckets_) {
    for (const Member& m : b.cut.members) {
      const auto [begin, end] = OwnedPart(b, m);
      if (begin >= end) continue;
      MomentSlice slice{m.unit, m.param, begin - m.offset, end - m.offset, {}};
      slice.state = {{AdamW::kExpAvg, b.exp_avg.narrow(0, begin - b.shard_begin, end - begin)},
                     {AdamW::kExpAvgSq, b.exp_avg_sq.narrow(0, begin - b.shard_begin, end - begin)}};
      out.push_back(std::move(slice));
    }
  }
  return out;
}

int64_t DistributedAdamW::StateBytes(const std::vector<Unit*>& units) const {
  int64_t bytes = 0;
  for (const Bucket& b : buckets_) {
    bytes += 2 * b.shard_size * static_cast<int64_t>(b.exp_avg.element_size());
  }
  return bytes;
}

}  // namespace fulcrum
