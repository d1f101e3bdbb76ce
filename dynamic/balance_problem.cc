// The balance problem's checks and measures; see balance_problem.h.
#include "dynamic/balance_problem.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fulcrum::dynamic {
namespace {

// OK when `values` has `expected` entries (or none, when `may_be_empty`), each finite ≥ 0.
absl::Status CheckVector(const char* field, const std::vector<double>& values, int64_t expected,
                         const char* what_expected, bool may_be_empty) {
  const auto size = static_cast<int64_t>(values.size());
  if (size != expected && !(may_be_empty && size == 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("BalanceProblem.%s has %d entries; expected %s (%d)%s", field, size,
                        what_expected, expected, may_be_empty ? " or none" : ""));
  }
  for (int64_t i = 0; i < size; ++i) {
    if (!std::isfinite(values[i]) || values[i] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "BalanceProblem.%s[%d] is %g; expected a finite value ≥ 0", field, i, values[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckScalar(const char* field, double value) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("BalanceProblem.%s is %g; expected a finite value ≥ 0", field, value));
  }
  return absl::OkStatus();
}

// prefix[i] = Σ_{l<i} values[l], accumulated left to right; all zeros when `values` is empty.
std::vector<double> PrefixSums(const std::vector<double>& values, int64_t num_layers) {
  std::vector<double> prefix(num_layers + 1, 0.0);
  if (values.empty()) return prefix;
  for (int64_t l = 0; l < num_layers; ++l) prefix[l + 1] = prefix[l] + values[l];
  return prefix;
}

// Owner stage of every layer in [0, num_layers); -1 where no stage holds it.
std::vector<int> Owners(const Placement& placement, int64_t num_layers) {
  std::vector<int> owner(num_layers, -1);
  for (size_t s = 0; s < placement.size(); ++s) {
    const int64_t begin = std::max<int64_t>(placement[s].begin, 0);
    const int64_t end = std::min(placement[s].end, num_layers);
    for (int64_t l = begin; l < end; ++l) owner[l] = static_cast<int>(s);
  }
  return owner;
}

int64_t CoveredEnd(const Placement& placement) {
  int64_t end = 0;
  for (const StageRange& range : placement) end = std::max(end, range.end);
  return end;
}

}  // namespace

absl::Status ValidateProblem(const BalanceProblem& problem) {
  if (problem.num_stages < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BalanceProblem.num_stages is %d; expected at least 1", problem.num_stages));
  }
  const int64_t num_layers = problem.num_layers();
  const int64_t num_stages = problem.num_stages;
  if (absl::Status s = CheckVector("layer_cost", problem.layer_cost, num_layers, "one per layer",
                                   /*may_be_empty=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckScalar("first_stage_cost", problem.first_stage_cost); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckScalar("last_stage_cost", problem.last_stage_cost); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckVector("layer_state_bytes", problem.layer_state_bytes, num_layers,
                                   "one per layer of layer_cost", /*may_be_empty=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          CheckVector("layer_activation_bytes", problem.layer_activation_bytes, num_layers,
                      "one per layer of layer_cost", /*may_be_empty=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckVector("activation_multiplier", problem.activation_multiplier,
                                   num_stages, "one per stage (num_stages)", /*may_be_empty=*/true);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckVector("pinned_memory", problem.pinned_memory, num_stages,
                                   "one per stage (num_stages)", /*may_be_empty=*/true);
      !s.ok()) {
    return s;
  }
  if (!problem.chunk_rank.empty()) {
    std::vector<int> chunks_of(problem.num_stages, 0);
    for (size_t k = 0; k < problem.chunk_rank.size(); ++k) {
      const int rank = problem.chunk_rank[k];
      if (rank < 0 || rank >= problem.num_stages) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "BalanceProblem.chunk_rank[%d] is %d; expected a rank in 0..%d (num_stages %d)", k,
            rank, problem.num_stages - 1, problem.num_stages));
      }
      ++chunks_of[rank];
    }
    for (int r = 0; r < problem.num_stages; ++r) {
      if (chunks_of[r] == 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "BalanceProblem.chunk_rank gives rank %d no chunk; every rank holds at least one", r));
      }
    }
  }
  if (std::isnan(problem.memory_budget) || problem.memory_budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("BalanceProblem.memory_budget is %g; expected a value ≥ 0 (or "
                        "infinity for no limit)",
                        problem.memory_budget));
  }
  return absl::OkStatus();
}

absl::Status CheckEnoughLayers(const BalanceProblem& problem) {
  if (!problem.chunk_rank.empty() && problem.num_layers() < problem.num_virtual_stages()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d layers cannot fill %d virtual pipeline stages (%d chunks on %d pipeline stages; "
        "each chunk needs at least one layer)",
        problem.num_layers(), problem.num_virtual_stages(), problem.num_virtual_stages(),
        problem.num_stages));
  }
  if (problem.num_layers() < problem.num_stages) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d layers cannot fill %d pipeline stages (each stage needs at least one layer)",
        problem.num_layers(), problem.num_stages));
  }
  return absl::OkStatus();
}

absl::Status ValidatePlacement(const BalanceProblem& problem, const Placement& placement) {
  const int64_t num_layers = problem.num_layers();
  if (static_cast<int64_t>(placement.size()) != problem.num_virtual_stages()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "placement %s has %d stage ranges; expected one per %s (%d)", FormatPlacement(placement),
        placement.size(), problem.chunk_rank.empty() ? "stage" : "virtual stage",
        problem.num_virtual_stages()));
  }
  int64_t expected_begin = 0;
  for (size_t s = 0; s < placement.size(); ++s) {
    const StageRange& range = placement[s];
    if (range.begin != expected_begin) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "placement %s: stage %d begins at layer %d; expected %d (contiguous, in order, "
          "from layer 0)",
          FormatPlacement(placement), s, range.begin, expected_begin));
    }
    if (range.end <= range.begin) {
      return absl::InvalidArgumentError(
          absl::StrFormat("placement %s: stage %d is empty ([%d,%d)); every stage needs at "
                          "least one layer",
                          FormatPlacement(placement), s, range.begin, range.end));
    }
    expected_begin = range.end;
  }
  if (expected_begin != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("placement %s ends at layer %d; expected it to cover all %d layers",
                        FormatPlacement(placement), expected_begin, num_layers));
  }
  return absl::OkStatus();
}

std::vector<int> InterleavedChunkRanks(int num_stages, int num_chunks) {
  std::vector<int> ranks;
  for (int k = 0; k < num_stages * num_chunks; ++k) ranks.push_back(k % num_stages);
  return ranks;
}

std::vector<int> VShapeChunkRanks(int num_stages) {
  std::vector<int> ranks;
  for (int k = 0; k < 2 * num_stages; ++k) {
    ranks.push_back(k < num_stages ? k : 2 * num_stages - 1 - k);
  }
  return ranks;
}

Placement UniformPlacement(int64_t num_layers, int num_stages) {
  Placement placement(std::max(num_stages, 0));
  if (num_stages <= 0) return placement;
  const int64_t base = num_layers / num_stages;
  const int64_t extra = num_layers % num_stages;
  int64_t begin = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int64_t size = base + (s < extra ? 1 : 0);
    placement[s] = {begin, begin + size};
    begin += size;
  }
  return placement;
}

StageEvaluator::StageEvaluator(const BalanceProblem& problem)
    : num_stages_(problem.num_stages),
      // An identity chunk_rank is one chunk per rank: the one-chunk formulas, bit for bit.
      has_chunks_(!problem.chunk_rank.empty() &&
                  problem.chunk_rank != InterleavedChunkRanks(problem.num_stages, 1)),
      chunk_rank_(problem.chunk_rank),
      first_stage_cost_(problem.first_stage_cost),
      last_stage_cost_(problem.last_stage_cost),
      memory_budget_(problem.memory_budget),
      cost_prefix_(PrefixSums(problem.layer_cost, problem.num_layers())),
      state_prefix_(PrefixSums(problem.layer_state_bytes, problem.num_layers())),
      activation_prefix_(PrefixSums(problem.layer_activation_bytes, problem.num_layers())),
      multiplier_(problem.activation_multiplier),
      pinned_memory_(problem.pinned_memory) {
  const auto p = static_cast<size_t>(std::max(num_stages_, 0));
  if (multiplier_.empty()) multiplier_.assign(p, 1.0);
  if (pinned_memory_.empty()) pinned_memory_.assign(p, 0.0);
  if (chunk_rank_.empty()) {
    for (int s = 0; s < num_stages_; ++s) chunk_rank_.push_back(s);
  }
}

double StageEvaluator::StageCost(int stage, StageRange range) const {
  double pinned = 0;
  if (stage == 0) pinned += first_stage_cost_;
  if (stage == num_virtual_stages() - 1) pinned += last_stage_cost_;
  return (cost_prefix_[range.end] - cost_prefix_[range.begin]) + pinned;
}

double StageEvaluator::StageMemory(int stage, StageRange range) const {
  const double state = state_prefix_[range.end] - state_prefix_[range.begin];
  const double activations = activation_prefix_[range.end] - activation_prefix_[range.begin];
  return pinned_memory_[stage] + state + multiplier_[stage] * activations;
}

bool StageEvaluator::Fits(int stage, StageRange range) const {
  return StageMemory(stage, range) <= memory_budget_;
}

std::vector<double> StageEvaluator::StageCosts(const Placement& placement) const {
  std::vector<double> costs(placement.size());
  for (size_t s = 0; s < placement.size(); ++s) {
    costs[s] = StageCost(static_cast<int>(s), placement[s]);
  }
  return costs;
}

double StageEvaluator::ChunkMemory(int virtual_stage, StageRange range) const {
  const double state = state_prefix_[range.end] - state_prefix_[range.begin];
  const double activations = activation_prefix_[range.end] - activation_prefix_[range.begin];
  return state + multiplier_[RankOf(virtual_stage)] * activations;
}

std::vector<double> StageEvaluator::RankCosts(const Placement& placement) const {
  if (!has_chunks_) return StageCosts(placement);
  // NOTE [chunks]: from 0 (0 + c is c exactly), the chunks added in ascending order.
  std::vector<double> costs(num_stages_, 0.0);
  for (size_t k = 0; k < placement.size(); ++k) {
    costs[RankOf(static_cast<int>(k))] += StageCost(static_cast<int>(k), placement[k]);
  }
  return costs;
}

std::vector<double> StageEvaluator::RankMemories(const Placement& placement) const {
  std::vector<double> memory(num_stages_, 0.0);
  if (!has_chunks_) {
    for (size_t s = 0; s < placement.size(); ++s) {
      memory[s] = StageMemory(static_cast<int>(s), placement[s]);
    }
    return memory;
  }
  memory = pinned_memory_;
  for (size_t k = 0; k < placement.size(); ++k) {
    memory[RankOf(static_cast<int>(k))] += ChunkMemory(static_cast<int>(k), placement[k]);
  }
  return memory;
}

double StageEvaluator::Bottleneck(const Placement& placement) const {
  const std::vector<double> costs = RankCosts(placement);
  return costs.empty() ? 0.0 : *std::max_element(costs.begin(), costs.end());
}

bool StageEvaluator::FitsMemory(const Placement& placement) const {
  for (double memory : RankMemories(placement)) {
    if (!(memory <= memory_budget_)) return false;
  }
  return true;
}

double StageCost(const BalanceProblem& problem, int stage, StageRange range) {
  return StageEvaluator(problem).StageCost(stage, range);
}

double StageMemory(const BalanceProblem& problem, int stage, StageRange range) {
  return StageEvaluator(problem).StageMemory(stage, range);
}

std::vector<double> StageCosts(const BalanceProblem& problem, const Placement& placement) {
  return StageEvaluator(problem).StageCosts(placement);
}

std::vector<double> RankCosts(const BalanceProblem& problem, const Placement& placement) {
  return StageEvaluator(problem).RankCosts(placement);
}

std::vector<double> RankMemories(const BalanceProblem& problem, const Placement& placement) {
  return StageEvaluator(problem).RankMemories(placement);
}

double Bottleneck(const BalanceProblem& problem, const Placement& placement) {
  return StageEvaluator(problem).Bottleneck(placement);
}

double LargestChunk(const BalanceProblem& problem, const Placement& placement) {
  const std::vector<double> costs = StageCosts(problem, placement);
  return costs.empty() ? 0.0 : *std::max_element(costs.begin(), costs.end());
}

bool IsVShape(const BalanceProblem& problem) {
  const int p = problem.num_stages;
  if (problem.chunk_rank.size() != 2 * static_cast<size_t>(p)) return false;
  for (int k = 0; k < 2 * p; ++k) {
    if (problem.chunk_rank[k] != (k < p ? k : 2 * p - 1 - k)) return false;
  }
  return true;
}

double Imbalance(const BalanceProblem& problem, const Placement& placement) {
  const std::vector<double> costs = RankCosts(problem, placement);
  if (costs.empty()) return 0.0;
  double total = 0;
  for (double c : costs) total += c;
  const double mean = total / static_cast<double>(costs.size());
  if (mean == 0) return 0.0;
  const auto [min, max] = std::minmax_element(costs.begin(), costs.end());
  return (*max - *min) / mean;
}

double PotentialOfLoads(std::vector<double> loads) {
  // With the loads sorted, the gap between the k-th and (k+1)-th smallest lies between
  // k · (n − k) pairs, so Σ_{u<v} |L_u − L_v| = Σ_k k (n − k) (L_(k) − L_(k−1)). Every term
  // is ≥ 0 (equal loads give exactly 0), and sorting first makes the value independent of
  // the stages' order (NOTE [bit-equal stage costs]).
  std::sort(loads.begin(), loads.end());
  const auto n = static_cast<int64_t>(loads.size());
  double potential = 0;
  for (int64_t k = 1; k < n; ++k) {
    potential += static_cast<double>(k * (n - k)) * (loads[k] - loads[k - 1]);
  }
  return potential;
}

double Potential(const BalanceProblem& problem, const Placement& placement) {
  return PotentialOfLoads(RankCosts(problem, placement));
}

bool FitsMemory(const BalanceProblem& problem, const Placement& placement) {
  const StageEvaluator evaluator(problem);
  if (!evaluator.has_chunks()) {
    for (size_t s = 0; s < placement.size(); ++s) {
      if (!evaluator.Fits(static_cast<int>(s), placement[s])) return false;
    }
    return true;
  }
  return evaluator.FitsMemory(placement);
}

std::string FormatPlacement(const Placement& placement) {
  return absl::StrJoin(placement, " ", [](std::string* out, const StageRange& range) {
    absl::StrAppend(out, "[", range.begin, ",", range.end, ")");
  });
}

int64_t LayersMoved(const Placement& from, const Placement& to) {
  const int64_t num_layers = std::max(CoveredEnd(from), CoveredEnd(to));
  const std::vector<int> from_owner = Owners(from, num_layers);
  const std::vector<int> to_owner = Owners(to, num_layers);
  int64_t moved = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    if (from_owner[l] != to_owner[l]) ++moved;
  }
  return moved;
}

}  // namespace fulcrum::dynamic
