#include "dynamic/repack.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "dynamic/load_model.h"
#include "dynamic/stage_costs.h"
#include "pipeline/measured_order.h"
#include "pipeline/schedule.h"

namespace fulcrum::dynamic {
namespace {

absl::Status CheckVector(const std::vector<double>& values, int64_t size, const char* field,
                         bool may_be_empty) {
  if (values.empty() && may_be_empty) return absl::OkStatus();
  if (static_cast<int64_t>(values.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat("repack problem: ", field, " has ",
                                                   values.size(), " entries, expected ", size));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("repack problem: ", field, "[", i, "] = ",
                                                     values[i], " must be finite and ≥ 0"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckScalar(double value, const char* field) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack problem: ", field, " = ", value, " must be finite and ≥ 0"));
  }
  return absl::OkStatus();
}

// Evaluates placements of one problem: schedules by rank count are generated once.
// NOTE [re-packing under chunks]: a placement of q ≥ 2 ranks has q·v ranges, one of a
// single rank one range, run under the schedule's one-chunk form.
class Evaluator {
 public:
  explicit Evaluator(const RepackProblem& problem)
      : problem_(problem), chunks_(ChunksPerRank(problem.schedule, problem.num_chunks)) {}

  // RepackLayout for `num_ranks` ranks, made once.
  absl::StatusOr<const std::vector<pipeline::ChunkId>*> LayoutFor(int num_ranks) {
    auto it = layouts_.find(num_ranks);
    if (it == layouts_.end()) {
      absl::StatusOr<std::vector<pipeline::ChunkId>> made =
          RepackLayout(problem_.schedule, num_ranks, problem_.num_chunks);
      if (!made.ok()) return made.status();
      it = layouts_.emplace(num_ranks, *std::move(made)).first;
    }
    return &it->second;
  }
  int RanksOf(const Placement& placement) const {
    return dynamic::RanksOf(static_cast<int>(placement.size()), chunks_);
  }

  // What each (virtual) stage of `placement` runs per micro-batch.
  std::vector<pipeline::ActionCosts> StageCosts(const Placement& placement) const {
    return PlacementStageCosts(problem_.layer_forward, problem_.layer_backward,
                               problem_.layer_weight, problem_.first_stage, problem_.last_stage,
                               placement, problem_.p2p);
  }

  // The schedule `placement` runs: its rank count's, the virtual stages that lie wholly in
  // the frozen prefix forward only (NOTE [forward-only stages]). Under ZB-V at measured
  // costs, the order the runner would build for it (NOTE [re-packing under the measured V]
  // in repack.h), chosen on `stage_costs` (StageCosts(placement)) when the caller has them,
  // else on StageCosts computed here — only on this path.
  absl::StatusOr<const pipeline::Schedule*> ScheduleFor(
      const Placement& placement,
      const std::vector<pipeline::ActionCosts>* stage_costs = nullptr) {
    const int q = RanksOf(placement);
    const int forward_only =
        pipeline::ForwardOnlyVirtualStages(ToLayerRanges(placement), problem_.frozen_prefix);
    if (!problem_.measured_zbv_order || problem_.schedule != "zbv" || q < 2) {
      return ScheduleFor(q, forward_only);
    }
    // The unit V's error, if any, is the schedule's reason this rank count cannot run.
    FULCRUM_RETURN_IF_ERROR(ScheduleFor(q, 0).status());
    FULCRUM_ASSIGN_OR_RETURN(const std::vector<pipeline::Schedule>* candidates, VCandidates(q));
    if (candidates == nullptr) return ScheduleFor(q, forward_only);  // no positive mean
    // The runner picks on measured action times, which hold no transfer time.
    std::vector<pipeline::ActionCosts> actions =
        stage_costs != nullptr ? *stage_costs : StageCosts(placement);
    for (pipeline::ActionCosts& c : actions) c.p2p = 0;
    const size_t k = pipeline::FastestVOrder(*candidates, actions, forward_only);
    const std::tuple<int, size_t, int> key(q, k, forward_only);
    auto it = v_prefixed_.find(key);
    if (it == v_prefixed_.end()) {
      it = v_prefixed_.emplace(key, pipeline::WithForwardOnlyPrefix((*candidates)[k], forward_only))
               .first;
    }
    return &it->second;
  }

  // The schedule of `num_ranks` ranks, the first `forward_only` virtual stages forward only.
  absl::StatusOr<const pipeline::Schedule*> ScheduleFor(int num_ranks, int forward_only) {
    const std::pair<int, int> key(num_ranks, forward_only);
    auto it = schedules_.find(key);
    if (it == schedules_.end()) {
      const bool one = num_ranks == 1;
      absl::StatusOr<pipeline::Schedule> made = pipeline::MakeSchedule(
          one ? pipeline::OneStageScheduleName(problem_.schedule) : problem_.schedule, num_ranks,
          problem_.num_microbatches, one ? 1 : problem_.num_chunks);
      if (!made.ok()) return made.status();
      it = schedules_.emplace(key, pipeline::WithForwardOnlyPrefix(*std::move(made), forward_only))
               .first;
    }
    return &it->second;
  }

  // The V's the runner chooses among on `num_ranks` ≥ 2 ranks (pipeline::VOrderCandidates)
  // at the mean chunk action there: the whole model's F, B and W — the same for every
  // placement — over its 2q virtual stages; nullptr when a mean is not positive.
  absl::StatusOr<const std::vector<pipeline::Schedule>*> VCandidates(int num_ranks) {
    auto it = v_candidates_.find(num_ranks);
    if (it == v_candidates_.end()) {
      const std::optional<pipeline::ActionCosts> mean = pipeline::MeanActionCosts(
          StageCosts({StageRange{0, problem_.num_layers()}}).front(), 2.0 * num_ranks);
      std::optional<std::vector<pipeline::Schedule>> made;
      if (mean.has_value()) {
        try {
          made = pipeline::VOrderCandidates(num_ranks, problem_.num_microbatches, *mean);
        } catch (const std::exception& e) {
          return absl::InvalidArgumentError(absl::StrCat("repack: ", e.what()));
        }
      }
      it = v_candidates_.emplace(num_ranks, std::move(made)).first;
    }
    return it->second.has_value() ? &*it->second : nullptr;
  }

  absl::StatusOr<double> Time(const Placement& placement) {
    const std::vector<pipeline::ActionCosts> costs = StageCosts(placement);
    FULCRUM_ASSIGN_OR_RETURN(const pipeline::Schedule* schedule, ScheduleFor(placement, &costs));
    return pipeline::Simulate(*schedule, costs).makespan;
  }

  // Per rank. One chunk per rank: state + PeakInFlight × activations, computed as before
  // chunks existed (bit for bit); with chunks each rank sums its chunks' state and holds
  // PeakHeldBytes of their activations. The embedding's state goes with virtual stage 0,
  // the head's with the last (ZB-V: both on rank 0).
  absl::StatusOr<std::vector<double>> Memory(const Placement& placement) {
    FULCRUM_ASSIGN_OR_RETURN(const pipeline::Schedule* schedule, ScheduleFor(placement));
    const pipeline::Schedule& sched = *schedule;
    const int q = RanksOf(placement);
    const std::vector<pipeline::ChunkId> layout = pipeline::VirtualStages(sched);
    std::vector<double> memory(q, 0.0);
    if (sched.num_chunks == 1) {
      for (int s = 0; s < q; ++s) {
        memory[s] = RangeSum(problem_.layer_state_bytes, placement[s]) +
                    pipeline::PeakInFlight(sched, s) *
                        RangeSum(problem_.layer_activation_bytes, placement[s]);
      }
    } else {
      std::vector<std::vector<double>> activations(q, std::vector<double>(sched.num_chunks, 0.0));
      for (size_t k = 0; k < placement.size(); ++k) {
        memory[layout[k].stage] += RangeSum(problem_.layer_state_bytes, placement[k]);
        activations[layout[k].stage][layout[k].chunk] =
            RangeSum(problem_.layer_activation_bytes, placement[k]);
      }
      for (int s = 0; s < q; ++s) memory[s] += pipeline::PeakHeldBytes(sched, s, activations[s]);
    }
    memory[layout.front().stage] += problem_.first_stage_pinned_bytes;
    memory[layout.back().stage] += problem_.last_stage_pinned_bytes;
    return memory;
  }

 private:
  const RepackProblem& problem_;
  const int chunks_;
  std::map<std::pair<int, int>, pipeline::Schedule> schedules_;  // (ranks, forward-only)
  std::map<int, std::optional<std::vector<pipeline::Schedule>>> v_candidates_;  // by ranks
  std::map<std::tuple<int, size_t, int>, pipeline::Schedule> v_prefixed_;  // (ranks, k, f-o)
  std::map<int, std::vector<pipeline::ChunkId>> layouts_;         // by rank count
};

// The most boundary choices first fit tries for one step (NOTE [re-packing under chunks]:
// a step over rank counts the schedule cannot run removes several boundaries at once).
constexpr int kFirstFitTries = 4096;

// Calls `visit` with every ascending choice of k indices from [0, n), in lexicographic
// order; stops when `visit` returns false.
template <typename Visit>
void ForEachCombination(int n, int k, Visit visit) {
  std::vector<int> pick(k);
  for (int i = 0; i < k; ++i) pick[i] = i;
  if (k > n) return;
  while (true) {
    if (!visit(pick)) return;
    int i = k - 1;
    while (i >= 0 && pick[i] == n - k + i) --i;
    if (i < 0) return;
    ++pick[i];
    for (int j = i + 1; j < k; ++j) pick[j] = pick[j - 1] + 1;
  }
}

// NOTE [re-packing by bottleneck]
// Above kExhaustiveRepackStages the 2^(p-1) coarsenings are too many to simulate (24
// stages: 8 million). For each rank count q, the grouping of the current ranks into q runs
// of consecutive ranks with the smallest bottleneck — the largest per-micro-batch F+B+W
// of a group, the embedding's cost on the group holding virtual stage 0 and the head's on
// the group holding the last — among those whose every group fits the memory budget, is
// found exactly by dynamic programming over the rank boundaries, O(q·p²). The bottleneck
// is what bounds a pipeline's steady state, so this is the q-rank candidate most likely to
// keep the predicted time; it is then simulated like any other. With chunks a group's
// activations count PeakInFlight / v times (each held pair is about 1/v of the rank's
// layers): an estimate for choosing the candidate only (PeakHeldBytes may exceed it with
// unequal chunks), whose memory evaluate() then predicts exactly. Returns the cut indices (as CoarsenRanks takes them), or nothing when no
// q-grouping fits the budget.
std::optional<std::vector<int>> LeastBottleneckCuts(const RepackProblem& problem,
                                                    const std::vector<Placement>& rank_ranges,
                                                    bool head_on_first, int q,
                                                    const pipeline::Schedule& schedule) {
  const int p = static_cast<int>(rank_ranges.size());
  // prefix[i]: the per-micro-batch F+B+W and the state bytes of old ranks [0, i); the
  // activation bytes likewise (times the group's in-flight count below).
  std::vector<double> work(p + 1, 0), state(p + 1, 0), activations(p + 1, 0);
  for (int i = 0; i < p; ++i) {
    // Added to the prefix range by range, term by term: with one chunk the same sums in the
    // same order as before chunks existed.
    double w = work[i], st = state[i], act = activations[i];
    for (const StageRange& range : rank_ranges[i]) {
      w = w + RangeSum(problem.layer_forward, range) + RangeSum(problem.layer_backward, range) +
          RangeSum(problem.layer_weight, range);
      st += RangeSum(problem.layer_state_bytes, range);
      act += RangeSum(problem.layer_activation_bytes, range);
    }
    work[i + 1] = w;
    state[i + 1] = st;
    activations[i + 1] = act;
  }
  const auto pinned_work = [](const pipeline::ActionCosts& c) {
    return c.forward + c.backward_input + c.backward_weight;
  };
  const int head_group = head_on_first ? 0 : q - 1;
  // Group g (of q) made of old ranks [i, j): its cost, or +inf when over the budget.
  const double kInf = std::numeric_limits<double>::infinity();
  auto group_cost = [&](int g, int i, int j) {
    double memory = state[j] - state[i] +
                    pipeline::PeakInFlight(schedule, g) / static_cast<double>(schedule.num_chunks) *
                        (activations[j] - activations[i]);
    double cost = work[j] - work[i];
    if (g == 0) {
      memory += problem.first_stage_pinned_bytes;
      cost += pinned_work(problem.first_stage);
    }
    if (g == head_group) {
      memory += problem.last_stage_pinned_bytes;
      cost += pinned_work(problem.last_stage);
    }
    return memory > problem.memory_budget ? kInf : cost;
  };
  // best[g][j]: the least bottleneck of groups 0..g covering old ranks [0, j);
  // from[g][j] the start of group g in it.
  std::vector<std::vector<double>> best(q, std::vector<double>(p + 1, kInf));
  std::vector<std::vector<int>> from(q, std::vector<int>(p + 1, -1));
  for (int j = 1; j <= p; ++j) best[0][j] = group_cost(0, 0, j), from[0][j] = 0;
  for (int g = 1; g < q; ++g) {
    for (int j = g + 1; j <= p; ++j) {
      for (int i = g; i < j; ++i) {  // group g is [i, j); the groups before cover [0, i)
        const double candidate = std::max(best[g - 1][i], group_cost(g, i, j));
        if (candidate < best[g][j]) best[g][j] = candidate, from[g][j] = i;
      }
    }
  }
  if (!std::isfinite(best[q - 1][p])) return std::nullopt;
  std::vector<int> cuts(q - 1);
  for (int g = q - 1, j = p; g > 0; --g) {
    j = from[g][j];
    cuts[g - 1] = j - 1;  // old rank j-1 ends group g-1
  }
  return cuts;
}

}  // namespace

absl::Status RepackOptions::Validate() const {
  if (min_stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--repack_min_stages=", min_stages, " must be ≥ 1"));
  }
  if (!std::isfinite(max_slowdown) || max_slowdown < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--repack_max_slowdown=", max_slowdown, " must be a finite fraction ≥ 0 (0.05: 5%)"));
  }
  if (exhaustive_up_to < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RepackOptions::exhaustive_up_to=", exhaustive_up_to, " must be ≥ 1"));
  }
  return absl::OkStatus();
}

int ChunksPerRank(const std::string& schedule, int num_chunks) {
  // The schedule decides its chunks (ZB-V takes 2 whatever is asked): make it for two ranks
  // (one rank would be the same; two is the smallest pipeline that has a layout).
  absl::StatusOr<pipeline::Schedule> made =
      pipeline::MakeSchedule(schedule, 2, 2, std::max(num_chunks, 1));
  return made.ok() ? made->num_chunks : std::max(num_chunks, 1);
}

int RanksOf(int num_ranges, int chunks) {
  return num_ranges <= 1 || chunks <= 1 ? num_ranges : num_ranges / chunks;
}

absl::StatusOr<std::vector<pipeline::ChunkId>> RepackLayout(const std::string& schedule,
                                                           int num_ranks, int num_chunks) {
  if (num_ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("repack: ", num_ranks, " ranks"));
  }
  std::vector<pipeline::ChunkId> identity;
  for (int r = 0; r < num_ranks; ++r) identity.push_back({r, 0});
  if (num_ranks == 1 || ChunksPerRank(schedule, num_chunks) == 1) return identity;
  // The layout does not depend on the micro-batch count (NOTE [model chunks]); 2q meets
  // interleaved 1F1B's m % q = 0.
  absl::StatusOr<pipeline::Schedule> made =
      pipeline::MakeSchedule(schedule, num_ranks, 2 * num_ranks, num_chunks);
  if (!made.ok()) return made.status();
  return pipeline::VirtualStages(*made);
}

namespace {

// InvalidArgument unless `num_ranges` ranges can lie on ranks of `chunks` chunks: one range
// (one rank), or q·chunks for q ≥ 2.
absl::Status CheckRangeCount(int num_ranges, int chunks, const std::string& schedule) {
  if (num_ranges < 1 || (chunks > 1 && num_ranges > 1 &&
                         (num_ranges % chunks != 0 || num_ranges < 2 * chunks))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repack: ", num_ranges, " ranges under --pipeline_schedule=", schedule, " with ", chunks,
        " chunks per rank; expected one range (one rank) or q·", chunks, " for q ≥ 2 ranks"));
  }
  return absl::OkStatus();
}

// CoarsenRanks with the layouts of the p old and the q new ranks given (`to` one entry for
// one rank).
absl::StatusOr<Placement> CoarsenLaidOut(const Placement& current,
                                         const std::vector<pipeline::ChunkId>& from,
                                         const std::vector<pipeline::ChunkId>& to,
                                         const std::vector<int>& cuts) {
  int ranks = 0;
  for (const pipeline::ChunkId& id : from) ranks = std::max(ranks, id.stage + 1);
  if (current.size() != from.size()) {
    return absl::InvalidArgumentError(absl::StrCat("repack: ", current.size(), " ranges for ",
                                                   from.size(), " virtual stages"));
  }
  for (size_t i = 0; i < cuts.size(); ++i) {
    if (cuts[i] < 0 || cuts[i] >= ranks - 1 || (i > 0 && cuts[i] <= cuts[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat("repack: cut after rank ", cuts[i],
                                                     " is out of order or range for ", ranks,
                                                     " ranks"));
    }
  }
  const int q = static_cast<int>(cuts.size()) + 1;
  if (q == 1) return Placement{{current.front().begin, current.back().end}};
  std::vector<int> group(ranks);  // old rank → new rank
  for (int r = 0, g = 0; r < ranks; ++r) {
    group[r] = g;
    if (g < q - 1 && r == cuts[g]) ++g;
  }
  // The new virtual stage (g, c): the union of old (r, c) over group g's ranks.
  std::map<std::pair<int, int>, StageRange> unions;
  std::map<std::pair<int, int>, int64_t> sizes;
  for (size_t k = 0; k < from.size(); ++k) {
    const std::pair<int, int> key(group[from[k].stage], from[k].chunk);
    auto [it, fresh] = unions.emplace(key, current[k]);
    if (!fresh) {
      it->second.begin = std::min(it->second.begin, current[k].begin);
      it->second.end = std::max(it->second.end, current[k].end);
    }
    sizes[key] += current[k].end - current[k].begin;
  }
  Placement out;
  for (const pipeline::ChunkId& id : to) {
    const std::pair<int, int> key(id.stage, id.chunk);
    auto it = unions.find(key);
    if (it == unions.end() || it->second.end - it->second.begin != sizes.at(key) ||
        (!out.empty() && out.back().end != it->second.begin)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "repack: the schedule's layout does not coarsen: merging ranks at ",
          absl::StrJoin(cuts, ","), " of ", FormatPlacement(current),
          " gives no contiguous chunk ", id.chunk, " on new rank ", id.stage));
    }
    out.push_back(it->second);
  }
  return out;
}

}  // namespace

absl::StatusOr<Placement> CoarsenRanks(const Placement& current, const std::string& schedule,
                                       int num_chunks, const std::vector<int>& cuts) {
  const int chunks = ChunksPerRank(schedule, num_chunks);
  FULCRUM_RETURN_IF_ERROR(CheckRangeCount(static_cast<int>(current.size()), chunks, schedule));
  const int p = RanksOf(static_cast<int>(current.size()), chunks);
  const int q = static_cast<int>(cuts.size()) + 1;
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<pipeline::ChunkId> from,
                           RepackLayout(schedule, p, num_chunks));
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<pipeline::ChunkId> to,
                           RepackLayout(schedule, std::max(1, std::min(q, p)), num_chunks));
  return CoarsenLaidOut(current, from, to, cuts);
}

absl::Status ValidateRepackProblem(const RepackProblem& problem) {
  const int64_t n = problem.num_layers();
  if (n < 1) return absl::InvalidArgumentError("repack problem: no layers (layer_forward is empty)");
  if (auto s = CheckVector(problem.layer_forward, n, "layer_forward", false); !s.ok()) return s;
  if (auto s = CheckVector(problem.layer_backward, n, "layer_backward", false); !s.ok()) return s;
  if (auto s = CheckVector(problem.layer_weight, n, "layer_weight", true); !s.ok()) return s;
  if (auto s = CheckVector(problem.layer_state_bytes, n, "layer_state_bytes", true); !s.ok()) {
    return s;
  }
  if (auto s = CheckVector(problem.layer_activation_bytes, n, "layer_activation_bytes", true);
      !s.ok()) {
    return s;
  }
  for (const auto& [value, field] : std::vector<std::pair<double, const char*>>{
           {problem.first_stage.forward, "first_stage.forward"},
           {problem.first_stage.backward_input, "first_stage.backward_input"},
           {problem.first_stage.backward_weight, "first_stage.backward_weight"},
           {problem.last_stage.forward, "last_stage.forward"},
           {problem.last_stage.backward_input, "last_stage.backward_input"},
           {problem.last_stage.backward_weight, "last_stage.backward_weight"},
           {problem.p2p, "p2p"},
           {problem.first_stage_pinned_bytes, "first_stage_pinned_bytes"},
           {problem.last_stage_pinned_bytes, "last_stage_pinned_bytes"}}) {
    if (auto s = CheckScalar(value, field); !s.ok()) return s;
  }
  if (std::isnan(problem.memory_budget) || problem.memory_budget < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("repack problem: memory_budget = ", problem.memory_budget, " must be ≥ 0"));
  }
  if (problem.num_microbatches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repack problem: num_microbatches = ", problem.num_microbatches, " must be ≥ 1"));
  }
  if (problem.num_chunks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repack problem: num_chunks = ", problem.num_chunks, " must be ≥ 1"));
  }
  return absl::OkStatus();
}

namespace {

// A placement of q ranks: one range (q = 1) or q·v (NOTE [re-packing under chunks]).
absl::Status CheckPlacement(const RepackProblem& problem, const Placement& placement) {
  if (placement.empty()) return absl::InvalidArgumentError("repack: an empty placement");
  const int n = static_cast<int>(placement.size());
  FULCRUM_RETURN_IF_ERROR(
      CheckRangeCount(n, ChunksPerRank(problem.schedule, problem.num_chunks), problem.schedule));
  BalanceProblem shape;
  shape.num_stages = n;
  shape.layer_cost.assign(problem.num_layers(), 0.0);
  return ValidatePlacement(shape, placement);
}

}  // namespace

absl::StatusOr<double> PredictIterationTime(const RepackProblem& problem,
                                            const Placement& placement) {
  if (auto s = ValidateRepackProblem(problem); !s.ok()) return s;
  if (auto s = CheckPlacement(problem, placement); !s.ok()) return s;
  Evaluator evaluator(problem);
  return evaluator.Time(placement);
}

absl::StatusOr<std::vector<double>> RepackStageMemory(const RepackProblem& problem,
                                                      const Placement& placement) {
  if (auto s = ValidateRepackProblem(problem); !s.ok()) return s;
  if (auto s = CheckPlacement(problem, placement); !s.ok()) return s;
  Evaluator evaluator(problem);
  return evaluator.Memory(placement);
}

absl::StatusOr<RepackPlan> DecideRepack(const RepackProblem& problem, const Placement& current,
                                        const RepackOptions& options) {
  if (auto s = ValidateRepackProblem(problem); !s.ok()) return s;
  if (auto s = CheckPlacement(problem, current); !s.ok()) return s;
  if (auto s = options.Validate(); !s.ok()) return s;
  Evaluator evaluator(problem);
  RepackPlan plan;
  plan.placement = current;
  const int p = evaluator.RanksOf(current);
  absl::StatusOr<double> before = evaluator.Time(current);
  if (!before.ok()) return before.status();
  plan.predicted_before = *before;
  plan.predicted_after = *before;
  {
    absl::StatusOr<std::vector<double>> memory = evaluator.Memory(current);
    if (!memory.ok()) return memory.status();
    plan.peak_memory = *std::max_element(memory->begin(), memory->end());
  }
  const double bound = (1.0 + options.max_slowdown) * plan.predicted_before;
  // Each rank's ranges, and where the head is (NOTE [re-packing under chunks]).
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<pipeline::ChunkId>* from, evaluator.LayoutFor(p));
  const std::vector<pipeline::ChunkId>& layout = *from;
  std::vector<Placement> rank_ranges(p);
  for (size_t k = 0; k < layout.size(); ++k) rank_ranges[layout[k].stage].push_back(current[k]);
  const bool head_on_first = p > 1 && layout.back().stage == 0;
  // Rank counts the schedule cannot run (interleaved: m % q ≠ 0) are no candidates.
  std::map<int, std::string> unrunnable;
  auto runnable = [&](int q) {
    absl::StatusOr<const pipeline::Schedule*> schedule = evaluator.ScheduleFor(q, 0);
    if (!schedule.ok()) unrunnable[q] = std::string(schedule.status().message());
    return schedule.ok();
  };

  // Admissible (NOTE [re-packing decision]): fits the budget and the slowdown bound.
  absl::Status error = absl::OkStatus();
  auto evaluate = [&](const std::vector<int>& cuts, Placement* candidate, double* time,
                      double* peak) -> bool {
    ++plan.candidates;
    absl::StatusOr<const std::vector<pipeline::ChunkId>*> to =
        evaluator.LayoutFor(static_cast<int>(cuts.size()) + 1);
    if (!to.ok()) {
      error = to.status();
      return false;
    }
    absl::StatusOr<Placement> coarse = CoarsenLaidOut(current, *from, **to, cuts);
    if (!coarse.ok()) {
      error = coarse.status();
      return false;
    }
    *candidate = *std::move(coarse);
    absl::StatusOr<std::vector<double>> memory = evaluator.Memory(*candidate);
    if (!memory.ok()) {
      error = memory.status();
      return false;
    }
    *peak = *std::max_element(memory->begin(), memory->end());
    if (*peak > problem.memory_budget) return false;
    absl::StatusOr<double> t = evaluator.Time(*candidate);
    if (!t.ok()) {
      error = t.status();
      return false;
    }
    *time = *t;
    return *time <= bound;
  };
  auto take = [&](Placement candidate, double time, double peak) {
    plan.repack = true;
    plan.placement = std::move(candidate);
    plan.predicted_after = time;
    plan.peak_memory = peak;
  };

  if (p <= options.exhaustive_up_to) {
    // Fewest ranks first; within a count, the fastest, then the smallest ends (the
    // combinations come in lexicographic order and only a strictly faster one replaces).
    for (int q = options.min_stages; q < p && !plan.repack; ++q) {
      if (!runnable(q)) continue;
      ForEachCombination(p - 1, q - 1, [&](const std::vector<int>& cuts) {
        Placement candidate;
        double time = 0, peak = 0;
        if (evaluate(cuts, &candidate, &time, &peak) &&
            (!plan.repack || time < plan.predicted_after)) {
          take(std::move(candidate), time, peak);
        }
        return error.ok();
      });
      if (!error.ok()) return error;
    }
  } else {
    // NOTE [re-packing by bottleneck]: fewest ranks first, one candidate per count.
    for (int q = options.min_stages; q < p && !plan.repack; ++q) {
      if (!runnable(q)) continue;
      // The candidate's memory bound counts every rank's in-flight micro-batches, frozen
      // ones too (conservative); evaluate() then predicts it exactly.
      absl::StatusOr<const pipeline::Schedule*> schedule = evaluator.ScheduleFor(q, 0);
      if (!schedule.ok()) return schedule.status();
      const std::optional<std::vector<int>> cuts =
          LeastBottleneckCuts(problem, rank_ranges, head_on_first, q, **schedule);
      if (!cuts.has_value()) continue;
      Placement candidate;
      double time = 0, peak = 0;
      if (evaluate(*cuts, &candidate, &time, &peak)) take(std::move(candidate), time, peak);
      if (!error.ok()) return error;
    }
  }
  if (p > options.exhaustive_up_to) {
    // Also first fit over adjacent groups, leftmost first, until no merge is admissible; it
    // wins when it reaches fewer ranks (or as many, faster) than the least-bottleneck
    // candidates — e.g. when those all run too slow. A rank count the schedule cannot run
    // (interleaved: m % q ≠ 0) is stepped over: the merge goes on to the next count it can,
    // removing that many boundaries at once (the leftmost admissible choice).
    std::vector<int> cuts(p - 1);
    std::iota(cuts.begin(), cuts.end(), 0);
    Placement packed = current;
    double packed_time = 0, packed_peak = 0;
    bool merged = true;
    while (merged) {
      merged = false;
      const int ranks = static_cast<int>(cuts.size()) + 1;
      int next = ranks - 1;
      while (next >= options.min_stages && !runnable(next)) --next;
      if (next < options.min_stages) break;
      int tries = 0;  // a wide step (24 → 16 ranks) is tried for its first kFirstFitTries only
      ForEachCombination(static_cast<int>(cuts.size()), ranks - next,
                         [&](const std::vector<int>& removed) {
                           if (++tries > kFirstFitTries) return false;
                           std::vector<int> fewer;
                           for (int i = 0, r = 0; i < static_cast<int>(cuts.size()); ++i) {
                             if (r < static_cast<int>(removed.size()) && removed[r] == i) {
                               ++r;
                             } else {
                               fewer.push_back(cuts[i]);
                             }
                           }
                           Placement candidate;
                           double time = 0, peak = 0;
                           if (evaluate(fewer, &candidate, &time, &peak)) {
                             cuts = std::move(fewer);
                             packed = std::move(candidate);
                             packed_time = time;
                             packed_peak = peak;
                             merged = true;
                             return false;
                           }
                           return error.ok();
                         });
      if (!error.ok()) return error;
    }
    const int packed_ranks = static_cast<int>(cuts.size()) + 1;
    const int plan_ranks = evaluator.RanksOf(plan.placement);
    if (packed_ranks < p && (packed_ranks < plan_ranks ||
                             (packed_ranks == plan_ranks && packed_time < plan.predicted_after))) {
      take(std::move(packed), packed_time, packed_peak);
    }
  }

  std::string refused;
  for (const auto& [q, why] : unrunnable) {
    absl::StrAppend(&refused, refused.empty() ? "; not on " : ", ", q, " stages: ", why);
  }
  if (plan.repack) {
    plan.note = absl::StrFormat(
        "repack: %d → %d stages, %s → %s; predicted iteration %.4g → %.4g (%+.1f%%, allowed "
        "%+.1f%%), peak stage memory %.4g%s",
        p, evaluator.RanksOf(plan.placement), FormatPlacement(current),
        FormatPlacement(plan.placement), plan.predicted_before, plan.predicted_after,
        100.0 * (plan.predicted_after / plan.predicted_before - 1.0), 100.0 * options.max_slowdown,
        plan.peak_memory, refused);
  } else {
    plan.note = absl::StrFormat(
        "repack: keep %d stages; no coarsening onto ≥ %d stages fits the memory budget with a "
        "predicted slowdown ≤ %.1f%% (%d tried)%s",
        p, options.min_stages, 100.0 * options.max_slowdown, plan.candidates, refused);
  }
  return plan;
}

absl::StatusOr<Placement> EvenCoarsening(const Placement& current, int num_stages,
                                         const std::string& schedule, int num_chunks) {
  const int p = RanksOf(static_cast<int>(current.size()), ChunksPerRank(schedule, num_chunks));
  if (num_stages < 1 || num_stages > p) {
    return absl::InvalidArgumentError(absl::StrCat("cannot pack ", p, " pipeline stages onto ",
                                                   num_stages, "; expected 1..", p));
  }
  if (num_stages == p) return current;
  std::vector<int> cuts;
  int end = 0;
  for (int g = 0; g + 1 < num_stages; ++g) {
    end += p / num_stages + (g < p % num_stages ? 1 : 0);
    cuts.push_back(end - 1);
  }
  return CoarsenRanks(current, schedule, num_chunks, cuts);
}

}  // namespace fulcrum::dynamic
