// The balancing rebalancer; see balancing_rebalancer.h.
#include "dynamic/balancing_rebalancer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "dynamic/diffusion.h"
#include "dynamic/limit_moves.h"
#include "dynamic/partition.h"

namespace fulcrum::dynamic {
namespace {

using pipeline::RebalanceDecision;
using pipeline::StageLoad;

// A cost without its unit: "120.3" (ms), "12.35M" (params).
std::string FormatNumber(double value, const std::string& unit) {
  const double magnitude = std::abs(value);
  if (unit == "params" && magnitude >= 1e9) return absl::StrFormat("%.4gG", value / 1e9);
  if (unit == "params" && magnitude >= 1e6) return absl::StrFormat("%.4gM", value / 1e6);
  if (unit == "params" && magnitude >= 1e3) return absl::StrFormat("%.4gk", value / 1e3);
  return absl::StrFormat("%.4g", value);
}

// "120.3 ms", "12.35M params".
std::string FormatCost(double value, const std::string& unit) {
  return absl::StrCat(FormatNumber(value, unit), " ", unit);
}

// "bottleneck 120.3 → 95.1 ms", with " (−21%)" when `percent`.
std::string FormatChange(double before, double after, const std::string& unit, bool percent) {
  std::string out =
      absl::StrCat("bottleneck ", FormatNumber(before, unit), " → ", FormatCost(after, unit));
  if (percent && before > 0) {
    const double change = 100 * (after - before) / before;
    const char* sign = change < 0 ? "−" : change > 0 ? "+" : "±";
    absl::StrAppendFormat(&out, " (%s%.0f%%)", sign, std::abs(change));
  }
  return out;
}

}  // namespace

absl::Status BalancerOptions::Validate() const {
  if (algorithm != "partition" && algorithm != "diffusion") {
    return absl::InvalidArgumentError(
        absl::StrCat("--rebalancer=", algorithm,
                     " is not a balancing algorithm; expected partition or diffusion"));
  }
  if (absl::Status s = load.Validate(); !s.ok()) return s;
  if (interval < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--rebalance_interval=", interval,
                                                   " must be ≥ 1 (iterations between decisions)"));
  }
  if (!(min_gain >= 0 && min_gain < 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--rebalance_min_gain=%g must be in [0, 1) (the fraction of the bottleneck a new "
        "placement must save)",
        min_gain));
  }
  if (max_moves < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rebalance_max_moves=", max_moves, " must be ≥ 0 (layers per decision; 0 = no cap)"));
  }
  if (diffusion_max_rounds < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--diffusion_max_rounds=", diffusion_max_rounds,
                     " must be ≥ 1 (use --rebalancer=none to never move layers)"));
  }
  return absl::OkStatus();
}

absl::Status CheckLayout(int64_t num_layers, int num_stages) {
  if (num_stages < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--pipeline_model_parallel_size=", num_stages,
                                                   ": a pipeline needs at least one stage"));
  }
  if (num_layers < num_stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_layers=", num_layers, " cannot fill --pipeline_model_parallel_size=", num_stages,
        " pipeline stages: every stage needs at least one layer"));
  }
  return absl::OkStatus();
}

absl::Status CheckLayout(int64_t num_layers, int num_stages, int num_chunks) {
  if (absl::Status s = CheckLayout(num_layers, num_stages); !s.ok() || num_chunks == 1) return s;
  if (num_chunks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--virtual_pipeline_model_parallel_size=",
                                                   num_chunks, ": expected at least 1 chunk"));
  }
  if (num_layers < static_cast<int64_t>(num_stages) * num_chunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_layers=", num_layers, " cannot fill --pipeline_model_parallel_size=", num_stages,
        " × --virtual_pipeline_model_parallel_size=", num_chunks,
        " model chunks: every chunk needs at least one layer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BalancingRebalancer>> BalancingRebalancer::Create(
    BalancerOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::make_unique<BalancingRebalancer>(std::move(options));
}

BalancingRebalancer::BalancingRebalancer(BalancerOptions options)
    : options_(std::move(options)), model_(options_.load) {}

const char* BalancingRebalancer::name() const {
  return options_.algorithm == "diffusion" ? "diffusion" : "partition";
}

absl::StatusOr<Placement> BalancingRebalancer::Propose(const BalanceProblem& problem,
                                                       const Placement& current) const {
  if (options_.algorithm == "diffusion") {
    DiffusionOptions diffusion;
    diffusion.max_rounds = options_.diffusion_max_rounds;
    absl::StatusOr<DiffusionResult> result = DiffusionBalance(problem, current, diffusion);
    if (!result.ok()) return result.status();
    return std::move(result->placement);
  }
  return PartitionBalance(problem, &current);
}

RebalanceDecision BalancingRebalancer::Plan(int64_t iteration,
                                            const std::vector<StageLoad>& loads) {
  metrics_.clear();
  RebalanceDecision decision;
  decision.unit = BalanceUnit(options_.load.by);
  const Placement current = PlacementOf(loads);
  const std::string ranges = FormatPlacement(current);
  auto keep = [&](absl::string_view why) {
    decision.note = absl::StrCat(name(), ": keep ", ranges, ": ", why);
    return decision;
  };

  // NOTE [pinned time after a move]: the placement iteration-1 ran on, if layers moved since.
  Placement ran_on;
  if (last_plan_iteration_ == iteration - 1 && last_plan_ranges_ != current &&
      pipeline::ValidateRanges(ToLayerRanges(last_plan_ranges_),
                               current.empty() ? 0 : current.back().end,
                               static_cast<int>(current.size()))
          .ok()) {
    ran_on = last_plan_ranges_;
  }
  const Placement* measured_on = ran_on.empty() ? nullptr : &ran_on;
  last_plan_iteration_ = iteration;
  last_plan_ranges_ = current;

  // NOTE [rebalance events]: loads measured in iteration ≤ stale_through_ are stale.
  if (iteration - 1 <= stale_through_) return decision;
  if (absl::Status s = model_.Observe(loads, measured_on); !s.ok()) {
    return keep(absl::StrCat("cannot use the measured loads: ", s.message()));
  }
  if (!(decision_due_ || iteration % options_.interval == 0) || !model_.ready()) return decision;
  const std::string forced =
      decision_due_ && !due_reason_.empty() ? absl::StrCat("; ", due_reason_) : "";
  decision_due_ = false;
  due_reason_.clear();

  absl::StatusOr<BalanceProblem> problem = model_.Problem(loads, measured_on);
  if (!problem.ok()) return keep(absl::StrCat(problem.status().message(), forced));
  // A budget that the current placement exceeds and no other meets is the caller's error,
  // whichever algorithm runs: the exact partition decides whether any placement fits.
  if (!FitsMemory(*problem, current)) {
    absl::StatusOr<Placement> fitting = PartitionBalance(*problem, &current);
    if (!fitting.ok() && fitting.status().code() == absl::StatusCode::kResourceExhausted) {
      decision.error = absl::InvalidArgumentError(absl::StrFormat(
          "--rebalance_memory_budget_mb=%g: %s (planning iteration %d)",
          options_.load.memory_budget_bytes / (1024.0 * 1024.0), fitting.status().message(),
          iteration));
      decision.note = absl::StrCat(name(), ": ", decision.error.message());
      return decision;
    }
  }
  absl::StatusOr<Placement> proposal = Propose(*problem, current);
  if (!proposal.ok()) return keep(absl::StrCat(proposal.status().message(), forced));
  // NOTE [rebalance hysteresis]: the gain is the whole proposal's; a capped step towards it
  // must only not make things worse.
  const double before = Bottleneck(*problem, current);
  const double proposed = Bottleneck(*problem, *proposal);
  const double gain = Gain(*problem, current, *proposal);
  // "bottleneck a → b" from the current placement to `to`, and the largest chunk where the
  // gain is judged on it.
  auto change = [&](const Placement& to, bool percent) {
    std::string out = FormatChange(before, Bottleneck(*problem, to), decision.unit, percent);
    if (JudgesLargestChunk(*problem)) {
      absl::StrAppend(&out, ", largest chunk ", FormatNumber(LargestChunk(*problem, current), decision.unit),
                      " → ", FormatCost(LargestChunk(*problem, to), decision.unit));
    }
    return out;
  };
  std::string capped;
  Placement step = *proposal;
  if (options_.max_moves > 0 && LayersMoved(current, *proposal) > options_.max_moves) {
    step = LimitMoves(*problem, current, *proposal, options_.max_moves);
    capped = absl::StrCat("; on the way to ", FormatPlacement(*proposal), " (bottleneck ",
                          FormatCost(proposed, decision.unit),
                          "; --rebalance_max_moves=", options_.max_moves, ")");
  }
  const double after = Bottleneck(*problem, step);
  const bool for_memory = !FitsMemory(*problem, current) && FitsMemory(*problem, step);
  const bool apply =
      step != current && (for_memory || (gain > 0 && gain >= options_.min_gain &&
                                         Gain(*problem, current, step) >= 0 && after <= before));
  const Placement& chosen = apply ? step : current;
  decision.predicted_before = before;
  decision.predicted_after = apply ? after : before;
  metrics_ = {{"predicted_bottleneck", decision.predicted_after},
              {"predicted_imbalance", Imbalance(*problem, chosen)},
              {"predicted_gain", gain}};
  if (apply) {
    decision.target = ToLayerRanges(step);
    decision.note =
        absl::StrCat(name(), ": ", ranges, " → ", FormatPlacement(step), "; ",
                     change(step, /*percent=*/true), capped,
                     for_memory ? "; to fit --rebalance_memory_budget_mb" : "", forced);
    return decision;
  }
  const std::string over =
      FitsMemory(*problem, current) ? "" : "; over --rebalance_memory_budget_mb, no move fits it";
  if (*proposal == current) {
    return keep(absl::StrCat("already balanced (bottleneck ", FormatCost(before, decision.unit),
                             ")", over, forced));
  }
  if (gain > 0 && gain >= options_.min_gain) {  // Worth it; the capped step is not.
    const std::string why =
        step == current
            ? absl::StrCat("no step within --rebalance_max_moves=", options_.max_moves,
                           " fits --rebalance_memory_budget_mb")
            : absl::StrCat("the step within --rebalance_max_moves=", options_.max_moves, ", ",
                           FormatPlacement(step), ", would raise the ",
                           change(step, /*percent=*/false));
    return keep(absl::StrCat(FormatPlacement(*proposal), " would take the ",
                             change(*proposal, /*percent=*/true),
                             " but ", why, over, forced));
  }
  return keep(absl::StrFormat("%s %.1f%% < --rebalance_min_gain %g%% (%s: %s)%s%s",
                              options_.algorithm == "partition" ? "best gain" : "gain", 100 * gain,
                              100 * options_.min_gain, FormatPlacement(*proposal),
                              change(*proposal, /*percent=*/false),
                              over, forced));
}

bool BalancingRebalancer::JudgesLargestChunk(const BalanceProblem& problem) const {
  return problem.num_virtual_stages() > problem.num_stages;
}

double BalancingRebalancer::Gain(const BalanceProblem& problem, const Placement& from,
                                 const Placement& to) const {
  auto fall = [](double a, double b) { return a > 0 ? (a - b) / a : 0.0; };
  if (JudgesLargestChunk(problem)) {
    const double a = LargestChunk(problem, from), b = LargestChunk(problem, to);
    if (a != b) return fall(a, b);
  }
  return fall(Bottleneck(problem, from), Bottleneck(problem, to));
}

void BalancingRebalancer::OnModelChanged(int64_t iteration, const std::string& reason) {
  stale_through_ = std::max(stale_through_, iteration);
  model_.Reset();
  decision_due_ = true;
  due_reason_ = absl::StrCat("after the model changed in iteration ", iteration,
                             reason.empty() ? "" : absl::StrCat(" (", reason, ")"));
}

}  // namespace fulcrum::dynamic
