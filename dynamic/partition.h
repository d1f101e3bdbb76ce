// The Partition balancer: the placement that minimises the bottleneck stage, exactly.
//
// DynMo (Wahib et al., SC'25) §3.3 uses DeepSpeed's partition_balanced (a binary search on
// the bottleneck with a linear probe), which loops forever or leaves stages empty when
// there are fewer layers than stages, and checks memory only after the fact. Partition is a
// dynamic program over (stage, last layer) instead: O(p · L²) time, O(p · L) memory, exact,
// with the memory budget checked inside the search and at least one layer per stage.
//
// NOTE [partition tie-break]
// Many placements often share the optimal bottleneck. A rebalancer must not migrate layers
// for nothing, so among them Partition returns one that moves the fewest layers
// (LayersMoved) from `current`, or, without a current placement, from Megatron's even split
// (UniformPlacement) — so that equal costs give the even split. Among those it returns the
// one with the lexicographically smallest stage ends (end of stage 0 first). "Optimal"
// compares StageCost values with exact equality (NOTE [bit-equal stage costs]).
//
// Pure function; thread-safe.
#pragma once

#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic {

/// The contiguous placement with ≥ 1 layer per stage and every stage within the memory
/// budget that minimises Bottleneck(); ties broken as NOTE [partition tie-break] says.
/// `current`, when given, must be a valid placement for `problem`.
/// Errors: InvalidArgument for an invalid problem or current placement, or fewer layers
/// than stages; ResourceExhausted when no placement fits the memory budget (the message
/// gives the smallest achievable largest stage memory).
absl::StatusOr<Placement> PartitionBalance(const BalanceProblem& problem,
                                           const Placement* current = nullptr);

}  // namespace fulcrum::dynamic
