#include "pipeline/measured_order.h"

#include <cmath>
#include <limits>

namespace fulcrum::pipeline {

std::optional<ActionCosts> MeanActionCosts(const ActionCosts& total, double actions) {
  ActionCosts mean;
  mean.forward = total.forward / actions;
  mean.backward_input = total.backward_input / actions;
  mean.backward_weight = total.backward_weight / actions;
  for (double c : {mean.forward, mean.backward_input, mean.backward_weight}) {
    if (!std::isfinite(c) || c <= 0) return std::nullopt;
  }
  return mean;
}

std::optional<ActionCosts> MeanChunkCosts(const std::vector<StageLoad>& loads, int microbatches) {
  if (microbatches < 1) return std::nullopt;
  double forward = 0, backward = 0, weight = 0;
  int chunks = 0;
  for (const StageLoad& load : loads) {
    if (load.chunk_ranges.empty() || load.chunk_forward_ms.size() != load.chunk_ranges.size() ||
        load.chunk_backward_ms.size() != load.chunk_ranges.size() ||
        load.chunk_weight_ms.size() != load.chunk_ranges.size()) {
      return std::nullopt;
    }
    for (size_t c = 0; c < load.chunk_ranges.size(); ++c) {
      forward += load.chunk_forward_ms[c];
      backward += load.chunk_backward_ms[c];
      weight += load.chunk_weight_ms[c];
      ++chunks;
    }
  }
  if (chunks == 0) return std::nullopt;
  return MeanActionCosts(ActionCosts{forward, backward, weight},
                         static_cast<double>(chunks) * microbatches);
}

std::vector<Schedule> VOrderCandidates(int num_stages, int microbatches, const ActionCosts& mean) {
  std::vector<Schedule> candidates =
      ZeroBubbleVOrdersAt(num_stages, microbatches, mean.forward, mean.backward_input,
                          mean.backward_weight, 0);
  candidates.push_back(ZeroBubbleV(num_stages, microbatches));
  return candidates;
}

size_t FastestVOrder(const std::vector<Schedule>& candidates,
                     const std::vector<ActionCosts>& virtual_costs, int forward_only) {
  size_t best = 0;
  double best_makespan = std::numeric_limits<double>::infinity();
  for (size_t k = 0; k < candidates.size(); ++k) {
    // A frozen prefix removes its stages' B and W: the order that is fastest with them can
    // be slower without (its lists wait on those stages' backward hand-offs), so each
    // candidate is timed as it would run.
    const double makespan =
        forward_only == 0
            ? Simulate(candidates[k], virtual_costs).makespan
            : Simulate(WithForwardOnlyPrefix(candidates[k], forward_only), virtual_costs).makespan;
    if (makespan < best_makespan) {
      best = k;
      best_makespan = makespan;
    }
  }
  return best;
}

bool MeasuredVOrder::Observe(const std::vector<StageLoad>& loads, int microbatches) {
  const std::optional<ActionCosts> mean = MeanChunkCosts(loads, microbatches);
  if (!mean) return false;  // Keep the order there is.
  if (costs_) {
    auto near = [](double now, double built) {
      return std::abs(now - built) <= kRebuildTolerance * built;
    };
    if (near(mean->forward, costs_->forward) &&
        near(mean->backward_input, costs_->backward_input) &&
        near(mean->backward_weight, costs_->backward_weight)) {
      return false;
    }
  }
  costs_ = mean;
  // Each virtual stage's own costs (model order), for choosing between the candidates.
  virtual_costs_.clear();
  const std::vector<int> ranks = ChunkRanks(loads);
  std::vector<int> next_chunk(loads.size(), 0);
  for (int rank : ranks) {
    const StageLoad& load = loads[static_cast<size_t>(rank)];
    const size_t c = static_cast<size_t>(next_chunk[static_cast<size_t>(rank)]++);
    ActionCosts cost;
    cost.forward = load.chunk_forward_ms[c] / microbatches;
    cost.backward_input = load.chunk_backward_ms[c] / microbatches;
    cost.backward_weight = load.chunk_weight_ms[c] / microbatches;
    virtual_costs_.push_back(cost);
  }
  return true;
}

Schedule MeasuredVOrder::Build(int num_stages, int microbatches, int forward_only) const {
  if (!costs_) return WithForwardOnlyPrefix(ZeroBubbleV(num_stages, microbatches), forward_only);
  // The greedy is a heuristic that sees one cost per action kind: its orders under the
  // different rule orders, and the unit order (at few micro-batches on unequal chunks — rank
  // 0 holds the embedding and the head — it can be the faster), are each timed on every
  // virtual stage's own measured costs (on the mean ones when those do not fit this
  // layout); the fastest runs, ties going to the earlier candidate.
  std::vector<Schedule> candidates = VOrderCandidates(num_stages, microbatches, *costs_);
  std::vector<ActionCosts> costs(static_cast<size_t>(num_stages), *costs_);
  if (virtual_costs_.size() == 2 * static_cast<size_t>(num_stages)) costs = virtual_costs_;
  return WithForwardOnlyPrefix(
      std::move(candidates[FastestVOrder(candidates, costs, forward_only)]), forward_only);
}

}  // namespace fulcrum::pipeline
