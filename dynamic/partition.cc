// The Partition balancer; see partition.h.
#include "dynamic/partition.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum::dynamic {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kNoPlacement = std::numeric_limits<int64_t>::max();

// Stage s (of p) may end at layer e only if the s stages before it and the p-1-s after it
// each get a layer: s + 1 ≤ e ≤ L − (p − 1 − s).
int64_t MinEnd(int stage) { return stage + 1; }
int64_t MaxEnd(int stage, int num_stages, int64_t num_layers) {
  return num_layers - (num_stages - 1 - stage);
}

// min over placements of max_s value(s, range_s), over placements whose every range is
// allowed(s, range); +infinity when none is. A DP over (stage, end of that stage):
// best[s][e] is the optimum for stages 0..s covering layers [0, e).
template <typename Value, typename Allowed>
double MinMaxOverPlacements(int num_stages, int64_t num_layers, const Value& value,
                            const Allowed& allowed) {
  const int64_t width = num_layers + 1;
  std::vector<double> best(static_cast<size_t>(num_stages) * width, kInf);
  auto at = [&](int s, int64_t e) -> double& { return best[s * width + e]; };
  for (int64_t e = MinEnd(0); e <= MaxEnd(0, num_stages, num_layers); ++e) {
    const StageRange range{0, e};
    if (allowed(0, range)) at(0, e) = value(0, range);
  }
  for (int s = 1; s < num_stages; ++s) {
    for (int64_t e = MinEnd(s); e <= MaxEnd(s, num_stages, num_layers); ++e) {
      double here = kInf;
      for (int64_t b = MinEnd(s - 1); b < e; ++b) {
        const double before = at(s - 1, b);
        if (before == kInf) continue;
        const StageRange range{b, e};
        if (!allowed(s, range)) continue;
        here = std::min(here, std::max(before, value(s, range)));
      }
      at(s, e) = here;
    }
  }
  return at(num_stages - 1, num_layers);
}

// Layers of `range` that `reference_range` (the same stage's range before) does not hold.
int64_t Arrivals(StageRange range, StageRange reference_range) {
  const int64_t overlap = std::max<int64_t>(
      0, std::min(range.end, reference_range.end) - std::max(range.begin, reference_range.begin));
  return range.size() - overlap;
}

// Among the placements whose every stage costs ≤ bottleneck and fits the memory budget,
// the one that moves the fewest layers from `reference`, then the lexicographically
// smallest stage ends (NOTE [partition tie-break]). A suffix DP: arrivals[s][b] is the
// fewest layers arriving on stages s..p-1 when they cover [b, L); the forward walk then
// takes the smallest end that keeps to the optimum.
Placement FewestMovesWithin(const StageEvaluator& evaluator, double bottleneck,
                            const Placement& reference) {
  const int num_stages = evaluator.num_stages();
  const int64_t num_layers = evaluator.num_layers();
  const int64_t width = num_layers + 1;
  std::vector<int64_t> fewest(static_cast<size_t>(num_stages + 1) * width, kNoPlacement);
  auto at = [&](int s, int64_t b) -> int64_t& { return fewest[s * width + b]; };
  auto allowed = [&](int s, StageRange range) {
    return evaluator.StageCost(s, range) <= bottleneck && evaluator.Fits(s, range);
  };
  at(num_stages, num_layers) = 0;
  for (int s = num_stages - 1; s >= 0; --s) {
    // Stage s begins where stage s-1 may end (0 for stage 0).
    const int64_t min_begin = s == 0 ? 0 : MinEnd(s - 1);
    const int64_t max_begin = s == 0 ? 0 : MaxEnd(s - 1, num_stages, num_layers);
    for (int64_t b = min_begin; b <= max_begin; ++b) {
      int64_t here = kNoPlacement;
      for (int64_t e = std::max(b + 1, MinEnd(s)); e <= MaxEnd(s, num_stages, num_layers); ++e) {
        const int64_t after = at(s + 1, e);
        if (after == kNoPlacement) continue;
        const StageRange range{b, e};
        if (!allowed(s, range)) continue;
        here = std::min(here, after + Arrivals(range, reference[s]));
      }
      at(s, b) = here;
    }
  }
  Placement placement(num_stages);
  int64_t begin = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int64_t target = at(s, begin);
    for (int64_t e = std::max(begin + 1, MinEnd(s)); e <= MaxEnd(s, num_stages, num_layers); ++e) {
      const int64_t after = at(s + 1, e);
      const StageRange range{begin, e};
      if (after != kNoPlacement && allowed(s, range) &&
          after + Arrivals(range, reference[s]) == target) {
        placement[s] = range;
        break;
      }
    }
    begin = placement[s].end;
  }
  return placement;
}

}  // namespace

absl::StatusOr<Placement> PartitionBalance(const BalanceProblem& problem,
                                           const Placement* current) {
  if (absl::Status s = ValidateProblem(problem); !s.ok()) return s;
  if (absl::Status s = CheckEnoughLayers(problem); !s.ok()) return s;
  if (current != nullptr) {
    if (absl::Status s = ValidatePlacement(problem, *current); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("PartitionBalance: the current placement is invalid: ", s.message()));
    }
  }
  const int num_stages = problem.num_stages;
  const int64_t num_layers = problem.num_layers();
  const StageEvaluator evaluator(problem);

  const double bottleneck = MinMaxOverPlacements(
      num_stages, num_layers,
      [&](int s, StageRange range) { return evaluator.StageCost(s, range); },
      [&](int s, StageRange range) { return evaluator.Fits(s, range); });
  if (bottleneck == kInf) {
    const double least_memory = MinMaxOverPlacements(
        num_stages, num_layers,
        [&](int s, StageRange range) { return evaluator.StageMemory(s, range); },
        [](int, StageRange) { return true; });
    return absl::ResourceExhaustedError(absl::StrFormat(
        "no placement of %d layers on %d pipeline stages fits the memory budget of %.10g "
        "bytes per stage: the smallest achievable largest stage memory is %.10g bytes",
        num_layers, num_stages, problem.memory_budget, least_memory));
  }
  const Placement reference =
      current != nullptr ? *current : UniformPlacement(num_layers, num_stages);
  return FewestMovesWithin(evaluator, bottleneck, reference);
}

}  // namespace fulcrum::dynamic
