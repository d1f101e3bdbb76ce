// ZB-V's order from measured costs: the training runtime (PipelineRunner) and the simulator
// (dynamic::SimulateRun) build the V from the same loads by the same rule, so a replay runs
// the order the live run ran.
//
// NOTE [ZB-V at measured costs]
// ZB-V's fixed order is built for F = B = W per chunk action (NOTE [ZB-V] in schedule.cc).
// Measured costs differ — a chunk of the tiny GPT at pp = 2 on the CPU: F 13.2, B 16.0,
// W 9.4 ms — and then each rank waits for a gradient once per micro-batch: bubble 0.147
// against ZB-H1's 0.073 (fulcrum_train --recipe=tiny --num_layers=8, m = 8). The zero-bubble
// authors build their V from profiled costs; so does this: from the second measured
// iteration on, the order is built at the mean cost of one chunk action of each kind (the
// loads' per-chunk F/B/W totals over all chunks and micro-batches, identical on every rank:
// GatherLoads): of the greedy's orders at those costs (one per rule order it tries,
// ZeroBubbleVOrdersAt) and the unit order, the one whose simulated makespan on each virtual
// stage's own measured costs is the shortest — the greedy sees one cost per kind, the
// chunks are unequal (rank 0 holds the embedding and the head) — each timed as it runs under
// the frozen prefix (its forward-only stages without B and W: an order can be the fastest
// with them and not without; RepackChunksTest.UnderTheMeasuredV...). It is rebuilt only when one
// of the three means has moved by more than
// kRebuildTolerance from those the current order was built for — a new order every
// iteration would follow timing noise. The simulator predicted, on that run's trace, bubble
// 0.035 for the order at costs against 0.137 for the unit order (ZB-H1: 0.073).
// Bits: the order changes when B's and W's run, never what they compute; each chunk's B's
// and W's stay in micro-batch order, and the one tensor two chunks share — the tied word
// embeddings on rank 0 — gathers the head's part apart (NOTE [tied head on the embedding's
// rank] in core/gpt_model.h), so any order trains the same bits.
//
// Pure C++; not thread-safe.
#pragma once

#include <optional>
#include <vector>

#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"

namespace fulcrum::pipeline {

/// The mean cost of one chunk action of each kind (forward, backward_input,
/// backward_weight; p2p 0) from `loads` of a run of `microbatches` micro-batches: every
/// chunk's totals (StageLoad::chunk_forward_ms, ...) summed and divided by the chunk
/// actions. nullopt without chunk totals (one chunk per rank, or nothing measured yet) or
/// when a mean is not finite and positive (a run whose chunks all ran forward only).
std::optional<ActionCosts> MeanChunkCosts(const std::vector<StageLoad>& loads, int microbatches);

/// The mean cost of one chunk action from `total` (F, B and W summed over `actions` chunk
/// actions; p2p ignored): each divided by `actions`; nullopt when a mean is not finite and
/// positive (ZeroBubbleVAt needs all three > 0; the unit-cost order is run then).
/// MeanChunkCosts is this on the loads' totals.
std::optional<ActionCosts> MeanActionCosts(const ActionCosts& total, double actions);

/// The V's MeasuredVOrder chooses among for `num_stages` × `microbatches` at `mean` (one
/// chunk action's mean costs): the greedy's orders at those costs (ZeroBubbleVOrdersAt),
/// then the unit-cost ZeroBubbleV.
std::vector<Schedule> VOrderCandidates(int num_stages, int microbatches, const ActionCosts& mean);

/// The index of the candidate with the shortest makespan simulated on `virtual_costs` (one
/// per virtual stage, model order) with its first `forward_only` virtual stages forward only
/// (WithForwardOnlyPrefix: the order as it runs under a frozen prefix); ties: the first.
/// The re-packing decision predicts with the same rule (dynamic/repack.h). Precondition:
/// `candidates` not empty, each without forward-only stages.
size_t FastestVOrder(const std::vector<Schedule>& candidates,
                     const std::vector<ActionCosts>& virtual_costs, int forward_only = 0);

/// NOTE [ZB-V at measured costs]: which costs the V is built for.
class MeasuredVOrder {
 public:
  /// A relative change of F, B or W beyond this rebuilds the order.
  static constexpr double kRebuildTolerance = 0.10;

  /// Takes the loads of the last measured iteration; true when costs() changed (the order
  /// must be rebuilt): the first measurement, or a mean beyond kRebuildTolerance of costs().
  bool Observe(const std::vector<StageLoad>& loads, int microbatches);
  /// The costs the order is built for; nullopt before the first measurement (unit order).
  const std::optional<ActionCosts>& costs() const { return costs_; }
  /// ZB-V for `num_stages` × `microbatches` with its first `forward_only` virtual stages
  /// forward only (NOTE [forward-only stages]): without costs() ZeroBubbleV; with them the
  /// fastest of VOrderCandidates(costs()) as each runs with that prefix (FastestVOrder) on
  /// the measured per-chunk costs.
  Schedule Build(int num_stages, int microbatches, int forward_only = 0) const;

 private:
  std::optional<ActionCosts> costs_;
  std::vector<ActionCosts> virtual_costs_;  // Per virtual stage, model order, with costs_.
};

}  // namespace fulcrum::pipeline
