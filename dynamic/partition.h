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
// NOTE [partition under chunks]
// With chunks (NOTE [chunks] in balance_problem.h) Partition minimises the largest CHUNK,
// then the bottleneck RANK (the sum of its chunks), every rank's memory (all its chunks)
// within the budget, at least one layer per virtual stage:
// - ZB-V's V shape (rank r holds virtual r and 2p−1−r): exact, by a DP that places ranks
//   from both ends of the model inwards, state (rank, first free layer from the front,
//   first taken layer from the back); O(p·L⁴) time at worst, O(p·L²) memory. Its first
//   criterion is the largest CHUNK, the rank bottleneck only the second: ZB-V's order is
//   built for chunks of equal cost, and a placement that evens the ranks' sums with
//   uneven chunks lengthens its fill and drain. Measured in the simulator
//   (tests/dynamic/sim/chunk_simulation_test.cc): rank-first placements made ZB-V 13–21%
//   slower than the even split at p = 16 and 24 (bubble 0.23 → 0.35), and 2 of 48 small
//   random runs slower at m = 8p; chunk first, none slower. The rank bottleneck stays
//   within twice the optimum (a rank holds two chunks, each at most the optimal largest
//   chunk, which is at most the optimal rank bottleneck).
// - Any other map (interleaved: virtual k on rank k % p): first criterion the largest
//   chunk too — the per-chunk optimum C, the least largest chunk of any placement (the
//   one-chunk DP over the p·v virtual stages) — then the bottleneck rank among the
//   placements reaching C, exact by branch and bound (a depth-first search over the chunks
//   in model order, cutting a partial placement as soon as a rank's cost reaches the best
//   found, a chunk exceeds C or a rank's memory the budget), started from a placement
//   reaching C. When none reaching C fits the memory budget, the bottleneck rank alone.
//   Measured (fulcrum_sim --schedules --case=moe, 4 layers per stage, 40 iterations):
//   rank-first Partition made interleaved 1F1B 1.1% / 1.0% slower than the even split at
//   8 / 16 stages (its oracle, each iteration on its own rank-optimal placement, gained
//   only 2.4%); chunk first, 9.5% / 7.9% faster. The rank bottleneck stays within v times
//   the optimum (a rank holds v chunks of at most C ≤ the optimal bottleneck). The search
//   is capped at 2·10⁶ steps a phase; when the cap cuts it, the best placement found is
//   returned, never worse than that start.
// Ties (NOTE [partition tie-break]): fewest layers moving between RANKS, then fewest
// moving between chunks of a rank (local moves, no transfer); then the V shape takes, rank
// by rank from the outside in, the smallest end of the front chunk and then the smallest
// begin of the back chunk; the other maps go by the ends in model order, each nearest to
// the reference's (`current`'s, or the even split's) end of that chunk first, then the
// smaller.
//
// Pure function; thread-safe.
#pragma once

#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic {

/// How PartitionBalance found its answer (for tests and benchmarks).
struct PartitionReport {
  /// False only when the branch and bound of NOTE [partition under chunks] was cut at its
  /// step limit: the answer is then the best found, within a factor v of the optimum.
  bool exact = true;
  /// Steps of that branch and bound (both phases); 0 without it.
  int64_t search_steps = 0;
  /// With that branch and bound: a lower bound on the optimal bottleneck (the per-chunk
  /// optimum, the mean rank cost), to say how far a cut search may be from it; else 0.
  double lower_bound = 0;
};

/// The contiguous placement with ≥ 1 layer per stage and every stage within the memory
/// budget that minimises Bottleneck(); ties broken as NOTE [partition tie-break] says.
/// With chunks: NOTE [partition under chunks].
/// `current`, when given, must be a valid placement for `problem`.
/// Errors: InvalidArgument for an invalid problem or current placement, or fewer layers
/// than stages; ResourceExhausted when no placement fits the memory budget (the message
/// gives the smallest achievable largest stage memory).
absl::StatusOr<Placement> PartitionBalance(const BalanceProblem& problem,
                                           const Placement* current = nullptr,
                                           PartitionReport* report = nullptr);

}  // namespace fulcrum::dynamic
