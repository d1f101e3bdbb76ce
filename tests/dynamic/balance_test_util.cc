#include "tests/dynamic/balance_test_util.h"

#include <algorithm>
#include <cmath>
#include <functional>

namespace fulcrum::dynamic::balance_testing {

std::vector<Placement> AllPlacements(int64_t num_layers, int num_stages) {
  // Every composition of num_layers into num_stages positive parts, in lexicographic order
  // of the stage ends (end of stage 0 first): the order NOTE [partition tie-break] uses.
  std::vector<Placement> all;
  Placement placement(num_stages);
  std::function<void(int, int64_t)> extend = [&](int stage, int64_t begin) {
    if (stage == num_stages - 1) {
      placement[stage] = {begin, num_layers};
      all.push_back(placement);
      return;
    }
    for (int64_t end = begin + 1; end <= num_layers - (num_stages - 1 - stage); ++end) {
      placement[stage] = {begin, end};
      extend(stage + 1, end);
    }
  };
  if (num_stages >= 1 && num_layers >= num_stages) extend(0, 0);
  return all;
}

Placement RandomPlacement(int64_t num_layers, int num_stages, std::mt19937_64* rng) {
  std::vector<int64_t> cuts;
  for (int64_t l = 1; l < num_layers; ++l) cuts.push_back(l);
  std::shuffle(cuts.begin(), cuts.end(), *rng);
  cuts.resize(num_stages - 1);
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(num_layers);
  Placement placement(num_stages);
  int64_t begin = 0;
  for (int s = 0; s < num_stages; ++s) {
    placement[s] = {begin, cuts[s]};
    begin = cuts[s];
  }
  return placement;
}

double LeastLargestMemory(const BalanceProblem& problem) {
  double least = kInf;
  for (const Placement& placement : AllPlacements(problem.num_layers(), problem.num_stages)) {
    double largest = 0;
    for (int s = 0; s < problem.num_stages; ++s) {
      largest = std::max(largest, StageMemory(problem, s, placement[s]));
    }
    least = std::min(least, largest);
  }
  return least;
}

double BruteForceBottleneck(const BalanceProblem& problem) {
  double best = kInf;
  for (const Placement& placement : AllPlacements(problem.num_layers(), problem.num_stages)) {
    if (FitsMemory(problem, placement)) best = std::min(best, Bottleneck(problem, placement));
  }
  return best;
}

std::vector<BalanceProblem> RandomProblems(int count, uint64_t seed) {
  // Cost shapes (problem i has shape i % 8), 1 ≤ p ≤ 6, p ≤ L ≤ 12, pinned costs on half of
  // them, and memory: none on a third, else a budget that is loose, exactly the least
  // achievable (tight), 2% above it, or just below it (infeasible).
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  auto integer = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<BalanceProblem> problems;
  for (int i = 0; i < count; ++i) {
    BalanceProblem problem;
    problem.num_stages = static_cast<int>(integer(1, 6));
    const int64_t num_layers = integer(problem.num_stages, 12);
    std::vector<double>& cost = problem.layer_cost;
    switch (i % 8) {
      case 0:  // Uniform.
        for (int64_t l = 0; l < num_layers; ++l) cost.push_back(uniform(0.5, 1.5));
        break;
      case 1:  // Small integers: many placements share the optimum.
        for (int64_t l = 0; l < num_layers; ++l) cost.push_back(static_cast<double>(integer(1, 4)));
        break;
      case 2: {  // One heavy layer.
        cost.assign(num_layers, 1.0);
        cost[integer(0, num_layers - 1)] = uniform(2.0, 3.0 * num_layers);
        break;
      }
      case 3:  // Heavy first half (MoE layers on one side).
        for (int64_t l = 0; l < num_layers; ++l) {
          cost.push_back(l < num_layers / 2 ? uniform(2.5, 4.0) : uniform(0.8, 1.2));
        }
        break;
      case 4: {  // Heavy-tailed: log-normal with σ = 1.5.
        std::lognormal_distribution<double> heavy(0.0, 1.5);
        for (int64_t l = 0; l < num_layers; ++l) cost.push_back(heavy(rng));
        break;
      }
      case 5:  // All equal.
        cost.assign(num_layers, 0.25 * static_cast<double>(integer(1, 8)));
        break;
      case 6:  // Zeros: all of them, or about half (frozen or pruned-away layers).
        for (int64_t l = 0; l < num_layers; ++l) {
          cost.push_back(i % 16 == 6 || integer(0, 1) == 0 ? 0.0 : uniform(0.5, 2.0));
        }
        break;
      default:  // Exponential.
        for (int64_t l = 0; l < num_layers; ++l) {
          cost.push_back(std::exponential_distribution<double>(1.0)(rng));
        }
        break;
    }
    if (integer(0, 1) == 1) {
      problem.first_stage_cost = uniform(0.0, 2.0);
      problem.last_stage_cost = uniform(0.0, 3.0);
    }
    const int64_t memory_kind = integer(0, 5);
    if (memory_kind >= 2) {
      for (int64_t l = 0; l < num_layers; ++l) {
        problem.layer_state_bytes.push_back(std::round(uniform(50, 150)));
        problem.layer_activation_bytes.push_back(std::round(uniform(5, 40)));
      }
      for (int s = 0; s < problem.num_stages; ++s) {
        problem.activation_multiplier.push_back(problem.num_stages - s);  // 1F1B in flight.
        problem.pinned_memory.push_back(s == 0 || s == problem.num_stages - 1 ? 120.0 : 0.0);
      }
      const double least = LeastLargestMemory(problem);
      switch (memory_kind) {
        case 2:
          problem.memory_budget = 1.5 * least;
          break;
        case 3:
          problem.memory_budget = least;
          break;
        case 4:
          problem.memory_budget = 1.02 * least;
          break;
        default:
          problem.memory_budget = std::nextafter(least, 0.0);
          break;
      }
    }
    problems.push_back(std::move(problem));
  }
  return problems;
}

}  // namespace fulcrum::dynamic::balance_testing
