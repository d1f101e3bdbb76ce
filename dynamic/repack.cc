#include "dynamic/repack.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dynamic/stage_costs.h"
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

// Evaluates placements of one problem: schedules by stage count are generated once.
class Evaluator {
 public:
  explicit Evaluator(const RepackProblem& problem) : problem_(problem) {}

  // The schedule `placement` runs: its stage count's, the stages that lie wholly in the
  // frozen prefix forward only (NOTE [forward-only stages]).
  absl::StatusOr<const pipeline::Schedule*> ScheduleFor(const Placement& placement) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const StageRange& r : placement) ranges.emplace_back(r.begin, r.end);
    return ScheduleFor(static_cast<int>(placement.size()),
                       pipeline::ForwardOnlyVirtualStages(ranges, problem_.frozen_prefix));
  }

  // The schedule of `num_stages` stages, the first `forward_only` forward only.
  absl::StatusOr<const pipeline::Schedule*> ScheduleFor(int num_stages, int forward_only) {
    const std::pair<int, int> key(num_stages, forward_only);
    auto it = schedules_.find(key);
    if (it == schedules_.end()) {
      absl::StatusOr<pipeline::Schedule> made =
          pipeline::MakeSchedule(problem_.schedule, num_stages, problem_.num_microbatches);
      if (!made.ok()) return made.status();
      it = schedules_.emplace(key, pipeline::WithForwardOnlyPrefix(*std::move(made), forward_only))
               .first;
    }
    return &it->second;
  }

  absl::StatusOr<double> Time(const Placement& placement) {
    absl::StatusOr<const pipeline::Schedule*> schedule = ScheduleFor(placement);
    if (!schedule.ok()) return schedule.status();
    return pipeline::Simulate(**schedule,
                              PlacementStageCosts(problem_.layer_forward, problem_.layer_backward,
                                                  problem_.layer_weight, problem_.first_stage,
                                                  problem_.last_stage, placement, problem_.p2p))
        .makespan;
  }

  absl::StatusOr<std::vector<double>> Memory(const Placement& placement) {
    const int q = static_cast<int>(placement.size());
    absl::StatusOr<const pipeline::Schedule*> schedule = ScheduleFor(placement);
    if (!schedule.ok()) return schedule.status();
    std::vector<double> memory(q);
    for (int s = 0; s < q; ++s) {
      memory[s] = RangeSum(problem_.layer_state_bytes, placement[s]) +
                  pipeline::PeakInFlight(**schedule, s) *
                      RangeSum(problem_.layer_activation_bytes, placement[s]);
      if (s == 0) memory[s] += problem_.first_stage_pinned_bytes;
      if (s == q - 1) memory[s] += problem_.last_stage_pinned_bytes;
    }
    return memory;
  }

 private:
  const RepackProblem& problem_;
  std::map<std::pair<int, int>, pipeline::Schedule> schedules_;  // (stages, forward-only)
};

// The coarsening of `current` that cuts after the old stages in `cuts` (ascending indices
// of old stages that end a new stage, the last old stage implied).
Placement Coarsen(const Placement& current, const std::vector<int>& cuts) {
  Placement out;
  int64_t begin = current.front().begin;
  for (int cut : cuts) {
    out.push_back({begin, current[cut].end});
    begin = current[cut].end;
  }
  out.push_back({begin, current.back().end});
  return out;
}

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
// stages: 8 million). For each stage count q, the coarsening of `current` into q groups of
// consecutive old stages with the smallest bottleneck — the largest per-micro-batch F+B+W
// of a group, the embedding's cost on the first group and the head's on the last — among
// those whose every group fits the memory budget, is found exactly by dynamic programming
// over the old stage boundaries, O(q·p²). The bottleneck is what bounds a pipeline's
// steady state, so this is the q-stage candidate most likely to keep the predicted time;
// it is then simulated like any other. Returns the cut indices (as Coarsen takes them), or
// nothing when no q-grouping fits the budget.
std::optional<std::vector<int>> LeastBottleneckCuts(const RepackProblem& problem,
                                                    const Placement& current, int q,
                                                    const pipeline::Schedule& schedule) {
  const int p = static_cast<int>(current.size());
  // prefix[i]: the per-micro-batch F+B+W and the state bytes of old stages [0, i); the
  // activation bytes likewise (times the group's in-flight count below).
  std::vector<double> work(p + 1, 0), state(p + 1, 0), activations(p + 1, 0);
  for (int i = 0; i < p; ++i) {
    work[i + 1] = work[i] + RangeSum(problem.layer_forward, current[i]) +
                  RangeSum(problem.layer_backward, current[i]) +
                  RangeSum(problem.layer_weight, current[i]);
    state[i + 1] = state[i] + RangeSum(problem.layer_state_bytes, current[i]);
    activations[i + 1] = activations[i] + RangeSum(problem.layer_activation_bytes, current[i]);
  }
  const auto pinned_work = [](const pipeline::ActionCosts& c) {
    return c.forward + c.backward_input + c.backward_weight;
  };
  // Group g (of q) made of old stages [i, j): its cost, or +inf when over the budget.
  const double kInf = std::numeric_limits<double>::infinity();
  auto group_cost = [&](int g, int i, int j) {
    double memory = state[j] - state[i] +
                    pipeline::PeakInFlight(schedule, g) * (activations[j] - activations[i]);
    double cost = work[j] - work[i];
    if (g == 0) {
      memory += problem.first_stage_pinned_bytes;
      cost += pinned_work(problem.first_stage);
    }
    if (g == q - 1) {
      memory += problem.last_stage_pinned_bytes;
      cost += pinned_work(problem.last_stage);
    }
    return memory > problem.memory_budget ? kInf : cost;
  };
  // best[g][j]: the least bottleneck of groups 0..g covering old stages [0, j);
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
    cuts[g - 1] = j - 1;  // old stage j-1 ends group g-1
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

absl::Status CheckRepackSupported(const std::string& schedule, int num_chunks) {
  // The schedule decides its chunks (ZB-V takes 2 whatever is asked): make it for one stage.
  absl::StatusOr<pipeline::Schedule> made =
      pipeline::MakeSchedule(schedule, 1, 1, std::max(num_chunks, 1));
  const int chunks = made.ok() ? made->num_chunks : num_chunks;
  if (chunks <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "re-packing (--repack) does not support virtual pipeline stages: --pipeline_schedule=",
      schedule, " with --virtual_pipeline_model_parallel_size=", num_chunks, " runs ", chunks,
      " model chunks per stage, and re-packing merges one-chunk stages only; use a one-chunk "
      "schedule (1f1b, zbh1, zbh2 without virtual stages) or drop --repack"));
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
  return absl::OkStatus();
}

namespace {

absl::Status CheckPlacement(const RepackProblem& problem, const Placement& placement) {
  BalanceProblem shape;
  shape.num_stages = static_cast<int>(placement.size());
  shape.layer_cost.assign(problem.num_layers(), 0.0);
  if (placement.empty()) return absl::InvalidArgumentError("repack: an empty placement");
  return ValidatePlacement(shape, placement);
}

}  // namespace

absl::StatusOr<double> PredictIterationTime(const RepackProblem& problem,
                                            const Placement& placement) {
  if (auto s = ValidateRepackProblem(problem); !s.ok()) return s;
  if (auto s = CheckRepackSupported(problem.schedule, problem.num_chunks); !s.ok()) {
    return absl::FailedPreconditionError(s.message());
  }
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
  if (auto s = CheckRepackSupported(problem.schedule, problem.num_chunks); !s.ok()) {
    return absl::FailedPreconditionError(s.message());
  }
  if (auto s = CheckPlacement(problem, current); !s.ok()) return s;
  if (auto s = options.Validate(); !s.ok()) return s;
  Evaluator evaluator(problem);
  RepackPlan plan;
  plan.placement = current;
  const int p = static_cast<int>(current.size());
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

  // Admissible (NOTE [re-packing decision]): fits the budget and the slowdown bound.
  absl::Status error = absl::OkStatus();
  auto evaluate = [&](const Placement& candidate, double* time, double* peak) -> bool {
    ++plan.candidates;
    absl::StatusOr<std::vector<double>> memory = evaluator.Memory(candidate);
    if (!memory.ok()) {
      error = memory.status();
      return false;
    }
    *peak = *std::max_element(memory->begin(), memory->end());
    if (*peak > problem.memory_budget) return false;
    absl::StatusOr<double> t = evaluator.Time(candidate);
    if (!t.ok()) {
      error = t.status();
      return false;
    }
    *time = *t;
    return *time <= bound;
  };

  if (p <= options.exhaustive_up_to) {
    // Fewest stages first; within a count, the fastest, then the smallest ends (the
    // combinations come in lexicographic order and only a strictly faster one replaces).
    for (int q = options.min_stages; q < p && !plan.repack; ++q) {
      ForEachCombination(p - 1, q - 1, [&](const std::vector<int>& cuts) {
        const Placement candidate = Coarsen(current, cuts);
        double time = 0, peak = 0;
        if (evaluate(candidate, &time, &peak) && (!plan.repack || time < plan.predicted_after)) {
          plan.repack = true;
          plan.placement = candidate;
          plan.predicted_after = time;
          plan.peak_memory = peak;
        }
        return error.ok();
      });
      if (!error.ok()) return error;
    }
  } else {
    // NOTE [re-packing by bottleneck]: fewest stages first, one candidate per count.
    for (int q = options.min_stages; q < p && !plan.repack; ++q) {
      // The candidate's memory bound counts every stage's in-flight micro-batches, frozen
      // ones too (conservative); evaluate() then predicts it exactly.
      absl::StatusOr<const pipeline::Schedule*> schedule = evaluator.ScheduleFor(q, 0);
      if (!schedule.ok()) return schedule.status();
      const std::optional<std::vector<int>> cuts = LeastBottleneckCuts(problem, current, q, **schedule);
      if (!cuts.has_value()) continue;
      const Placement candidate = Coarsen(current, *cuts);
      double time = 0, peak = 0;
      if (evaluate(candidate, &time, &peak)) {
        plan.repack = true;
        plan.placement = candidate;
        plan.predicted_after = time;
        plan.peak_memory = peak;
      }
      if (!error.ok()) return error;
    }
  }
  if (p > options.exhaustive_up_to) {
    // Also first fit over adjacent pairs, leftmost first, until no merge is admissible; it
    // wins when it reaches fewer stages (or as many, faster) than the least-bottleneck
    // candidates — e.g. when those all run too slow.
    Placement packed = current;
    double packed_time = 0, packed_peak = 0;
    bool merged = true;
    while (merged && static_cast<int>(packed.size()) > options.min_stages) {
      merged = false;
      for (size_t s = 0; s + 1 < packed.size(); ++s) {
        Placement candidate = packed;
        candidate[s].end = candidate[s + 1].end;
        candidate.erase(candidate.begin() + static_cast<std::ptrdiff_t>(s) + 1);
        double time = 0, peak = 0;
        if (evaluate(candidate, &time, &peak)) {
          packed = std::move(candidate);
          packed_time = time;
          packed_peak = peak;
          merged = true;
          break;
        }
        if (!error.ok()) return error;
      }
    }
    const bool fewer = packed.size() < plan.placement.size();
    if (packed.size() < current.size() &&
        (fewer || (packed.size() == plan.placement.size() && packed_time < plan.predicted_after))) {
      plan.repack = true;
      plan.placement = std::move(packed);
      plan.predicted_after = packed_time;
      plan.peak_memory = packed_peak;
    }
  }

  if (plan.repack) {
    plan.note = absl::StrFormat(
        "repack: %d → %d stages, %s → %s; predicted iteration %.4g → %.4g (%+.1f%%, allowed "
        "%+.1f%%), peak stage memory %.4g",
        p, static_cast<int>(plan.placement.size()), FormatPlacement(current),
        FormatPlacement(plan.placement), plan.predicted_before, plan.predicted_after,
        100.0 * (plan.predicted_after / plan.predicted_before - 1.0), 100.0 * options.max_slowdown,
        plan.peak_memory);
  } else {
    plan.note = absl::StrFormat(
        "repack: keep %d stages; no coarsening onto ≥ %d stages fits the memory budget with a "
        "predicted slowdown ≤ %.1f%% (%d tried)",
        p, options.min_stages, 100.0 * options.max_slowdown, plan.candidates);
  }
  return plan;
}

absl::StatusOr<Placement> EvenCoarsening(const Placement& current, int num_stages) {
  const int p = static_cast<int>(current.size());
  if (num_stages < 1 || num_stages > p) {
    return absl::InvalidArgumentError(absl::StrCat("cannot pack ", p, " pipeline stages onto ",
                                                   num_stages, "; expected 1..", p));
  }
  std::vector<int> cuts;
  int end = 0;
  for (int g = 0; g + 1 < num_stages; ++g) {
    end += p / num_stages + (g < p % num_stages ? 1 : 0);
    cuts.push_back(end - 1);
  }
  return Coarsen(current, cuts);
}

}  // namespace fulcrum::dynamic
