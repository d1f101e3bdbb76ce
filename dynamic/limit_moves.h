// A cap on the layers one rebalancing migrates (--rebalance_max_moves): a placement on the
// way from the current placement to a balancer's target that moves at most that many.
//
// NOTE [limited moves]
// Stage s of a placement ends at boundary s+1 (boundaries 1..p-1; 0 and L are fixed).
// LimitMoves walks from `current` towards `target` one boundary shift at a time: each step
// moves one boundary by one layer towards its target position (a boundary never moves away
// from it, and never so that a stage would be empty), so every placement on the walk has
// each boundary between its current and its target position, and every layer's stage
// between its current and its target stage. A layer's owner changes at most once relative
// to `current` along such a walk, so LayersMoved(current, ·) never falls and the walk
// reaches the target within LayersMoved(current, target) moved layers. Of the shifts that
// keep LayersMoved(current, ·) ≤ max_moves, each step takes the one whose result has the
// smallest bottleneck (ties: lowest boundary index) — even when it is no better than now:
// the point is progress towards the target, and the balancer re-plans from the new placement
// next iteration. When the target fits the memory budget, a shift whose result fits is
// preferred to one whose result does not (the walk may have to pass through a placement
// over the budget: an intermediate stage can hold layers from both ends of its way), and
// LimitMoves returns the last placement of the walk that fits (`current` itself when no
// other does) — a placement the caller will not apply unless it beats `current`.
//
// Pure function; thread-safe.
#pragma once

#include <cstdint>

#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic {

/// A valid placement between `current` and `target` that moves at most `max_moves` layers
/// from `current` (NOTE [limited moves]); `target` itself when max_moves ≤ 0 (no cap) or
/// max_moves ≥ LayersMoved(current, target). Requires a valid problem and valid placements
/// `current` and `target` of its layers (as the balancers return them).
Placement LimitMoves(const BalanceProblem& problem, const Placement& current,
                     const Placement& target, int64_t max_moves);

}  // namespace fulcrum::dynamic
