// Shared helpers of the balancer tests (tests/dynamic): a brute force over every placement
// and a seeded set of random problems, so that Partition and Diffusion are judged on the
// same problems against the same optimum.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "dynamic/balance_problem.h"

namespace fulcrum::dynamic::balance_testing {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// How many random problems PartitionTest and DiffusionTest each judge, and their seed (the
/// same problems for both balancers).
constexpr int kRandomProblems = 1500;
constexpr uint64_t kSeed = 20250611;

/// A problem with only per-layer costs over `num_stages` stages (no pinned costs, no memory).
inline BalanceProblem CostsOnly(std::vector<double> costs, int num_stages) {
  BalanceProblem problem;
  problem.num_stages = num_stages;
  problem.layer_cost = std::move(costs);
  return problem;
}

/// CostsOnly over virtual stages: `chunk_rank[c]` is the rank that runs virtual stage c.
inline BalanceProblem Chunked(std::vector<double> costs, int num_stages, std::vector<int> chunk_rank) {
  BalanceProblem problem = CostsOnly(std::move(costs), num_stages);
  problem.chunk_rank = std::move(chunk_rank);
  return problem;
}

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
