// The parallel topology of a job as a value: how the world's ranks split into tensor-,
// pipeline-, data-, expert- and expert-data-parallel groups.
//
// NOTE [rank order] Megatron's order: tp varies fastest, then dp, and pp slowest:
//
//   rank = tp_rank + tp * (dp_rank + dp * pp_rank)
//
// so a tensor-parallel group is tp consecutive ranks (one node, fastest links) and a
// pipeline stage is a contiguous block of tp*dp ranks. Expert parallelism is carved out of
// data parallelism: dp_rank = edp_rank * ep + ep_rank, so an expert-parallel group is ep
// consecutive dp ranks (same tp_rank, pp_rank, edp_rank) and an expert-data-parallel group
// joins the ranks holding the same experts (same tp_rank, pp_rank, ep_rank).
//
// Every process computes the same groups from the same ParallelConfig; nothing here talks
// to other processes or reads flags. The rank arithmetic is constexpr and pure.
//
// Thread-safety: a value type; const methods may be called from any thread.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace fulcrum::parallel {

/// The kinds of process groups a ParallelConfig defines.
enum class GroupKind {
  kTensor,      // tp ranks with the same (dp, pp): shard each layer's matrices.
  kPipeline,    // pp ranks with the same (tp, dp): one rank per pipeline stage.
  kData,        // dp ranks with the same (tp, pp): replicas that all-reduce gradients.
  kExpert,      // ep ranks with the same (tp, pp, edp): share out the experts (all-to-all).
  kExpertData,  // edp ranks with the same (tp, pp, ep): replicas of the same experts.
  kModel,       // tp*pp ranks with the same dp: together hold one full copy of the model.
};

/// Every GroupKind, for loops over all of them.
inline constexpr GroupKind kAllGroupKinds[] = {GroupKind::kTensor,     GroupKind::kPipeline,
                                              GroupKind::kData,       GroupKind::kExpert,
                                              GroupKind::kExpertData, GroupKind::kModel};

/// A short name for logs and communicator names: "tp", "pp", "dp", "ep", "edp", "mp".
std::string_view GroupKindName(GroupKind kind);

/// Where one rank sits along each axis (see NOTE [rank order]).
struct RankCoords {
  int tp = 0;   // 0..tp-1
  int dp = 0;   // 0..dp-1; equals edp * ep + ep.
  int pp = 0;   // 0..pp-1: the pipeline stage.
  int ep = 0;   // 0..ep-1: which share of the experts.
  int edp = 0;  // 0..expert_dp-1

  friend constexpr bool operator==(const RankCoords& a, const RankCoords& b) {
    return a.tp == b.tp && a.dp == b.dp && a.pp == b.pp && a.ep == b.ep && a.edp == b.edp;
  }
  friend constexpr bool operator!=(const RankCoords& a, const RankCoords& b) {
    return !(a == b);
  }
};

/// The parallel layout of a job. The data-parallel size is implied: world_size / (tp * pp).
/// Methods other than Validate() and ToString() assume Validate() returned OK; rank
/// arguments must lie in [0, world_size).
struct ParallelConfig {
  int world_size = 1;  // Default: 1. Number of processes in the job.
  int tp = 1;          // Default: 1. Tensor-parallel size (--tensor_model_parallel_size).
  int pp = 1;          // Default: 1. Pipeline stages (--pipeline_model_parallel_size).
  int ep = 1;          // Default: 1. Expert-parallel size (--expert_model_parallel_size);
                       // must divide dp().

  /// Data-parallel size: world_size / (tp * pp); 0 while tp or pp is not positive.
  constexpr int dp() const { return tp > 0 && pp > 0 ? world_size / (tp * pp) : 0; }
  /// Expert-data-parallel size: dp() / ep; 0 while ep is not positive.
  constexpr int expert_dp() const { return ep > 0 ? dp() / ep : 0; }

  /// OK when every size is at least 1, tp * pp divides world_size and ep divides dp();
  /// otherwise InvalidArgument naming the flag and the values, e.g. "world size 6 is not
  /// divisible by --tensor_model_parallel_size=4 × --pipeline_model_parallel_size=1".
  absl::Status Validate() const;

  /// The world rank at (tp_rank, dp_rank, pp_rank).
  constexpr int Rank(int tp_rank, int dp_rank, int pp_rank) const {
    return tp_rank + tp * (dp_rank + dp() * pp_rank);
  }

  /// The coordinates of world rank `rank`; Rank(c.tp, c.dp, c.pp) == rank.
  constexpr RankCoords Coords(int rank) const {
    RankCoords c;
    c.tp = rank % tp;
    c.dp = (rank / tp) % dp();
    c.pp = rank / (tp * dp());
    c.ep = c.dp % ep;
    c.edp = c.dp / ep;
    return c;
  }

  /// Number of ranks in each group of `kind`: tp, pp, dp, ep, expert_dp or tp * pp.
  int GroupSize(GroupKind kind) const;

  /// The world ranks of the group of `kind` that contains `rank`, ascending.
  std::vector<int> GroupOf(GroupKind kind, int rank) const;

  /// Every group of `kind`, ordered by their lowest rank; together they partition the
  /// world. GroupOf(kind, r) is the element containing r. Costs O(world_size * group size).
  std::vector<std::vector<int>> AllGroups(GroupKind kind) const;

  /// E.g. "tp=2 pp=1 ep=1 dp=2 (world 4)".
  std::string ToString() const;
};

}  // namespace fulcrum::parallel
