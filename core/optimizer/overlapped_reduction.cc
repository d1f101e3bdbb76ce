#include "core/optimizer/overlapped_reduction.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fulcrum {

std::vector<OverlappedReduction::Bucket> OverlappedReduction::Cut(
    const std::vector<Unit*>& units, ParallelContext::GroupRole group,
    const std::function<bool(const Unit&, const Parameter&)>& take,
    const std::function<bool(const Unit&, const Parameter&)>& at_step, int64_t bucket_bytes,
    int64_t pad_to) {
  std::vector<Bucket> buckets;
  for (const bool step_part : {false, true}) {
    Bucket bucket;
    int64_t bytes = 0;
    auto close = [&] {
      if (bucket.members.empty()) return;
      bucket.size = (bucket.size + pad_to - 1) / pad_to * pad_to;
      buckets.push_back(std::move(bucket));
      bucket = Bucket();
      bytes = 0;
    };
    for (auto it = units.rbegin(); it != units.rend(); ++it) {
      Unit* unit = *it;
      for (Parameter& p : unit->parameters()) {
        if (!take(*unit, p) || (at_step && at_step(*unit, p)) != step_part) continue;
        if (!bucket.members.empty() &&
            (bucket.dtype != p.value.scalar_type() || bucket.device != p.value.device())) {
          close();
        }
        if (bucket.members.empty()) {
          bucket.group = group;
          bucket.dtype = p.value.scalar_type();
          bucket.device = p.value.device();
          bucket.at_step = step_part;
        }
        bucket.members.push_back({unit, &p, bucket.size});
        bucket.size += p.value.numel();
        bytes += p.value.numel() * static_cast<int64_t>(p.value.element_size());
        if (bytes >= bucket_bytes) close();
      }
    }
    close();
  }
  return buckets;
}

void OverlappedReduction::Begin(std::vector<Bucket> buckets) {
  Cancel();
  buckets_ = std::move(buckets);
  units_left_.assign(buckets_.size(), 0);
  buckets_of_.clear();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    std::set<const Unit*> units;
    for (const Member& m : buckets_[i].members) units.insert(m.unit);
    units_left_[i] = static_cast<int>(units.size());
    for (const Unit* unit : units) buckets_of_[unit].push_back(i);
  }
  next_ = 0;
  started_early_ = 0;
  active_ = true;
}

absl::StatusOr<at::Tensor> OverlappedReduction::Flatten(const Bucket& bucket) const {
  const int64_t flags = bucket.presence ? static_cast<int64_t>(bucket.members.size()) : 0;
  at::Tensor flat = at::zeros({bucket.size + flags},
                              at::TensorOptions().dtype(bucket.dtype).device(bucket.device));
  at::Tensor present = at::zeros({flags}, at::kFloat);
  for (size_t j = 0; j < bucket.members.size(); ++j) {
    const Member& m = bucket.members[j];
    const at::Tensor& g = m.param->value.grad();
    if (!g.defined()) continue;
    if (g.scalar_type() != bucket.dtype) {
      return absl::InternalError(absl::StrCat(
          "the data-parallel gradient reduction: the gradient of ", m.unit->GlobalName(m.param->name), " is ",
          c10::toString(g.scalar_type()), ", its bucket ", c10::toString(bucket.dtype)));
    }
    flat.narrow(0, m.offset, g.numel()).copy_(g.reshape({-1}));
    if (flags > 0) present.data_ptr<float>()[j] = 1.0f;
  }
  if (flags > 0) flat.narrow(0, bucket.size, flags).copy_(present);
  return flat;
}

absl::Status OverlappedReduction::UnitFinal(const Unit& unit, ParallelContext& collectives) {
  if (!active_) return absl::OkStatus();
  auto it = buckets_of_.find(&unit);
  if (it == buckets_of_.end()) return absl::OkStatus();
  for (const size_t i : it->second) --units_left_[i];
  buckets_of_.erase(it);  // a unit reported twice counts once
  while (next_ < buckets_.size() && units_left_[next_] == 0 && !buckets_[next_].at_step) {
    const Bucket& b = buckets_[next_];
    FULCRUM_ASSIGN_OR_RETURN(at::Tensor flat, Flatten(b));
    in_flight_.push_back(b.scatter ? collectives.StartReduceScatterSum(b.group, flat)
                                   : collectives.StartAllReduceSum(b.group, flat));
    ++next_;
    ++started_early_;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<at::Tensor>> OverlappedReduction::Finish(ParallelContext& collectives) {
  if (!active_) return absl::FailedPreconditionError("OverlappedReduction::Finish without Begin");
  std::vector<at::Tensor> results;
  results.reserve(buckets_.size());
  // The buckets in flight first (they were started first), then the rest, in order.
  for (auto& pending : in_flight_) results.push_back(pending->Wait());
  in_flight_.clear();
  for (size_t i = next_; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    FULCRUM_ASSIGN_OR_RETURN(at::Tensor flat, Flatten(b));
    if (b.scatter) {
      results.push_back(collectives.ReduceScatterSum(b.group, flat));
    } else {
      collectives.AllReduceSum(b.group, flat);
      results.push_back(std::move(flat));
    }
  }
  next_ = buckets_.size();
  active_ = false;
  return results;
}

void OverlappedReduction::Cancel() {
  for (auto& pending : in_flight_) pending->Wait();
  in_flight_.clear();
  active_ = false;
}

}  // namespace fulcrum
