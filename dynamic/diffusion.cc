// The Diffusion balancer; see diffusion.h and NOTE [diffusion rounds] there.
#include "dynamic/diffusion.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum::dynamic {
namespace {

// A decrease of φ smaller than this fraction of p · Σ L_u is rounding noise, not a gain.
constexpr double kRelativeTolerance = 1e-12;

// The state of one diffusion: stage s holds [bounds_[s], bounds_[s+1]).
class Diffuser {
 public:
  Diffuser(const BalanceProblem& problem, const Placement& current)
      : evaluator_(problem),
        num_stages_(problem.num_virtual_stages()),
        layer_cost_(problem.layer_cost) {
    bounds_.reserve(num_stages_ + 1);
    bounds_.push_back(0);
    for (const StageRange& range : current) bounds_.push_back(range.end);
    loads_ = evaluator_.StageCosts(current);  // Per virtual stage: NOTE [diffusion under chunks].
    potential_ = PotentialOfLoads(loads_);
    const double total = std::accumulate(loads_.begin(), loads_.end(), 0.0);
    tolerance_ = kRelativeTolerance * num_stages_ * total;
  }

  double potential() const { return potential_; }

  Placement placement() const {
    Placement placement(num_stages_);
    for (int s = 0; s < num_stages_; ++s) placement[s] = Range(s);
    return placement;
  }

  // One pass of single moves over the adjacent pairs; the number accepted.
  int SingleMoves() {
    std::vector<int> pairs(num_stages_ - 1);
    std::iota(pairs.begin(), pairs.end(), 0);
    std::vector<double> gaps(pairs.size());
    for (int u : pairs) gaps[u] = std::abs(Load(u) - Load(u + 1));
    std::stable_sort(pairs.begin(), pairs.end(), [&](int a, int b) { return gaps[a] > gaps[b]; });
    int accepted = 0;
    for (int u : pairs) {
      if (Load(u) == Load(u + 1)) continue;
      const int heavy = Load(u) > Load(u + 1) ? u : u + 1;
      const int light = heavy == u ? u + 1 : u;
      if (TryShift(heavy, light)) ++accepted;
    }
    return accepted;
  }

  // The chain move (path length ≥ 2) that lowers φ most, applied; false if none does.
  bool BestChainMove() {
    double best_potential = potential_ - tolerance_;
    int best_source = -1, best_sink = -1;
    for (int source = 0; source < num_stages_; ++source) {
      if (Range(source).size() < 2) continue;
      for (int sink = 0; sink < num_stages_; ++sink) {
        if (std::abs(sink - source) < 2 || !(Load(source) > Load(sink))) continue;
        std::vector<int64_t> bounds;
        std::vector<double> loads;
        if (!ShiftedBounds(source, sink, &bounds) || !Evaluate(bounds, source, sink, &loads)) {
          continue;
        }
        const double potential = PotentialOfLoads(loads);
        if (potential < best_potential) {
          best_potential = potential;
          best_source = source;
          best_sink = sink;
        }
      }
    }
    if (best_source < 0) return false;
    return TryShift(best_source, best_sink);
  }

 private:
  StageRange Range(int s) const { return {bounds_[s], bounds_[s + 1]}; }
  // The load of (virtual) stage s.
  double Load(int s) const { return loads_[s]; }

  // The bounds after one unit moves from `source` to `sink` along the stages between them
  // (NOTE [zero-cost layers travel with a neighbour]): every boundary on the path shifts
  // towards the source by one unit. False if a stage would be left empty or has no layer
  // that costs something to pass on.
  bool ShiftedBounds(int source, int sink, std::vector<int64_t>* bounds) const {
    *bounds = bounds_;
    std::vector<int64_t>& b = *bounds;
    if (source < sink) {
      // Stage s-1 passes its last unit to stage s: [b[s] - k, b[s]).
      for (int s = source + 1; s <= sink; ++s) {
        int64_t k = 1;
        while (b[s] - k > b[s - 1] && layer_cost_[b[s] - k] == 0) ++k;
        if (b[s] - k <= b[s - 1]) return false;
        b[s] -= k;
      }
    } else {
      // Stage s passes its first unit to stage s-1: [b[s], b[s] + k).
      for (int s = source; s > sink; --s) {
        int64_t k = 1;
        while (b[s] + k < b[s + 1] && layer_cost_[b[s] + k - 1] == 0) ++k;
        if (b[s] + k >= b[s + 1]) return false;
        b[s] += k;
      }
    }
    return true;
  }

  // The loads under `bounds` (which differ from bounds_ only between source and sink);
  // false if a stage on the path other than the source would go over the memory budget
  // while gaining memory (the source only loses layers).
  bool Evaluate(const std::vector<int64_t>& bounds, int source, int sink,
                std::vector<double>* loads) const {
    if (evaluator_.has_chunks()) return EvaluateChunks(bounds, loads);
    *loads = loads_;
    for (int s = std::min(source, sink); s <= std::max(source, sink); ++s) {
      const StageRange range{bounds[s], bounds[s + 1]};
      (*loads)[s] = evaluator_.StageCost(s, range);
      if (s == source || evaluator_.Fits(s, range)) continue;
      if (evaluator_.StageMemory(s, range) > evaluator_.StageMemory(s, Range(s))) return false;
    }
    return true;
  }

  // Evaluate with chunks: the virtual stages' loads; false if a rank whose memory grows
  // would go over the budget (a rank's chunks may lie on and off the path).
  bool EvaluateChunks(const std::vector<int64_t>& bounds, std::vector<double>* loads) const {
    Placement next(num_stages_);
    for (int s = 0; s < num_stages_; ++s) next[s] = {bounds[s], bounds[s + 1]};
    const std::vector<double> before = evaluator_.RankMemories(placement());
    const std::vector<double> after = evaluator_.RankMemories(next);
    for (size_t r = 0; r < after.size(); ++r) {
      if (after[r] > before[r] && !(after[r] <= evaluator_.memory_budget())) return false;
    }
    *loads = evaluator_.StageCosts(next);
    return true;
  }

  // Moves one unit from `source` to `sink` (a single move when they are neighbours) if
  // every stage keeps a layer, memory allows it and φ strictly falls.
  bool TryShift(int source, int sink) {
    std::vector<int64_t> bounds;
    std::vector<double> loads;
    if (!ShiftedBounds(source, sink, &bounds) || !Evaluate(bounds, source, sink, &loads)) {
      return false;
    }
    const double potential = PotentialOfLoads(loads);
    if (!(potential < potential_ - tolerance_)) return false;
    bounds_ = std::move(bounds);
    loads_ = std::move(loads);
    potential_ = potential;
    return true;
  }

  StageEvaluator evaluator_;
  int num_stages_ = 0;
  std::vector<double> layer_cost_;
  std::vector<int64_t> bounds_;  // p·v + 1 entries: 0, end of (virtual) stage 0, ..., L.
  std::vector<double> loads_;    // Every (virtual) stage's cost (StageCosts).
  double potential_ = 0;         // PotentialOfLoads(loads_).
  double tolerance_ = 0;
};

}  // namespace

absl::StatusOr<DiffusionResult> DiffusionBalance(const BalanceProblem& problem,
                                                 const Placement& current,
                                                 const DiffusionOptions& options) {
  if (absl::Status s = ValidateProblem(problem); !s.ok()) return s;
  if (absl::Status s = CheckEnoughLayers(problem); !s.ok()) return s;
  if (absl::Status s = ValidatePlacement(problem, current); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("DiffusionBalance: the current placement is invalid: ", s.message()));
  }
  if (options.max_rounds < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("DiffusionOptions.max_rounds is %d; expected ≥ 0", options.max_rounds));
  }
  Diffuser diffuser(problem, current);
  DiffusionResult result;
  result.potential_per_round.push_back(diffuser.potential());
  for (int round = 0; round < options.max_rounds; ++round) {
    int accepted = diffuser.SingleMoves();
    if (accepted == 0 && diffuser.BestChainMove()) accepted = 1;
    if (accepted == 0) break;
    ++result.rounds;
    result.moves += accepted;
    result.potential_per_round.push_back(diffuser.potential());
  }
  result.placement = diffuser.placement();
  return result;
}

}  // namespace fulcrum::dynamic
