// The problem the pipeline balancers solve, and the measures they are judged by.
//
// A pipeline of p stages holds L transformer layers, each stage a contiguous range of them,
// in order, none empty. A BalanceProblem says what each layer costs (measured time, or a
// parameter count), what is pinned to the first and last stage (embedding; final norm, LM
// head and loss), and how much memory a stage needs; a Placement says which layers each
// stage holds. The balancers (partition.h, diffusion.h) turn a problem, and the current
// placement, into a new placement.
//
// NOTE [bit-equal stage costs]
// Every stage cost and stage memory in this module comes from one StageEvaluator: prefix
// sums accumulated from layer 0 upwards, a range's sum taken as the difference of two
// prefix sums, the pinned part added last. Equal inputs therefore give bit-equal results
// everywhere (a balancer's DP, Bottleneck(), a test's brute force), so "is this placement
// optimal" can be asked with exact double equality. A range's sum may differ from a
// left-to-right sum of its layers by rounding; it is the same rounding for every caller.
//
// NOTE [chunks]
// With virtual pipeline stages (interleaved 1F1B, ZB-V) a rank holds v > 1 model chunks. The
// placement then has one range per VIRTUAL stage, in model order (p·v ranges, contiguous,
// none empty), and BalanceProblem.chunk_rank says which rank holds each (virtual stage k is
// on rank chunk_rank[k]). What the pipeline waits for is a RANK: a rank's cost is the sum
// of its chunks' costs, taken in ascending virtual order (the one order every caller uses,
// so NOTE [bit-equal stage costs] carries over to ranks); its memory is
//   pinned_memory[r] + Σ_{its chunks} (state + activation_multiplier[r] · activations)
// — every chunk's activations count, each with the rank's multiplier (the micro-batches the
// rank keeps in flight per chunk: a bound, as a chunk rarely peaks when the other does). The
// pinned costs follow the model, not the rank: the embedding's on
// virtual stage 0, the head's on virtual stage p·v−1, i.e. on the ranks that hold those
// (ZB-V: both on rank 0). Bottleneck, Imbalance, Potential and FitsMemory are over ranks.
// With chunk_rank empty (v = 1) virtual stage k is rank k and every formula below is the
// one-chunk formula, computed in the same order as before: v = 1 is bit-identical.
//
// Everything here is a pure function of its arguments and safe to call from any thread.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace fulcrum::dynamic {

/// What a balancer decides from: per-layer costs (ms, or parameter counts), pinned costs,
/// memory. Check it with ValidateProblem before use; the functions below assume it is valid.
struct BalanceProblem {
  int num_stages = 0;              ///< Pipeline stages (ranks) p. Must be ≥ 1.
  std::vector<double> layer_cost;  ///< L entries, finite, ≥ 0: what each layer costs.
  double first_stage_cost = 0;     ///< Pinned on (virtual) stage 0: the embedding.
  double last_stage_cost = 0;      ///< Pinned on the last (virtual) stage: norm, head, loss.
  /// NOTE [chunks]: chunk_rank[k] is the rank (0..p-1) that holds virtual stage k, for the
  /// p·v virtual stages in model order; every rank holds at least one. Empty: one chunk per
  /// rank, virtual stage k = rank k (v = 1).
  std::vector<int> chunk_rank;

  // Memory, in bytes (with chunks: per rank, NOTE [chunks]). Stage s holding [b, e) needs
  //   pinned_memory[s] + Σ_{l∈[b,e)} layer_state_bytes[l]
  //                    + activation_multiplier[s] · Σ_{l∈[b,e)} layer_activation_bytes[l]
  // which must be ≤ memory_budget. Empty vectors mean zeros (the multiplier: ones).
  std::vector<double> layer_state_bytes;       ///< L entries or none: weights, grads, optimizer.
  std::vector<double> layer_activation_bytes;  ///< L entries or none: per micro-batch in flight.
  std::vector<double> activation_multiplier;   ///< p entries or none: micro-batches in flight.
  std::vector<double> pinned_memory;           ///< p entries or none: embedding/head state.
  /// Default: unlimited.
  double memory_budget = std::numeric_limits<double>::infinity();

  int64_t num_layers() const { return static_cast<int64_t>(layer_cost.size()); }
  /// Ranges a placement has: p·v (chunk_rank's size), or p when chunk_rank is empty.
  int num_virtual_stages() const {
    return chunk_rank.empty() ? num_stages : static_cast<int>(chunk_rank.size());
  }
  /// The rank that holds virtual stage k.
  int RankOf(int virtual_stage) const {
    return chunk_rank.empty() ? virtual_stage : chunk_rank[virtual_stage];
  }
};

/// Megatron's interleaved layout as a chunk_rank map: virtual k on rank k % p.
std::vector<int> InterleavedChunkRanks(int num_stages, int num_chunks);
/// ZB-V's layout (two chunks per rank): virtual k < p on rank k, k ≥ p on rank 2p−1−k.
std::vector<int> VShapeChunkRanks(int num_stages);

/// The layers of one stage: global layer indices [begin, end).
struct StageRange {
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end - begin; }
  friend bool operator==(const StageRange& a, const StageRange& b) {
    return a.begin == b.begin && a.end == b.end;
  }
  friend bool operator!=(const StageRange& a, const StageRange& b) { return !(a == b); }
};

/// One range per (virtual) stage, in model order; valid when contiguous, non-empty and
/// covering layers 0..L-1 (ValidatePlacement). NOTE [chunks].
using Placement = std::vector<StageRange>;

/// OK, or InvalidArgument naming the field: num_stages < 1, a vector of the wrong size, or
/// a negative, NaN or infinite entry (memory_budget may be +infinity), a chunk_rank entry
/// outside 0..p-1 or a rank that holds no chunk. A problem with fewer layers than virtual
/// stages is valid data; the balancers refuse it.
absl::Status ValidateProblem(const BalanceProblem& problem);

/// OK, or the InvalidArgument every balancer returns when there are fewer layers than
/// (virtual) stages ("N layers cannot fill P pipeline stages ...").
absl::Status CheckEnoughLayers(const BalanceProblem& problem);

/// OK, or InvalidArgument naming the stage: one range per (virtual) stage, the first at 0,
/// each beginning where the previous ends, none empty, the last ending at L.
absl::Status ValidatePlacement(const BalanceProblem& problem, const Placement& placement);

/// Megatron's even split of `num_layers` layers over `num_stages` stages: every stage gets
/// num_layers / num_stages layers, the first num_layers % num_stages stages one more.
/// Stages are empty when num_layers < num_stages.
Placement UniformPlacement(int64_t num_layers, int num_stages);

/// O(1) stage costs and memory from prefix sums (NOTE [bit-equal stage costs]). Holds
/// copies of what it needs, so it may outlive the problem. Requires a valid problem; a
/// range must lie within [0, L] with begin ≤ end.
class StageEvaluator {
 public:
  explicit StageEvaluator(const BalanceProblem& problem);

  int num_stages() const { return num_stages_; }
  int64_t num_layers() const { return static_cast<int64_t>(cost_prefix_.size()) - 1; }
  /// NOTE [chunks]: p·v, or p without chunks.
  int num_virtual_stages() const { return static_cast<int>(chunk_rank_.size()); }
  bool has_chunks() const { return has_chunks_; }
  int RankOf(int virtual_stage) const { return chunk_rank_[virtual_stage]; }
  double memory_budget() const { return memory_budget_; }

  /// The layers' costs in `range` plus what is pinned on (virtual) stage `stage`.
  double StageCost(int stage, StageRange range) const;
  /// The memory `stage` needs when it holds `range` (formula at BalanceProblem). One chunk
  /// per rank only: with chunks a rank's memory is RankMemory's.
  double StageMemory(int stage, StageRange range) const;
  /// StageMemory(stage, range) ≤ memory_budget. One chunk per rank only.
  bool Fits(int stage, StageRange range) const;
  /// StageCost of every (virtual) stage of `placement`.
  std::vector<double> StageCosts(const Placement& placement) const;

  // NOTE [chunks]. Without chunks these equal the per-stage functions above, bit for bit.
  /// Virtual stage k's share of its rank's memory: state + multiplier · activations.
  double ChunkMemory(int virtual_stage, StageRange range) const;
  /// Each rank's cost: its chunks' StageCost summed in ascending virtual order (p entries).
  std::vector<double> RankCosts(const Placement& placement) const;
  /// Each rank's memory: pinned_memory, then its chunks' ChunkMemory in ascending virtual
  /// order (p entries).
  std::vector<double> RankMemories(const Placement& placement) const;
  /// The largest RankCost.
  double Bottleneck(const Placement& placement) const;
  /// Every rank's memory within the budget.
  bool FitsMemory(const Placement& placement) const;

 private:
  int num_stages_ = 0;
  bool has_chunks_ = false;
  std::vector<int> chunk_rank_;            // p·v entries (the identity without chunks).
  double first_stage_cost_ = 0;
  double last_stage_cost_ = 0;
  double memory_budget_ = 0;
  std::vector<double> cost_prefix_;        // L+1 entries; [0] = 0.
  std::vector<double> state_prefix_;       // L+1 entries.
  std::vector<double> activation_prefix_;  // L+1 entries.
  std::vector<double> multiplier_;         // p entries.
  std::vector<double> pinned_memory_;      // p entries.
};

/// The layers' costs in `range` plus the cost pinned on (virtual) stage `stage`.
double StageCost(const BalanceProblem& problem, int stage, StageRange range);
/// The memory `stage` needs when it holds `range` (formula at BalanceProblem; one chunk
/// per rank only).
double StageMemory(const BalanceProblem& problem, int stage, StageRange range);
/// StageCost of every (virtual) stage.
std::vector<double> StageCosts(const BalanceProblem& problem, const Placement& placement);
/// Every rank's cost (NOTE [chunks]); StageCosts when there are no chunks.
std::vector<double> RankCosts(const BalanceProblem& problem, const Placement& placement);
/// Every rank's memory (NOTE [chunks]).
std::vector<double> RankMemories(const BalanceProblem& problem, const Placement& placement);
/// The largest rank cost: what the pipeline's iteration time follows.
double Bottleneck(const BalanceProblem& problem, const Placement& placement);
/// The largest (virtual) stage cost: with chunks, the costliest chunk (ZB-V's first
/// criterion, NOTE [partition under chunks] in partition.h); Bottleneck without.
double LargestChunk(const BalanceProblem& problem, const Placement& placement);
/// ZB-V's V shape: 2p virtual stages, rank r holding virtual r and 2p−1−r.
bool IsVShape(const BalanceProblem& problem);
/// (max − min) / mean of the rank costs; 0 when the mean is 0. DESIGN.md's ΔL.
double Imbalance(const BalanceProblem& problem, const Placement& placement);
/// Σ_{u<v} |L_u − L_v| over all pairs of ranks (DynMo (Wahib et al., SC'25) §3.3's φ).
double Potential(const BalanceProblem& problem, const Placement& placement);
/// Potential of given stage loads. Computed on the sorted loads, so a permutation of the
/// same loads gives a bit-equal value.
double PotentialOfLoads(std::vector<double> loads);
/// Every rank's memory is within the memory budget.
bool FitsMemory(const BalanceProblem& problem, const Placement& placement);

/// "[0,3) [3,8)", for logs and test messages.
std::string FormatPlacement(const Placement& placement);

/// How many layers have a different owner stage in `to` than in `from` (a layer covered by
/// only one of them counts as moved): the layers a migration would send.
int64_t LayersMoved(const Placement& from, const Placement& to);

}  // namespace fulcrum::dynamic
