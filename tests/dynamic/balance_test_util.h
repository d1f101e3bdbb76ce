// Shared helpers of the balancer tests (tests/dynamic): a brute force over every placement
// and a seeded set of random problems, so that Partition and Diffusion are judged on the
// same problems against the same optimum.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic::balance_testing {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Every composition of num_layers into num_stages positive parts, in lexicographic order
/// of the stage ends (end of stage 0 first): the order NOTE [partition tie-break] uses.
std::vector<Placement> AllPlacements(int64_t num_layers, int num_stages);

/// A uniformly random placement of num_layers ≥ num_stages layers (every stage non-empty).
Placement RandomPlacement(int64_t num_layers, int num_stages, std::mt19937_64* rng);

/// The smallest achievable largest stage memory over all placements (brute force).
double LeastLargestMemory(const BalanceProblem& problem);

/// The optimal bottleneck over all placements that fit memory (brute force); kInf if none.
double BruteForceBottleneck(const BalanceProblem& problem);

/// `count` random problems from `seed`: eight cost shapes (problem i has shape i % 8),
/// 1 ≤ p ≤ 6, p ≤ L ≤ 12, pinned costs on half, memory budgets none / loose / tight /
/// just feasible / infeasible.
std::vector<BalanceProblem> RandomProblems(int count, uint64_t seed);

}  // namespace fulcrum::dynamic::balance_testing
