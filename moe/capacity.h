// Expert capacity and slot assignment: how many tokens each expert takes this step, which
// assignments of a Routing get a slot, and in which order they claim them.
//
// Capacity follows the sign convention of Tutel's `capacity_factor` (Hwang et al. 2023,
// "Tutel: Adaptive Mixture-of-Experts at Scale", dynamic capacity) with GShard's and
// Megatron's rounding (Tutel itself takes k·floor(x·ceil(T/E))): with x = --moe_capacity_factor,
//   x > 0   fixed:   C = ceil(k·x·T/E)
//   x = 0   dropless: C = the largest expert load this step (nothing dropped)
//   x < 0   capped:  C = min(largest expert load, ceil(k·(−x)·T/E))
// With expert parallelism every rank must use the same C (the all-to-all buffers are
// [E, C, D] on every rank), so for x <= 0 the caller passes a max-reduction over the
// expert-parallel group; the fixed case needs none when all ranks route the same T.
//
// Slots are assigned in the Routing's list order (NOTE [assignment order] in
// moe/router.h); PrioritizeByConfidence changes that order to V-MoE's batch priority.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "moe/router.h"

namespace fulcrum::moe {

/// Checks --moe_capacity_factor (any finite number; see the header comment).
absl::Status ValidateCapacityFactor(double capacity_factor);

/// ceil(factor·k·T/E) for factor > 0, ignoring floating-point round-off just above an
/// integer (so 1.2·10/3 gives 4, not 5).
int64_t CeilCapacity(double factor, int64_t k, int64_t num_tokens, int64_t num_experts);

/// Max-reduces the locally needed capacity over the expert-parallel group; identity (or
/// nullptr) on one rank. Called only for capacity factors <= 0, on every rank alike.
using CapacityMaxReduce = std::function<int64_t(int64_t local_need)>;

/// The capacity C per expert for this step. `expert_load` [E] (the Routing's) is read only
/// for capacity_factor <= 0. T = num_tokens routed with k experts each.
int64_t ExpertCapacity(double capacity_factor, int64_t k, int64_t num_tokens,
                       const at::Tensor& expert_load,
                       const CapacityMaxReduce& max_reduce = nullptr);

/// Where each assignment of a Routing goes.
struct SlotAssignment {
  at::Tensor slot;                ///< [N] int64: slot in its expert's buffer, −1 = dropped.
  int64_t capacity = 0;           ///< C, the slots per expert.
  int64_t dropped = 0;            ///< Assignments that found their expert full.
  at::Tensor dropped_per_expert;  ///< [E] int64.
};

/// For each expert, its assignments claim slots 0..C−1 in list order; the rest are dropped.
/// Runs in O(N log N) on the flat list (a stable sort by expert), no [N, E] tensors.
SlotAssignment AssignSlots(const Routing& routing, int64_t num_experts, int64_t capacity);

/// Batch-prioritized routing (Riquelme et al. 2021, "Scaling Vision with Sparse Mixture of
/// Experts", §4, BPR): the same assignments reordered so that confident tokens claim slots
/// first. A token's priority is its largest router probability (max over probs[t, :], the
/// paper's default score). The order stays choice-major as in the paper: all first choices
/// by descending priority, then all second choices by descending priority, ... (a token's
/// j-th choice is its j-th appearance in the list); ties keep list order. gate stays
/// differentiable; probs, expert_load and aux_losses are shared with `routing`.
Routing PrioritizeByConfidence(const Routing& routing);

}  // namespace fulcrum::moe
