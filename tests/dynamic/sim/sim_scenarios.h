// Scenarios the simulation tests build by hand: per-layer costs (F, B, W) = scale[l] ×
// (1, 1, 1), 1000 parameters and `state_bytes` of state per layer, the same every
// iteration, on a named schedule (simulation_test.cc, chunk_simulation_test.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dynamic/simulation.h"

namespace fulcrum::dynamic {

inline IterationCosts UniformKindCosts(const std::vector<double>& scale, double state_bytes) {
  IterationCosts c;
  for (double x : scale) {
    c.forward.push_back(x);
    c.backward.push_back(x);
    c.weight.push_back(x);
    c.parameters.push_back(1000);
    c.state_bytes.push_back(state_bytes);
  }
  return c;
}

/// p stages, m micro-batches, `num_chunks` model chunks per stage (1: none), `iterations`
/// iterations of UniformKindCosts(scale, state_bytes).
inline Scenario FixedCostScenario(const std::vector<double>& scale, int p, int m,
                                  const std::string& schedule, int64_t iterations,
                                  int num_chunks = 1, double state_bytes = 1e6) {
  Scenario s;
  s.name = num_chunks > 1 ? "chunks" : "test";
  s.num_stages = p;
  s.num_microbatches = m;
  s.schedule = schedule;
  s.num_chunks = num_chunks;
  s.iterations = iterations;
  s.costs = [scale, state_bytes](int64_t) { return UniformKindCosts(scale, state_bytes); };
  return s;
}

/// The strategies the tests compare: no balancer, and the two balancers by time.
inline const Strategy kUniform{"uniform", "none", BalanceBy::kTime, false};
inline const Strategy kPartition{"partition", "partition", BalanceBy::kTime, false};
inline const Strategy kDiffusion{"diffusion", "diffusion", BalanceBy::kTime, false};

}  // namespace fulcrum::dynamic
