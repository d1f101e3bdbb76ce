// Dispatch and combine by indices (the fast encode/decode of Hwang et al. 2023, "Tutel:
// Adaptive Mixture-of-Experts at Scale"): tokens are copied into the expert-major buffer
// [E, C, D] that the experts (and the expert-parallel all-to-all) consume, and the experts'
// outputs are gathered back and weighted by their gates, all through the flat assignment
// list of a Routing and its slots.
//
// NOTE [index dispatch memory]
// GShard (Lepikhin et al. 2020, Algorithm 2) writes dispatch and combine as einsums with a
// one-hot dispatch mask and a combine tensor, both [T, E, C]. With capacity factor x,
// C = x·k·T/E, so each holds x·k·T² elements whatever E is (2 GiB in fp32 at T = 16K,
// k = 2), each einsum costs T·E·C·D multiply-adds, and the backward keeps the combine
// tensor and builds its gradient, another [T, E, C]. Here the per-assignment state is three
// [M] vectors (M <= k·T kept assignments) and the [M, D] rows gathered on the way, so
// memory and work grow with T·k·D, linearly in T; the [E, C, D] buffer (x·k·T·D) is what
// every formulation needs. Dispatch saves only the indices; Combine saves the gates and,
// when they need a gradient, the expert output rows it gathered ([M, D], at most the
// buffer's size). Positions are unique, so each buffer row has at
// most one source: Dispatch is a single gather into the buffer, with no accumulation and
// deterministic; only index_add (Combine, Dispatch's backward) sums a token's k rows.
//
// Every dtype that index_select / index_copy / index_add support works: fp32 and fp64 on
// the CPU, bf16 and fp16 too on CUDA. Combine computes in y's dtype: a gate of another
// dtype (the routers' fp32, NOTE [router precision] in moe/router.h) is cast to it, and
// its gradient cast back.
//
// Functions of tensors only; thread-safe as far as ATen is.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "moe/capacity.h"
#include "moe/router.h"

namespace fulcrum::moe {

/// Where the kept assignments of a Routing go: built from a Routing and its SlotAssignment.
/// Dropped assignments (slot −1) are removed; the rest keep the Routing's list order.
struct DispatchPlan {
  at::Tensor token;     ///< [M] int64: token row of each kept assignment.
  at::Tensor position;  ///< [M] int64: row expert·capacity + slot of the [E·C, D] buffer.
  at::Tensor gate;      ///< [M] combine weight (differentiable, as in the Routing).
  int64_t num_tokens = 0, num_experts = 0, capacity = 0;

  /// M, the number of kept assignments.
  int64_t size() const { return token.defined() ? token.size(0) : 0; }
};

/// The plan for `routing` (of `num_tokens` tokens) under `slots` (AssignSlots' result).
/// The number of experts E is that of `slots.dropped_per_expert`. TORCH_CHECKs that the
/// columns are [N] and consistent and that tokens lie in [0, num_tokens).
DispatchPlan MakeDispatchPlan(const Routing& routing, const SlotAssignment& slots,
                              int64_t num_tokens);

/// x [T, D] → expert-major buffer [E, C, D]: buffer[e, c] = x[t] for the kept assignment
/// (t, e, slot c); empty slots are zero. Differentiable w.r.t. x (the backward gathers
/// the buffer's gradient rows and adds them into their tokens).
at::Tensor Dispatch(const at::Tensor& x, const DispatchPlan& plan);

/// y [E, C, D] → out [T, D], out[t] = Σ over kept assignments a of token t of
/// gate[a]·y[position[a]]; a token with no kept assignment gets 0. Differentiable w.r.t.
/// y and plan.gate (and hence the router). The result has y's dtype.
at::Tensor Combine(const at::Tensor& y, const DispatchPlan& plan);

}  // namespace fulcrum::moe
