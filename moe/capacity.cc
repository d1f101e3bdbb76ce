#include "moe/capacity.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace fulcrum::moe {
namespace {

// Rank of each element within its group: for `keys` [N] int64 in [0, G), the number of
// earlier elements (in list order) with the same key. A stable sort by key lays each
// group out in list order; subtracting the group's start gives the rank.
at::Tensor RankWithinGroup(const at::Tensor& keys, int64_t num_groups) {
  const int64_t n = keys.size(0);
  at::Tensor order = std::get<1>(at::sort(keys, /*stable=*/std::optional<bool>(true), /*dim=*/0));
  at::Tensor counts = at::bincount(keys, /*weights=*/{}, num_groups);
  at::Tensor group_start = counts.cumsum(0) - counts;  // [G]
  at::Tensor sorted_rank =
      at::arange(n, keys.options()) - group_start.index_select(0, keys.index_select(0, order));
  return at::empty_like(sorted_rank).index_put_({order}, sorted_rank);
}

}  // namespace

absl::Status ValidateCapacityFactor(double capacity_factor) {
  if (std::isfinite(capacity_factor)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--moe_capacity_factor must be a finite number (> 0 fixed, 0 dropless, < 0 capped), "
      "got ",
      capacity_factor));
}

int64_t CeilCapacity(double factor, int64_t k, int64_t num_tokens, int64_t num_experts) {
  TORCH_CHECK(factor > 0.0 && num_experts >= 1 && k >= 1 && num_tokens >= 0,
              "CeilCapacity: bad arguments factor=", factor, " k=", k, " T=", num_tokens,
              " E=", num_experts);
  const double exact = factor * static_cast<double>(k * num_tokens) / num_experts;
  const double nearest = std::round(exact);
  // k·x·T/E lands on an integer more often than not (x = 1, 1.25, 2); don't let the last
  // bit of a product round that up to the next slot.
  if (std::abs(exact - nearest) <= 1e-9 * std::max(1.0, exact))
    return static_cast<int64_t>(nearest);
  return static_cast<int64_t>(std::ceil(exact));
}

int64_t ExpertCapacity(double capacity_factor, int64_t k, int64_t num_tokens,
                       const at::Tensor& expert_load, const CapacityMaxReduce& max_reduce) {
  TORCH_CHECK(std::isfinite(capacity_factor), "ExpertCapacity: capacity factor ", capacity_factor,
              " is not finite");
  TORCH_CHECK(expert_load.defined() && expert_load.dim() == 1 && expert_load.size(0) >= 1,
              "ExpertCapacity: expert_load must be [E]");
  const int64_t num_experts = expert_load.size(0);
  if (capacity_factor > 0.0) return CeilCapacity(capacity_factor, k, num_tokens, num_experts);
  int64_t need = expert_load.max().item<int64_t>();
  if (max_reduce) need = max_reduce(need);
  if (capacity_factor < 0.0) {
    need = std::min(need, CeilCapacity(-capacity_factor, k, num_tokens, num_experts));
  }
  return need;
}

SlotAssignment AssignSlots(const Routing& routing, int64_t num_experts, int64_t capacity) {
  TORCH_CHECK(capacity >= 0, "AssignSlots: capacity must be >= 0, got ", capacity);
  TORCH_CHECK(routing.expert.defined() && routing.expert.dim() == 1 &&
                  routing.expert.scalar_type() == at::kLong,
              "AssignSlots: routing.expert must be [N] int64");
  const at::Tensor& expert = routing.expert;
  if (expert.numel() > 0) {
    TORCH_CHECK(expert.min().item<int64_t>() >= 0 && expert.max().item<int64_t>() < num_experts,
                "AssignSlots: expert index out of [0, ", num_experts, ")");
  }
  at::Tensor rank = RankWithinGroup(expert, num_experts);
  SlotAssignment out;
  out.capacity = capacity;
  out.slot = at::where(rank < capacity, rank, at::full({}, -1, rank.options()));
  at::Tensor load = at::bincount(expert, /*weights=*/{}, num_experts);
  out.dropped_per_expert = (load - capacity).clamp_min(0);
  out.dropped = out.dropped_per_expert.sum().item<int64_t>();
  return out;
}

Routing PrioritizeByConfidence(const Routing& routing) {
  TORCH_CHECK(routing.probs.defined() && routing.probs.dim() == 2,
              "PrioritizeByConfidence: routing.probs must be [T, E]");
  TORCH_CHECK(routing.token.defined() && routing.token.dim() == 1,
              "PrioritizeByConfidence: routing.token must be [N]");
  const int64_t num_tokens = routing.probs.size(0);
  at::Tensor choice = RankWithinGroup(routing.token, num_tokens);  // j-th choice of its token
  at::Tensor priority =
      std::get<0>(routing.probs.detach().max(1)).index_select(0, routing.token);  // [N]
  // Two stable sorts make a lexicographic order: by priority (descending) first, then by
  // choice (ascending); each keeps the previous order among equal keys.
  at::Tensor by_priority =
      std::get<1>(at::sort(priority, /*stable=*/std::optional<bool>(true), 0, /*descending=*/true));
  at::Tensor by_choice = std::get<1>(
      at::sort(choice.index_select(0, by_priority), /*stable=*/std::optional<bool>(true), 0));
  at::Tensor order = by_priority.index_select(0, by_choice);

  Routing out;
  out.token = routing.token.index_select(0, order);
  out.expert = routing.expert.index_select(0, order);
  out.gate = routing.gate.index_select(0, order);
  out.probs = routing.probs;
  out.expert_load = routing.expert_load;
  out.aux_losses = routing.aux_losses;
  out.choice = routing.choice;
  return out;
}

}  // namespace fulcrum::moe
