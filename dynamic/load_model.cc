// The load model; see load_model.h.
#include "dynamic/load_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum::dynamic {
namespace {

using pipeline::StageLoad;

// OK when `values` has `expected` entries (or none, when `may_be_empty`), each finite ≥ 0.
template <typename T>
absl::Status CheckPerLayer(int stage, const char* field, const std::vector<T>& values,
                           int64_t expected, bool may_be_empty) {
  const auto size = static_cast<int64_t>(values.size());
  if (size != expected && !(may_be_empty && size == 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("stage %d's load has %d %s; expected one per layer of its range (%d)%s",
                        stage, size, field, expected, may_be_empty ? " or none" : ""));
  }
  for (int64_t i = 0; i < size; ++i) {
    const auto value = static_cast<double>(values[i]);
    if (!std::isfinite(value) || value < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stage %d's load has %s[%d] = %g; expected a finite value ≥ 0", stage, field, i, value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckScalar(int stage, const char* field, double value) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stage %d's load has %s = %g; expected a finite value ≥ 0", stage, field, value));
  }
  return absl::OkStatus();
}

int64_t LayerCount(const StageLoad& load) {
  int64_t count = 0;
  for (const auto& [begin, end] : pipeline::HeldRanges(load)) {
    count += std::max<int64_t>(0, end - begin);
  }
  return count;
}

// Calls visit(global layer, index into the load's per-layer vectors) for its layers.
template <typename Visit>
void ForEachLayer(const StageLoad& load, const Visit& visit) {
  int64_t i = 0;
  for (const auto& [begin, end] : pipeline::HeldRanges(load)) {
    for (int64_t l = begin; l < end; ++l) visit(l, i++);
  }
}

// The value of a per-layer vector of `load` for its i-th layer; 0 for an empty vector.
template <typename T>
double At(const std::vector<T>& values, int64_t i) {
  return values.empty() ? 0.0 : static_cast<double>(values[i]);
}

// Per global layer: the sum over stages of what `field` of each stage's load says for the
// layers of its range.
template <typename T>
std::vector<double> PerGlobalLayer(const std::vector<StageLoad>& loads, int64_t num_layers,
                                   std::vector<T> StageLoad::*field) {
  std::vector<double> out(num_layers, 0.0);
  for (const StageLoad& load : loads) {
    const std::vector<T>& values = load.*field;
    ForEachLayer(load, [&](int64_t l, int64_t i) { out[l] = At(values, i); });
  }
  return out;
}

// Each layer's F+B+W.
std::vector<double> LayerTimes(const std::vector<StageLoad>& loads, int64_t num_layers) {
  std::vector<double> out(num_layers, 0.0);
  for (const StageLoad& load : loads) {
    ForEachLayer(load, [&](int64_t l, int64_t i) {
      out[l] = At(load.layer_forward_ms, i) + At(load.layer_backward_ms, i) +
               At(load.layer_weight_ms, i);
    });
  }
  return out;
}

double SumOver(const std::vector<double>& per_layer, StageRange range) {
  double sum = 0;
  for (int64_t l = range.begin; l < range.end; ++l) sum += per_layer[l];
  return sum;
}

// Σ per_layer over rank `rank`'s layers in `placement` (virtual stages; `chunk_rank` as in
// BalanceProblem, empty: stage = rank), its chunks in model order.
double SumOverRank(const std::vector<double>& per_layer, const Placement& placement,
                   const std::vector<int>& chunk_rank, int rank) {
  if (chunk_rank.empty()) return SumOver(per_layer, placement[rank]);
  double sum = 0;
  for (size_t k = 0; k < placement.size(); ++k) {
    if (chunk_rank[k] != rank) continue;
    for (int64_t l = placement[k].begin; l < placement[k].end; ++l) sum += per_layer[l];
  }
  return sum;
}

// Whether `loads` carry a time measurement (NOTE [smoothed times]: all zeros do not).
bool Measured(const std::vector<StageLoad>& loads) {
  for (const StageLoad& load : loads) {
    if (load.forward_ms != 0 || load.backward_ms != 0 || load.weight_ms != 0) return true;
    for (const auto* times :
         {&load.layer_forward_ms, &load.layer_backward_ms, &load.layer_weight_ms}) {
      for (double t : *times) {
        if (t != 0) return true;
      }
    }
  }
  return false;
}

// Median of `values`; the mean of the two middle ones for an even count; 0 for none.
double Median(const std::deque<double>& values) {
  if (values.empty()) return 0.0;
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}


// The rank holding the first (embedding) and the last (head) virtual stage.
int FirstRank(const std::vector<int>& chunk_rank) {
  return chunk_rank.empty() ? 0 : chunk_rank.front();
}
int LastRank(const std::vector<int>& chunk_rank, int num_stages) {
  return chunk_rank.empty() ? num_stages - 1 : chunk_rank.back();
}

// OK when `measured_on` is null or a placement of the loads' layers over their stages.
absl::Status CheckMeasuredOn(const std::vector<StageLoad>& loads, const Placement* measured_on) {
  if (measured_on == nullptr) return absl::OkStatus();
  if (absl::Status s = pipeline::ValidateRanges(ToLayerRanges(*measured_on),
                                                pipeline::NumLayersHeld(loads),
                                                static_cast<int>(PlacementOf(loads).size()));
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the placement the loads were measured on is invalid: ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseBalanceBy(const std::string& text, BalanceBy* out) {
  if (text == "time") {
    *out = BalanceBy::kTime;
  } else if (text == "params") {
    *out = BalanceBy::kParams;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--balance_by='", text, "' is unknown; expected time or params"));
  }
  return absl::OkStatus();
}

const char* BalanceByName(BalanceBy by) { return by == BalanceBy::kTime ? "time" : "params"; }

const char* BalanceUnit(BalanceBy by) { return by == BalanceBy::kTime ? "ms" : "params"; }

absl::Status LoadModelOptions::Validate() const {
  if (by != BalanceBy::kTime && by != BalanceBy::kParams) {
    return absl::InvalidArgumentError("--balance_by: unknown measure; expected time or params");
  }
  if (window < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rebalance_window=", window, " must be ≥ 1 (iterations whose median time is used)"));
  }
  if (std::isnan(memory_budget_bytes) || memory_budget_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--rebalance_memory_budget_mb: a budget of %g bytes per stage; expected > 0 (or none "
        "for no limit)",
        memory_budget_bytes));
  }
  return absl::OkStatus();
}

Placement ToPlacement(const pipeline::LayerRanges& ranges) {
  Placement placement;
  placement.reserve(ranges.size());
  for (const auto& [begin, end] : ranges) placement.push_back({begin, end});
  return placement;
}

pipeline::LayerRanges ToLayerRanges(const Placement& placement) {
  pipeline::LayerRanges ranges;
  ranges.reserve(placement.size());
  for (const StageRange& range : placement) ranges.emplace_back(range.begin, range.end);
  return ranges;
}

Placement PlacementOf(const std::vector<StageLoad>& loads) {
  return ToPlacement(pipeline::CurrentRanges(loads));
}

std::vector<int> ChunkRanksOf(const std::vector<StageLoad>& loads) {
  return pipeline::ChunkRanks(loads);
}

absl::Status ValidateLoads(const std::vector<StageLoad>& loads) {
  if (loads.empty()) return absl::InvalidArgumentError("no stage loads (expected one per stage)");
  const int num_stages = static_cast<int>(loads.size());
  for (int s = 0; s < num_stages; ++s) {
    if (loads[s].stage != s) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the load at index %d says it is stage %d; expected one load per stage, in stage order",
          s, loads[s].stage));
    }
  }
  const bool chunks = !ChunkRanksOf(loads).empty();
  for (int s = 0; s < num_stages; ++s) {
    if (chunks && loads[s].chunk_ranges.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stage %d's load has no chunk_ranges while others have: with virtual pipeline "
          "stages every rank reports its chunks",
          s));
    }
  }
  const Placement placement = PlacementOf(loads);
  if (absl::Status s = pipeline::ValidateRanges(ToLayerRanges(placement),
                                                pipeline::NumLayersHeld(loads),
                                                static_cast<int>(placement.size()));
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the stage loads' ranges are not a placement: ", s.message()));
  }
  for (int s = 0; s < num_stages; ++s) {
    const StageLoad& load = loads[s];
    const int64_t n = LayerCount(load);
    for (const auto& [field, values] : {std::pair{"layer_forward_ms", &load.layer_forward_ms},
                                        std::pair{"layer_backward_ms", &load.layer_backward_ms},
                                        std::pair{"layer_weight_ms", &load.layer_weight_ms},
                                        std::pair{"layer_parameters", &load.layer_parameters}}) {
      if (absl::Status st = CheckPerLayer(s, field, *values, n, /*may_be_empty=*/true); !st.ok()) {
        return st;
      }
    }
    for (const auto& [field, values] :
         {std::pair{"layer_state_bytes", &load.layer_state_bytes},
          std::pair{"layer_activation_bytes", &load.layer_activation_bytes}}) {
      if (absl::Status st = CheckPerLayer(s, field, *values, n, /*may_be_empty=*/true); !st.ok()) {
        return st;
      }
    }
    for (const auto& [field, value] :
         {std::pair{"forward_ms", load.forward_ms}, std::pair{"backward_ms", load.backward_ms},
          std::pair{"weight_ms", load.weight_ms},
          std::pair{"pinned_parameters", load.pinned_parameters},
          std::pair{"parameter_bytes", static_cast<double>(load.parameter_bytes)},
          std::pair{"gradient_bytes", static_cast<double>(load.gradient_bytes)},
          std::pair{"optimizer_bytes", static_cast<double>(load.optimizer_bytes)},
          std::pair{"peak_activation_bytes", static_cast<double>(load.peak_activation_bytes)},
          std::pair{"peak_in_flight", static_cast<double>(load.peak_in_flight)}}) {
      if (absl::Status st = CheckScalar(s, field, value); !st.ok()) return st;
    }
    // The chunks' action totals: one per chunk, or none (a load made without a timeline).
    const auto chunks = static_cast<int64_t>(load.chunk_ranges.size());
    for (const auto& [field, values] : {std::pair{"chunk_forward_ms", &load.chunk_forward_ms},
                                        std::pair{"chunk_backward_ms", &load.chunk_backward_ms},
                                        std::pair{"chunk_weight_ms", &load.chunk_weight_ms}}) {
      if (!values->empty() && static_cast<int64_t>(values->size()) != chunks) {
        return absl::InvalidArgumentError(
            absl::StrFormat("stage %d's load has %d %s; expected one per chunk (%d) or none", s,
                            values->size(), field, chunks));
      }
      for (double v : *values) {
        if (absl::Status st = CheckScalar(s, field, v); !st.ok()) return st;
      }
    }
  }
  return absl::OkStatus();
}

LoadModel::LoadModel(LoadModelOptions options) : options_(std::move(options)) {}

void LoadModel::Push(std::deque<double>* history, double value) const {
  history->push_back(value);
  while (static_cast<int64_t>(history->size()) > std::max(options_.window, 1)) {
    history->pop_front();
  }
}

absl::Status LoadModel::Observe(const std::vector<StageLoad>& loads, const Placement* measured_on) {
  if (absl::Status s = ValidateLoads(loads); !s.ok()) return s;
  if (absl::Status s = CheckMeasuredOn(loads, measured_on); !s.ok()) return s;
  const int num_stages = static_cast<int>(loads.size());
  const int64_t num_layers = pipeline::NumLayersHeld(loads);
  const std::vector<int> chunk_rank = ChunkRanksOf(loads);
  if (num_stages != num_stages_ || num_layers != num_layers_ || chunk_rank != chunk_rank_) {
    Reset();
    num_stages_ = num_stages;
    num_layers_ = num_layers;
    chunk_rank_ = chunk_rank;
    layer_time_.assign(num_layers, {});
  }
  if (!Measured(loads)) return absl::OkStatus();

  const std::vector<double> times = LayerTimes(loads, num_layers);
  const Placement ran_on = measured_on != nullptr ? *measured_on : PlacementOf(loads);
  for (int64_t l = 0; l < num_layers; ++l) Push(&layer_time_[l], times[l]);
  // NOTE [pinned time]: what the stage ran beyond its layers.
  auto residual = [&](int s) {
    const StageLoad& load = loads[s];
    const double total = load.forward_ms + load.backward_ms + load.weight_ms;
    return std::max(0.0, total - SumOverRank(times, ran_on, chunk_rank, s));
  };
  // The embedding's rank and the head's; one residual when they are one rank (one stage,
  // or ZB-V's rank 0), counted as the first stage's.
  const int first_rank = FirstRank(chunk_rank);
  const int last_rank = LastRank(chunk_rank, num_stages);
  Push(&first_stage_time_, residual(first_rank));
  if (last_rank != first_rank) Push(&last_stage_time_, residual(last_rank));
  ++observations_;
  return absl::OkStatus();
}

void LoadModel::Reset() {
  num_stages_ = 0;
  num_layers_ = 0;
  chunk_rank_.clear();
  layer_time_.clear();
  first_stage_time_.clear();
  last_stage_time_.clear();
  observations_ = 0;
}

bool LoadModel::ready() const { return options_.by == BalanceBy::kParams || observations_ > 0; }

absl::StatusOr<BalanceProblem> LoadModel::Problem(const std::vector<StageLoad>& latest,
                                                  const Placement* measured_on) const {
  if (absl::Status s = ValidateLoads(latest); !s.ok()) return s;
  if (absl::Status s = CheckMeasuredOn(latest, measured_on); !s.ok()) return s;
  const int num_stages = static_cast<int>(latest.size());
  const int64_t num_layers = pipeline::NumLayersHeld(latest);
  BalanceProblem problem;
  problem.num_stages = num_stages;
  problem.chunk_rank = ChunkRanksOf(latest);
  const int first_rank = FirstRank(problem.chunk_rank);
  const int last_rank = LastRank(problem.chunk_rank, num_stages);

  if (options_.by == BalanceBy::kTime) {
    if (!ready()) {
      return absl::FailedPreconditionError(
          "the load model has no time measurement yet (--balance_by=time needs one measured "
          "iteration since the start or the last model change)");
    }
    if (num_stages != num_stages_ || num_layers != num_layers_ ||
        problem.chunk_rank != chunk_rank_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the loads place %d layers on %d stages; the times measured since the last reset are "
          "of %d layers on %d stages",
          num_layers, num_stages, num_layers_, num_stages_));
    }
    problem.layer_cost.resize(num_layers);
    for (int64_t l = 0; l < num_layers; ++l) problem.layer_cost[l] = Median(layer_time_[l]);
    problem.first_stage_cost = Median(first_stage_time_);
    problem.last_stage_cost = Median(last_stage_time_);
  } else {
    for (int s = 0; s < num_stages; ++s) {
      const StageLoad& load = latest[s];
      if (static_cast<int64_t>(load.layer_parameters.size()) != LayerCount(load)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "--balance_by=params: stage %d's load has %d layer_parameters for its %d layers", s,
            load.layer_parameters.size(), LayerCount(load)));
      }
    }
    problem.layer_cost = PerGlobalLayer(latest, num_layers, &StageLoad::layer_parameters);
    problem.first_stage_cost = latest[first_rank].pinned_parameters;
    problem.last_stage_cost = last_rank != first_rank ? latest[last_rank].pinned_parameters : 0.0;
  }

  problem.layer_state_bytes = PerGlobalLayer(latest, num_layers, &StageLoad::layer_state_bytes);
  problem.layer_activation_bytes =
      PerGlobalLayer(latest, num_layers, &StageLoad::layer_activation_bytes);
  const Placement now = PlacementOf(latest);
  const Placement& ran_on = measured_on != nullptr ? *measured_on : now;
  problem.activation_multiplier.resize(num_stages);
  problem.pinned_memory.resize(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    const StageLoad& load = latest[s];
    const double multiplier = static_cast<double>(std::max<int64_t>(1, load.peak_in_flight));
    const double pinned_state =
        std::max(0.0, static_cast<double>(load.state_bytes()) -
                          SumOverRank(problem.layer_state_bytes, now, problem.chunk_rank, s));
    const double pinned_activations = std::max(
        0.0, static_cast<double>(load.peak_activation_bytes) -
                 multiplier * SumOverRank(problem.layer_activation_bytes, ran_on,
                                          problem.chunk_rank, s));
    problem.activation_multiplier[s] = multiplier;
    problem.pinned_memory[s] = pinned_state + pinned_activations;
  }
  problem.memory_budget = options_.memory_budget_bytes;
  if (absl::Status s = ValidateProblem(problem); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("the load model built an invalid problem: ", s.message()));
  }
  return problem;
}

}  // namespace fulcrum::dynamic
