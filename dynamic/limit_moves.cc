// A cap on the layers one rebalancing migrates; see limit_moves.h, NOTE [limited moves].
#include "dynamic/limit_moves.h"

#include <algorithm>
#include <vector>

namespace fulcrum::dynamic {
namespace {

// Stage s holds [bounds[s], bounds[s+1]).
std::vector<int64_t> BoundsOf(const Placement& placement) {
  std::vector<int64_t> bounds;
  bounds.reserve(placement.size() + 1);
  bounds.push_back(0);
  for (const StageRange& range : placement) bounds.push_back(range.end);
  return bounds;
}

Placement PlacementOfBounds(const std::vector<int64_t>& bounds) {
  Placement placement(bounds.size() - 1);
  for (size_t s = 0; s + 1 < bounds.size(); ++s) placement[s] = {bounds[s], bounds[s + 1]};
  return placement;
}

// The walk of NOTE [limited moves].
class Walk {
 public:
  Walk(const BalanceProblem& problem, const Placement& current, const Placement& target)
      : evaluator_(problem),
        num_stages_(problem.num_virtual_stages()),
        bounds_(BoundsOf(current)),
        target_(BoundsOf(target)),
        owner_at_start_(problem.num_layers(), 0) {
    for (int s = 0; s < num_stages_; ++s) {
      for (int64_t l = current[s].begin; l < current[s].end; ++l) owner_at_start_[l] = s;
    }
  }

  const std::vector<int64_t>& bounds() const { return bounds_; }

  bool Fits() const { return FitsWith(bounds_); }

  // Takes the best allowed shift (NOTE [limited moves]); false when none is allowed.
  bool Step(int64_t max_moves, bool prefer_fitting) {
    int best = -1;
    bool best_fits = false;
    double best_bottleneck = 0;
    int64_t best_moved = 0;
    for (int k = 1; k < num_stages_; ++k) {
      if (bounds_[k] == target_[k]) continue;
      const bool right = target_[k] > bounds_[k];
      const int64_t moved_to = bounds_[k] + (right ? 1 : -1);
      if (moved_to <= bounds_[k - 1] || moved_to >= bounds_[k + 1]) continue;  // Empty stage.
      // The layer that changes stage: the first of stage k (to k-1), or the last of k-1.
      const int64_t layer = right ? bounds_[k] : bounds_[k] - 1;
      const int from = right ? k : k - 1;
      const int to = right ? k - 1 : k;
      const int64_t moved = moved_ + (to != owner_at_start_[layer] ? 1 : 0) -
                            (from != owner_at_start_[layer] ? 1 : 0);
      if (moved > max_moves) continue;
      std::vector<int64_t> bounds = bounds_;
      bounds[k] = moved_to;
      const bool fits = prefer_fitting && FitsWith(bounds);
      const double bottleneck = BottleneckWith(bounds);
      // Fitting first (when preferred), then the smallest bottleneck, then the lowest k.
      if (best < 0 || (fits && !best_fits) || (fits == best_fits && bottleneck < best_bottleneck)) {
        best = k;
        best_fits = fits;
        best_bottleneck = bottleneck;
        best_moved = moved;
      }
    }
    if (best < 0) return false;
    bounds_[best] += target_[best] > bounds_[best] ? 1 : -1;
    moved_ = best_moved;
    return true;
  }

 private:
  static StageRange Range(const std::vector<int64_t>& bounds, int s) {
    return {bounds[s], bounds[s + 1]};
  }

  // With chunks, over ranks (NOTE [chunks] in balance_problem.h); moves count layers that
  // change virtual stage.
  double BottleneckWith(const std::vector<int64_t>& bounds) const {
    if (evaluator_.has_chunks()) return evaluator_.Bottleneck(PlacementOfBounds(bounds));
    double bottleneck = 0;
    for (int s = 0; s < num_stages_; ++s) {
      bottleneck = std::max(bottleneck, evaluator_.StageCost(s, Range(bounds, s)));
    }
    return bottleneck;
  }

  bool FitsWith(const std::vector<int64_t>& bounds) const {
    if (evaluator_.has_chunks()) return evaluator_.FitsMemory(PlacementOfBounds(bounds));
    for (int s = 0; s < num_stages_; ++s) {
      if (!evaluator_.Fits(s, Range(bounds, s))) return false;
    }
    return true;
  }

  StageEvaluator evaluator_;
  int num_stages_ = 0;
  std::vector<int64_t> bounds_;  // p + 1 entries: 0, end of stage 0, ..., L.
  std::vector<int64_t> target_;
  std::vector<int> owner_at_start_;  // Per layer: its stage in `current`.
  int64_t moved_ = 0;                // LayersMoved(current, bounds_).
};

}  // namespace

Placement LimitMoves(const BalanceProblem& problem, const Placement& current,
                     const Placement& target, int64_t max_moves) {
  if (max_moves <= 0 || LayersMoved(current, target) <= max_moves) return target;
  const bool target_fits = FitsMemory(problem, target);
  Walk walk(problem, current, target);
  std::vector<int64_t> last_fitting = BoundsOf(current);
  while (walk.Step(max_moves, /*prefer_fitting=*/target_fits)) {
    if (target_fits && walk.Fits()) last_fitting = walk.bounds();
  }
  return PlacementOfBounds(target_fits ? last_fitting : walk.bounds());
}

}  // namespace fulcrum::dynamic
