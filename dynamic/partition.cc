// The Partition balancer; see partition.h.
#include "dynamic/partition.h"

#include <algorithm>
#include <cmath>
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


// ---- NOTE [partition under chunks] ----

// What a chunked placement costs against the reference: layers that arrive on a rank that
// did not hold them (a transfer between ranks) weigh L+1, layers that only change chunk on
// their rank (a local move) weigh 1, so fewer transfers always win and local moves break
// the ties. Additive over virtual stages.
class MoveCounter {
 public:
  MoveCounter(const StageEvaluator& evaluator, const Placement& reference)
      : evaluator_(evaluator), reference_(reference), num_layers_(evaluator.num_layers()) {
    rank_of_layer_.assign(num_layers_, -1);
    for (size_t k = 0; k < reference.size(); ++k) {
      for (int64_t l = reference[k].begin; l < reference[k].end; ++l) {
        rank_of_layer_[l] = evaluator.RankOf(static_cast<int>(k));
      }
    }
    // rank_prefix_[r][l]: layers < l that rank r holds in the reference.
    rank_prefix_.assign(evaluator.num_stages(), std::vector<int64_t>(num_layers_ + 1, 0));
    for (int r = 0; r < evaluator.num_stages(); ++r) {
      for (int64_t l = 0; l < num_layers_; ++l) {
        rank_prefix_[r][l + 1] = rank_prefix_[r][l] + (rank_of_layer_[l] == r ? 1 : 0);
      }
    }
  }

  int64_t Cost(int virtual_stage, StageRange range) const {
    const int rank = evaluator_.RankOf(virtual_stage);
    const int64_t kept_on_rank = rank_prefix_[rank][range.end] - rank_prefix_[rank][range.begin];
    const int64_t transfers = range.size() - kept_on_rank;
    const int64_t local = Arrivals(range, reference_[virtual_stage]);
    return transfers * (num_layers_ + 1) + local;
  }

 private:
  const StageEvaluator& evaluator_;
  const Placement& reference_;
  int64_t num_layers_ = 0;
  std::vector<int> rank_of_layer_;
  std::vector<std::vector<int64_t>> rank_prefix_;
};

// The V shape (ZB-V): rank r holds virtual r and 2p−1−r. Placing the ranks from the outside
// in, rank r takes the next range from the front ([i, i')) and the next from the back
// ([j', j)); what is left, [i', j'), goes to ranks r+1..p−1, and the last rank splits its
// [i, j) at x into virtual p−1 and p. So the state after ranks 0..r−1 is (i, j): the DP is
// exact, O(p·L²) states with O(L²) choices each.
class VShapeDp {
 public:
  explicit VShapeDp(const StageEvaluator& evaluator)
      : p_(evaluator.num_stages()),
        num_layers_(evaluator.num_layers()),
        width_(num_layers_ + 1) {}

  // Rank r's value from its two chunks (front range, back range), and whether allowed.
  // `value(r, front_k, front, back_k, back)`.
  template <typename Value, typename Allowed>
  double MinMax(const Value& value, const Allowed& allowed) const {
    std::vector<double> best(static_cast<size_t>(p_) * width_ * width_, kInf);
    auto at = [&](int r, int64_t i, int64_t j) -> double& {
      return best[(static_cast<size_t>(r) * width_ + i) * width_ + j];
    };
    at(0, 0, num_layers_) = -kInf;
    double answer = kInf;
    for (int r = 0; r < p_; ++r) {
      const int front = r, back = 2 * p_ - 1 - r;
      for (int64_t i = r; i <= num_layers_; ++i) {
        for (int64_t j = i + 2 * (p_ - r); j <= num_layers_ - r; ++j) {
          const double before = at(r, i, j);
          if (before == kInf) continue;
          if (r == p_ - 1) {
            for (int64_t x = i + 1; x < j; ++x) {
              const StageRange a{i, x}, b{x, j};
              if (!allowed(r, front, a, back, b)) continue;
              answer = std::min(answer, std::max(before, value(r, front, a, back, b)));
            }
            continue;
          }
          const int64_t rest = 2 * (p_ - r - 1);  // Virtual stages left inside.
          for (int64_t i2 = i + 1; i2 + rest < j; ++i2) {
            for (int64_t j2 = j - 1; j2 - i2 >= rest; --j2) {
              const StageRange a{i, i2}, b{j2, j};
              if (!allowed(r, front, a, back, b)) continue;
              double& next = at(r + 1, i2, j2);
              next = std::min(next, std::max(before, value(r, front, a, back, b)));
            }
          }
        }
      }
    }
    return answer;
  }

  // Among placements whose every rank is allowed, the one with the least MoveCounter cost;
  // ties: the smallest end of virtual r, then the smallest begin of virtual 2p−1−r, rank by
  // rank from the outside in (NOTE [partition under chunks]). Requires one to exist.
  template <typename Allowed>
  Placement FewestMoves(const Allowed& allowed, const MoveCounter& moves) const {
    std::vector<int64_t> fewest(static_cast<size_t>(p_) * width_ * width_, kNoPlacement);
    auto at = [&](int r, int64_t i, int64_t j) -> int64_t& {
      return fewest[(static_cast<size_t>(r) * width_ + i) * width_ + j];
    };
    // Rank r's choices from state (i, j), each with its cost; `visit(a, b, i2, j2, cost)`.
    auto choices = [&](int r, int64_t i, int64_t j, const auto& visit) {
      const int front = r, back = 2 * p_ - 1 - r;
      if (r == p_ - 1) {
        for (int64_t x = i + 1; x < j; ++x) {
          const StageRange a{i, x}, b{x, j};
          if (!allowed(r, front, a, back, b)) continue;
          if (visit(a, b, x, x, moves.Cost(front, a) + moves.Cost(back, b))) return;
        }
        return;
      }
      const int64_t rest = 2 * (p_ - r - 1);
      for (int64_t i2 = i + 1; i2 + rest < j; ++i2) {
        for (int64_t j2 = i2 + rest; j2 < j; ++j2) {
          const StageRange a{i, i2}, b{j2, j};
          if (!allowed(r, front, a, back, b)) continue;
          const int64_t after = r + 1 < p_ ? at(r + 1, i2, j2) : 0;
          if (after == kNoPlacement) continue;
          if (visit(a, b, i2, j2, after + moves.Cost(front, a) + moves.Cost(back, b))) return;
        }
      }
    };
    for (int r = p_ - 1; r >= 0; --r) {
      for (int64_t i = r; i <= num_layers_; ++i) {
        for (int64_t j = i + 2 * (p_ - r); j <= num_layers_ - r; ++j) {
          int64_t here = kNoPlacement;
          choices(r, i, j, [&](StageRange, StageRange, int64_t, int64_t, int64_t cost) {
            here = std::min(here, cost);
            return false;
          });
          at(r, i, j) = here;
        }
      }
    }
    Placement placement(2 * p_);
    int64_t i = 0, j = num_layers_;
    for (int r = 0; r < p_; ++r) {
      const int64_t target = at(r, i, j);
      int64_t next_i = i, next_j = j;
      choices(r, i, j, [&](StageRange a, StageRange b, int64_t i2, int64_t j2, int64_t cost) {
        if (cost != target) return false;
        placement[r] = a;
        placement[2 * p_ - 1 - r] = b;
        next_i = i2;
        next_j = j2;
        return true;
      });
      i = next_i;
      j = next_j;
    }
    return placement;
  }

 private:
  int p_ = 0;
  int64_t num_layers_ = 0;
  int64_t width_ = 0;
};

// Any other chunk→rank map (interleaved): an exact depth-first branch and bound over the
// virtual stages in model order, each taking every end in turn. Rank totals only grow as
// chunks are added (every term is ≥ 0), so a partial placement whose rank already reaches
// the incumbent's value, or whose rank memory exceeds the budget, is cut, and so is every
// longer range of that chunk. Exact when it finishes; a search cut at kMaxNodes keeps the
// best placement found (see PartitionBalance: starting from the per-chunk optimum, which
// is within a factor v of the optimum when it fits the memory budget).
constexpr int64_t kMaxNodes = 2'000'000;  // Per phase; ~0.1 s each.

class ChunkSearch {
 public:
  ChunkSearch(const StageEvaluator& evaluator, const Placement& reference)
      : evaluator_(evaluator),
        reference_(reference),
        num_virtual_(evaluator.num_virtual_stages()),
        num_layers_(evaluator.num_layers()),
        last_chunk_(evaluator.num_stages(), -1) {
    for (int k = 0; k < num_virtual_; ++k) last_chunk_[evaluator.RankOf(k)] = k;
  }

  // Minimises the largest rank total of cost(k, range) (a rank's total starting at
  // cost_init[r]) over the placements whose every rank's total of mem(k, range), starting at
  // mem_init[r], stays ≤ budget; both ≥ 0. Only values below `incumbent` count. Returns the
  // optimum found (`incumbent` when none is below it) and `*placement` (empty then).
  // `cost_bound`: `cost` is StageCost, so CannotFit's bound applies.
  template <typename Cost, typename Mem>
  double MinMax(const Cost& cost, const std::vector<double>& cost_init, const Mem& mem,
                const std::vector<double>& mem_init, double budget, double incumbent,
                Placement* placement, bool cost_bound) {
    cost_bound_ = cost_bound;
    best_ = incumbent;
    placement->clear();
    best_placement_ = placement;
    current_.assign(num_virtual_, StageRange{});
    std::vector<double> totals = cost_init, memory = mem_init;
    nodes_ = 0;
    MinMaxFrom(0, 0, -kInf, cost, &totals, mem, &memory, budget);
    return best_;
  }

  // Among placements with every rank's cost ≤ bound and memory ≤ budget, the fewest moves
  // (MoveCounter), then the first in the search's order (Ends).
  Placement FewestMoves(double bound, const MoveCounter& moves, const Placement& incumbent) {
    best_moves_ = 0;
    for (size_t k = 0; k < incumbent.size(); ++k) {
      best_moves_ += moves.Cost(static_cast<int>(k), incumbent[k]);
    }
    fewest_ = incumbent;
    current_.assign(num_virtual_, StageRange{});
    std::vector<double> totals(evaluator_.num_stages(), 0.0);
    std::vector<double> memory = evaluator_.RankMemories(Placement{});  // Pinned memory.
    nodes_ = 0;
    bound_ = bound;
    ++best_moves_;  // So that the incumbent itself can be found again, in its order.
    MovesFrom(0, 0, 0, moves, &totals, &memory);
    return fewest_;
  }

  bool cut() const { return nodes_ >= kMaxNodes; }
  int64_t steps() const { return nodes_; }
  // Only placements whose every chunk's StageCost is ≤ `limit` (kInf: all), in MinMax with
  // `cost_bound` and in FewestMoves.
  void set_chunk_limit(double limit) { chunk_limit_ = limit; }

 private:
  template <typename Cost, typename Mem>
  void MinMaxFrom(int k, int64_t begin, double worst, const Cost& cost,
                  std::vector<double>* totals, const Mem& mem, std::vector<double>* memory,
                  double budget) {
    if (++nodes_ >= kMaxNodes) return;
    if (cost_bound_ && k < num_virtual_ && CannotFit(k, begin, *totals, best_)) return;
    if (k == num_virtual_) {
      if (worst < best_) {
        best_ = worst;
        *best_placement_ = current_;
      }
      return;
    }
    const int rank = evaluator_.RankOf(k);
    for (const int64_t end : Ends(k, begin, [&](StageRange range) {
           return (*totals)[rank] + cost(k, range) < best_ &&
                  (*memory)[rank] + mem(k, range) <= budget &&
                  (!cost_bound_ || evaluator_.StageCost(k, range) <= chunk_limit_);
         })) {
      const StageRange range{begin, end};
      // From 0: 0 + c is c exactly, so a rank's total is RankCosts' bit for bit.
      const double total = (*totals)[rank] + cost(k, range);
      const double used = (*memory)[rank] + mem(k, range);
      if (!(total < best_)) continue;  // best_ fell since Ends.
      const double saved_total = (*totals)[rank], saved_memory = (*memory)[rank];
      (*totals)[rank] = total;
      (*memory)[rank] = used;
      current_[k] = range;
      MinMaxFrom(k + 1, end, std::max(worst, total), cost, totals, mem, memory, budget);
      (*totals)[rank] = saved_total;
      (*memory)[rank] = saved_memory;
      if (cut()) return;
    }
  }

  void MovesFrom(int k, int64_t begin, int64_t moved, const MoveCounter& moves,
                 std::vector<double>* totals, std::vector<double>* memory) {
    if (++nodes_ >= kMaxNodes) return;
    if (moved >= best_moves_) return;
    if (k < num_virtual_ && CannotFit(k, begin, *totals, bound_)) return;
    if (k == num_virtual_) {
      best_moves_ = moved;
      fewest_ = current_;
      return;
    }
    const int rank = evaluator_.RankOf(k);
    for (const int64_t end : Ends(k, begin, [&](StageRange range) {
           const double chunk = evaluator_.StageCost(k, range);
           return (*totals)[rank] + chunk <= bound_ && chunk <= chunk_limit_ &&
                  (*memory)[rank] + evaluator_.ChunkMemory(k, range) <= evaluator_.memory_budget();
         })) {
      const StageRange range{begin, end};
      const double total = (*totals)[rank] + evaluator_.StageCost(k, range);
      const double used = (*memory)[rank] + evaluator_.ChunkMemory(k, range);
      const double saved_total = (*totals)[rank], saved_memory = (*memory)[rank];
      (*totals)[rank] = total;
      (*memory)[rank] = used;
      current_[k] = range;
      MovesFrom(k + 1, end, moved + moves.Cost(k, range), moves, totals, memory);
      (*totals)[rank] = saved_total;
      (*memory)[rank] = saved_memory;
      if (cut()) return;
    }
  }

  // The ends chunk k (beginning at `begin`) may take, in the order the search tries them:
  // nearest to the reference's end of chunk k first (ties: the smaller), so that good
  // placements — and, in FewestMoves, placements that move little — come early and cut the
  // rest. `ok(range)` must fail for every end after the first it fails for (rank totals
  // only grow with the range), so the scan stops there.
  template <typename Ok>
  std::vector<int64_t> Ends(int k, int64_t begin, const Ok& ok) const {
    const int64_t last_end = num_layers_ - (num_virtual_ - 1 - k);
    const int64_t first_end = k + 1 == num_virtual_ ? num_layers_ : begin + 1;  // Last: L.
    std::vector<int64_t> ends;
    for (int64_t end = first_end; end <= last_end && ok(StageRange{begin, end}); ++end) {
      ends.push_back(end);
    }
    const int64_t target = reference_[k].end;
    std::stable_sort(ends.begin(), ends.end(), [&](int64_t a, int64_t b) {
      return std::abs(a - target) < std::abs(b - target);
    });
    return ends;
  }

  // Whether the layers [begin, L) (with the pinned costs still to come) cannot go to
  // chunks k.. without some rank's cost reaching `limit`: the ranks that still get a chunk
  // can take at most Σ (limit − their cost so far) between them. The slack keeps rounding
  // from cutting a placement that fits (cutting less never loses exactness).
  bool CannotFit(int k, int64_t begin, const std::vector<double>& totals, double limit) const {
    if (limit == kInf) return false;
    double remaining = evaluator_.StageCost(num_virtual_ - 1, {begin, num_layers_});
    if (k == 0) remaining += evaluator_.StageCost(0, {0, 0});  // The embedding's cost.
    double room = 0;
    for (size_t r = 0; r < totals.size(); ++r) {
      if (last_chunk_[r] >= k) room += std::max(0.0, limit - totals[r]);
    }
    const double slack = 1e-9 * (remaining + static_cast<double>(totals.size()) * limit);
    return room < remaining - slack;
  }

  const StageEvaluator& evaluator_;
  const Placement& reference_;
  int num_virtual_ = 0;
  int64_t num_layers_ = 0;
  std::vector<int> last_chunk_;  // Per rank: its last virtual stage.
  bool cost_bound_ = false;
  double chunk_limit_ = kInf;
  int64_t nodes_ = 0;
  double best_ = kInf;
  Placement* best_placement_ = nullptr;
  Placement current_;
  double bound_ = 0;
  int64_t best_moves_ = 0;
  Placement fewest_;
};

absl::StatusOr<Placement> PartitionChunks(const BalanceProblem& problem,
                                          const StageEvaluator& evaluator,
                                          const Placement* current, PartitionReport* report) {
  const int p = problem.num_stages;
  const int64_t num_layers = problem.num_layers();
  const Placement reference = current != nullptr
                                  ? *current
                                  : UniformPlacement(num_layers, evaluator.num_virtual_stages());
  const MoveCounter moves(evaluator, reference);
  const std::vector<double> pinned = evaluator.RankMemories(Placement{});
  auto no_fit = [&](double least_memory) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "no placement of %d layers on %d virtual pipeline stages (%d pipeline stages) fits "
        "the memory budget of %.10g bytes per stage: the smallest achievable largest stage "
        "memory is %.10g bytes",
        num_layers, evaluator.num_virtual_stages(), p, problem.memory_budget, least_memory));
  };

  if (IsVShape(problem)) {
    const VShapeDp dp(evaluator);
    // A rank's totals in ascending virtual order: front chunk (r), then back (2p−1−r).
    auto rank_cost = [&](int, int front, StageRange a, int back, StageRange b) {
      const double first = evaluator.StageCost(front, a);
      return first + evaluator.StageCost(back, b);
    };
    auto rank_memory = [&](int r, int front, StageRange a, int back, StageRange b) {
      return (pinned[r] + evaluator.ChunkMemory(front, a)) + evaluator.ChunkMemory(back, b);
    };
    auto fits = [&](int r, int front, StageRange a, int back, StageRange b) {
      return rank_memory(r, front, a, back, b) <= problem.memory_budget;
    };
    auto larger_chunk = [&](int, int front, StageRange a, int back, StageRange b) {
      return std::max(evaluator.StageCost(front, a), evaluator.StageCost(back, b));
    };
    // NOTE [partition under chunks]: the smallest largest chunk first...
    const double chunk_limit = dp.MinMax(larger_chunk, fits);
    if (chunk_limit == kInf) {
      return no_fit(dp.MinMax(rank_memory, [](int, int, StageRange, int, StageRange) {
        return true;
      }));
    }
    auto chunk_optimal = [&](int r, int front, StageRange a, int back, StageRange b) {
      return fits(r, front, a, back, b) && larger_chunk(r, front, a, back, b) <= chunk_limit;
    };
    // ...then the smallest bottleneck rank among those, then the fewest moves.
    const double bottleneck = dp.MinMax(rank_cost, chunk_optimal);
    return dp.FewestMoves(
        [&](int r, int front, StageRange a, int back, StageRange b) {
          return chunk_optimal(r, front, a, back, b) && rank_cost(r, front, a, back, b) <= bottleneck;
        },
        moves);
  }

  // Interleaved (or any other map): the per-chunk optimum C (the least largest chunk of
  // any placement) is the first criterion; a placement reaching it with the fewest moves
  // starts the search for the least bottleneck rank among those reaching it.
  const int num_virtual = evaluator.num_virtual_stages();
  Placement incumbent;
  double incumbent_value = kInf;
  const double chunk_optimum = MinMaxOverPlacements(
      num_virtual, num_layers,
      [&](int k, StageRange range) { return evaluator.StageCost(k, range); },
      [](int, StageRange) { return true; });
  {
    // Two lower bounds on the optimum: its largest rank holds at least its largest chunk,
    // and at least the average rank cost.
    const double total = evaluator.StageCost(0, {0, num_layers}) +
                         evaluator.StageCost(num_virtual - 1, {0, 0});
    report->lower_bound = std::max(chunk_optimum, total / p);
    // A placement reaching the per-chunk optimum, as the one-chunk Partition would pick it.
    Placement candidate = FewestMovesWithin(
        StageEvaluator([&] {
          BalanceProblem flat = problem;
          flat.chunk_rank.clear();
          flat.num_stages = num_virtual;
          flat.activation_multiplier.clear();
          flat.pinned_memory.clear();
          flat.memory_budget = kInf;
          return flat;
        }()),
        chunk_optimum, reference);
    if (evaluator.FitsMemory(candidate)) {
      incumbent = candidate;
      // Strictly above, so that the search may find the incumbent's value again.
      incumbent_value = std::nextafter(evaluator.Bottleneck(candidate), kInf);
    }
  }
  ChunkSearch search(evaluator, reference);
  Placement found;
  std::vector<double> zeros(p, 0.0);
  auto least_bottleneck = [&] {
    return search.MinMax(
        [&](int k, StageRange range) { return evaluator.StageCost(k, range); }, zeros,
        [&](int k, StageRange range) { return evaluator.ChunkMemory(k, range); }, pinned,
        problem.memory_budget, incumbent_value, &found, /*cost_bound=*/true);
  };
  // NOTE [partition under chunks]: the largest chunk first — the per-chunk optimum — where
  // a placement reaching it fits the memory budget; the bottleneck rank among those.
  search.set_chunk_limit(chunk_optimum);
  double bottleneck = least_bottleneck();
  int64_t earlier_steps = 0;
  if (found.empty() && incumbent.empty() && !search.cut()) {
    // None reaching the per-chunk optimum fits: the bottleneck rank alone.
    earlier_steps = search.steps();
    search.set_chunk_limit(kInf);
    bottleneck = least_bottleneck();
  }
  report->search_steps = earlier_steps + search.steps();
  report->exact = !search.cut();
  if (found.empty()) {
    if (!incumbent.empty()) {
      found = incumbent;
      bottleneck = evaluator.Bottleneck(incumbent);
    } else if (search.cut()) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "no placement of %d layers on %d virtual pipeline stages found within the memory "
          "budget of %.10g bytes per stage after a search of %d steps",
          num_layers, num_virtual, problem.memory_budget, kMaxNodes));
    } else {
      ChunkSearch memory_search(evaluator, reference);
      Placement unused;
      return no_fit(memory_search.MinMax(
          [&](int k, StageRange range) { return evaluator.ChunkMemory(k, range); }, pinned,
          [](int, StageRange) { return 0.0; }, zeros, kInf, kInf, &unused,
          /*cost_bound=*/false));
    }
  }
  Placement placement = search.FewestMoves(bottleneck, moves, found);
  report->search_steps += search.steps();
  report->exact = report->exact && !search.cut();
  return placement;
}

}  // namespace

absl::StatusOr<Placement> PartitionBalance(const BalanceProblem& problem,
                                           const Placement* current, PartitionReport* report) {
  PartitionReport unused;
  if (report == nullptr) report = &unused;
  *report = PartitionReport{};
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
  if (evaluator.has_chunks()) return PartitionChunks(problem, evaluator, current, report);

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
