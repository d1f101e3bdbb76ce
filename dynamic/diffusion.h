// The Diffusion balancer: neighbouring stages hand boundary layers from the heavier to the
// lighter one, in rounds, while the potential φ = Σ_{u<v} |L_u − L_v| falls.
//
// After DynMo (Wahib et al., SC'25) §3.3 ("iterative decentralised" diffusion, whose
// potential never rises), with two differences from DynMo's code: layer order is kept (a
// stage only ever gives away the layer at its boundary with the receiver, so every stage
// stays a contiguous range), and moves are judged by φ itself rather than by variance.
//
// NOTE [diffusion rounds]
// A round visits the adjacent pairs (u, u+1) in order of decreasing load gap |L_u − L_{u+1}|
// at the round's start (ties: lower u first). For each, the heavier stage offers the
// layer next to the lighter one; the move is accepted when the heavier keeps ≥ 1 layer, the
// lighter stays within the memory budget, and φ strictly falls. Later pairs see the loads
// the earlier moves left. Single moves get stuck on staircases (unit layers, loads
// 1,2,3,4,5: every single move only swaps two loads and leaves φ unchanged), so a round
// that accepts no single move tries chain moves: a layer shifts along a path of
// consecutive stages from a heavier stage u to a lighter stage v, each stage on the path
// passing its boundary layer on (only u loses a layer and only v gains one; u must keep
// one). Of the chains that every stage on the path can hold (memory) and that strictly
// lower φ, the one that lowers φ most is applied (ties: lower u, then lower v). Diffusion
// stops after a round that accepts nothing, or after max_rounds rounds.
//
// NOTE [zero-cost layers travel with a neighbour]
// Moving a layer that costs nothing leaves every load, and so φ, unchanged: it is never
// accepted, and a zero-cost layer at a boundary would block every later layer behind it
// (in random tests: bottlenecks up to 1.6 largest layer costs above the optimum). So what
// a stage passes on is its boundary unit: the boundary layer together with the layers
// behind it up to and including the first one that costs more than zero, moved as one.
// Without zero-cost layers a unit is one layer, and everything above holds as written;
// a unit must leave its stage at least one layer.
//
// "Strictly falls" means by more than 1e-12 · p · Σ L_u, so that rounding noise in the
// loads never moves a layer. A move never raises φ and never takes a stage over the memory
// budget (a stage already over it only ever loses memory).
//
// NOTE [diffusion under chunks]
// With chunks (NOTE [chunks] in balance_problem.h) the stages above are the VIRTUAL stages in
// model order, each with its own load (its chunk's cost): a unit crosses the boundary between
// virtual stages k and k+1 only, so every chunk stays a contiguous range, and φ is over the
// chunks; memory is checked per rank (a rank whose memory grows must stay within the
// budget). Chunks, not ranks: the interleaved and V orders are built for chunks of equal
// cost, as Partition's first criterion says (NOTE [partition under chunks] in partition.h).
// Measured (fulcrum_sim --schedules --case=moe, 16 stages, 4 layers each, 40 iterations):
// evening the ranks' sums, Diffusion made interleaved 1F1B 1.0% slower than the even split
// and ZB-V 0.5% faster; evening the chunks, 11.9% and 4.4% faster. A move between two
// adjacent chunks of one rank (ZB-V's turn at the bottom of the V) is a local move: it
// changes no rank's load but evens the two chunks. Without chunks all of this is the
// one-chunk diffusion, bit for bit.
//
// Pure function; thread-safe.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic {

/// Options of DiffusionBalance.
struct DiffusionOptions {
  /// Rounds after which Diffusion stops even if moves still lower the potential
  /// (--diffusion_max_rounds). Default: 32. Must be ≥ 0.
  int max_rounds = 32;
};

/// What DiffusionBalance did.
struct DiffusionResult {
  Placement placement;  ///< The balanced placement.
  int rounds = 0;       ///< Rounds that moved at least one layer.
  /// Moves accepted: single moves and chain moves (a chain counts once, although it moves
  /// one layer across each boundary on its path). LayersMoved(current, placement) says
  /// what a migration would send.
  int moves = 0;
  /// The potential of the input placement, then after each round: rounds + 1 entries,
  /// non-increasing.
  std::vector<double> potential_per_round;
};

/// Diffuses layers from `current` as NOTE [diffusion rounds] says.
/// Errors: InvalidArgument for an invalid problem, an invalid `current`, fewer layers than
/// stages (the same message as PartitionBalance), or negative max_rounds.
absl::StatusOr<DiffusionResult> DiffusionBalance(const BalanceProblem& problem,
                                                 const Placement& current,
                                                 const DiffusionOptions& options = {});

}  // namespace fulcrum::dynamic
