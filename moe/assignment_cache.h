// DynaMoE's sample-assignment caching (Kossmann, Jia and Aiken 2022, "Optimizing Mixture of
// Experts using Dynamic Recompilations", the DynaMoE library): one MoE layer's memory of
// which experts each corpus token was routed to, and the per-epoch decision to route by it.
//
// NOTE [assignment caching]
// As training converges, a router sends most tokens to the experts it chose for them one
// epoch earlier. Once fewer than a threshold fraction of the tokens met again change
// experts over a whole epoch, the next epoch routes each token by the cached assignment:
// which experts it goes to, and so the capacity, the slots, the dispatch and the all-to-all,
// are known before the router has run, so the experts need not wait for the gate. The MoE
// layer then issues the exchange first and computes the router while it is in flight (one
// rank: runs the experts first) — for a micro-batch whose every token is cached, with the
// padded buffers, no batch-prioritized routing (its slots need the gates) and no chunked
// overlap (whose chunks are issued after routing); otherwise the cached experts are used
// but the router runs first. The router still runs
// for every token: it gives the gates for the cached experts by its usual rule
// (RouteContext::fixed_experts), its auxiliary losses, and its own preference, which keeps
// being compared with the cache and written into it.
//
//  - Identity. A token is its position in the training split (GptDataset), which survives
//    the per-epoch document shuffle (a sample window does not); ForwardContext carries it.
//  - Table. [P, k] expert ids for the P positions of the split, −1 where a token has not
//    been routed yet; it holds the router's own top-k the last time the token was routed
//    (in the routing's best-first order; "changed" compares the sets). Memory: 4·k·P bytes
//    per MoE layer, e.g. 8 MB for 1M tokens at k = 2 — the option suits corpora that are
//    revisited over many epochs, as in the paper's experiments, not single-pass pretraining.
//  - Replication. A token may land on another data-parallel rank in the next epoch, so
//    every replica keeps the whole table: after each optimizer step the step's (position,
//    choice) records are all-gathered over the data-parallel group (ep ranks included) and
//    written in rank order, the same bits everywhere. Routing by the cache is therefore
//    the same under every layout, like the rest of NOTE [MoE layout equivalence].
//  - Decision. The change counts of an epoch (tokens met again that changed / tokens met
//    again, summed over replicas) decide at the first step of the next epoch. A step
//    counts in the epoch of its first sample, so a step that runs into the next epoch adds
//    a few of that epoch's tokens to the one it started in; epoch 0 meets nothing again
//    except through such a step, so it decides nothing and the earliest cached epoch is 2.
//    The decision is re-taken every epoch: if the router drifts past the threshold,
//    routing goes back to live.
//  - State. The table and the epoch's counters are buffers of the layer's unit: saved in
//    checkpoints (a resume continues exactly) and moved with the layer by the rebalancer;
//    the records of a step in progress move as step state.
//
// Evaluation never reads or writes the cache. Needs a token-choice router and a fixed k
// (no top-any schedule): the cache stores k experts per token.
//
// Not thread-safe; owned by one MoE layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.h"

namespace fulcrum {
class Unit;
}

namespace fulcrum::moe {

class AssignmentCache {
 public:
  /// A table for `positions` tokens (the training split's size) of `k` experts each;
  /// routes by it for epochs whose previous epoch changed fewer than `threshold` of the
  /// tokens met again (0 < threshold <= 1).
  AssignmentCache(int64_t positions, int64_t k, double threshold);

  /// Registers the table and the counters as buffers `<prefix>assignment_cache` and
  /// `<prefix>assignment_cache_state` of `unit` (checkpointed, migrated).
  void Register(Unit& unit, const std::string& prefix);

  /// Called by every training forward with the step's data epoch: at the first forward of
  /// a new epoch, decides from the epoch just ended whether to route by the cache.
  void BeginForward(int64_t epoch);

  /// Whether this epoch routes by the cache.
  bool active() const;

  /// [T, k] int64: the cached experts of `positions` [T] (int64 in [0, P)); rows of −1 for
  /// tokens not routed yet.
  at::Tensor Lookup(const at::Tensor& positions) const;

  /// Records one routed micro-batch: `cached` as Lookup returned it, `choice` [T, k] the
  /// router's own top-k (Routing::choice), `routed_by_cache` whether `cached` decided the
  /// experts. Counts the changes; the table is written only in AfterOptimizerStep.
  void Record(const at::Tensor& positions, const at::Tensor& cached, const at::Tensor& choice,
              bool routed_by_cache);

  /// This step's counts on this rank: tokens met again that changed experts, tokens met
  /// again, tokens routed by the cache. The MoE layer sums them over the replicas with its
  /// other statistics and hands the sums to AfterOptimizerStep.
  std::vector<int64_t> StepCounts() const { return {step_changed_, step_met_, step_cached_}; }

  /// Once per optimizer step on every rank of `data` (collective; null for one replica):
  /// writes every replica's records into the table and adds `global_counts` (StepCounts
  /// summed over the replicas) to the epoch's counters.
  void AfterOptimizerStep(parallel::Communicator* data, const std::vector<int64_t>& global_counts);

  /// The records and counts of the step in progress, for a mid-step migration (fp32-exact).
  std::vector<std::pair<std::string, at::Tensor>> StepState() const;
  void LoadStepState(const std::vector<std::pair<std::string, at::Tensor>>& state);

  /// The change fraction of the last completed epoch (−1 before one completed with tokens
  /// met again).
  double last_epoch_change_fraction() const;

 private:
  // Layout of the state buffer (fp32; counts split into exact 24-bit halves).
  enum Slot { kEpoch = 0, kActive, kChangedHigh, kChangedLow, kMetHigh, kMetLow, kLastFraction, kSlots };
  int64_t Count(Slot high) const;
  // This rank's records of the step so far, [n, 1 + k].
  at::Tensor StepRecords() const;
  void SetCount(Slot high, int64_t value);

  int64_t positions_;
  int64_t k_;
  double threshold_;
  at::Tensor table_;  // [P, k] fp32 expert ids, −1 = never routed
  at::Tensor state_;  // [kSlots] fp32
  // The step in progress on this rank.
  std::vector<at::Tensor> records_;  // [T, 1 + k] int64: position, own choice
  int64_t step_changed_ = 0;
  int64_t step_met_ = 0;
  int64_t step_cached_ = 0;
};

}  // namespace fulcrum::moe
