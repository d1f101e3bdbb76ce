// Live shrink of a pipeline (DESIGN.md "Re-packing"): after a re-packing decision
// (dynamic/repack.h) merged adjacent stages, the ranks of the first old stage of each
// merged group survive and the others are released. This file is the mechanism's pure
// arithmetic (who survives, the new layout, each rank's new rank) and the exchange of the
// model's state from the old owners to the survivors over the old world communicator.
//
// NOTE [live shrink]
// The shrink happens between iterations, after an optimizer step (gradients are zero then):
//  1. Every rank knows the plan (old ranges → new ranges, a coarsening) and so who survives:
//     in every data-parallel replica, the rank of the first old stage of each group.
//  2. The survivors split the old world (Communicator::Split — a new generation of process
//     groups on the rendezvous store, since c10d cannot shrink a group in place; on NCCL,
//     ncclCommSplit) and build every group of the smaller layout from it; the released
//     ranks take no part in that.
//  3. Every rank then takes part in ExchangeState: a survivor builds the model of its new
//     stage and fills every unit from its old owner with what a layer migration moves
//     (Unit::MigrationTensors: values, Adam moments, step, plugin buffers and the MLP
//     blocks' step state; tensor-parallel shards as they are), bit for bit; a tied output
//     weight's mirror takes the embedding's. Transfers run one by one in a global order
//     every rank computes alike, so blocking sends and receives cannot deadlock.
//     Before building that model the Trainer hands the plugins the new layout
//     (Plugin::OnLayout), so the rebuilt layers use only the new groups (the MoE layers'
//     expert exchange, early exit's head copy).
//  4. Released ranks leave: their old groups are destroyed and they exit 0.
// Any tensor- and expert-parallel size: only pp changes, so a rank's tensor-parallel rank
// t and data-parallel rank d (which holds its expert-parallel rank: dp = edp * ep + ep,
// parallel/parallel_config.h) mean the same shard before and after. A unit's shard moves
// from the old owner stage's rank with coordinates (t, d) to the survivor stage's rank with
// the same (t, d), so every shard — each tensor-parallel slice, each expert-parallel rank's
// experts — keeps its shape and its state.
//
// Not thread-safe; ExchangeState is collective over the old world.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/gpt_model.h"
#include "parallel/communicator.h"
#include "parallel/parallel_config.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::pipeline {

/// A planned shrink: the old layout and placement, and the coarsened placement.
/// With virtual pipeline stages (NOTE [re-packing under chunks] in dynamic/repack.h) the
/// ranges are per virtual stage, in model order, and the owners say which stage holds
/// each; the new stages are groups of consecutive old ones merged chunk by chunk.
struct ShrinkPlan {
  parallel::ParallelConfig old_config;
  LayerRanges old_ranges;  ///< One range per old (virtual) stage.
  LayerRanges new_ranges;  ///< One per new (virtual) stage: unions of consecutive old ranges.
  /// The stage of each old resp. new range (VirtualOwners' stages); empty: range k is on
  /// stage k (one chunk per stage).
  std::vector<int> old_owner;
  std::vector<int> new_owner;
  bool tie_embeddings = true;  ///< The model's (a separate head mirrors the embedding).

  int old_stages() const { return Stages(old_ranges, old_owner); }
  int new_stages() const { return Stages(new_ranges, new_owner); }
  /// The stage that holds (virtual) range k of the old resp. new placement.
  int OldStageOf(int k) const { return old_owner.empty() ? k : old_owner[k]; }
  int NewStageOf(int k) const { return new_owner.empty() ? k : new_owner[k]; }

 private:
  static int Stages(const LayerRanges& ranges, const std::vector<int>& owner) {
    int stages = owner.empty() ? static_cast<int>(ranges.size()) : 0;
    for (int stage : owner) stages = std::max(stages, stage + 1);
    return stages;
  }
};

/// OK when `plan` can be carried out live: old_config valid, old_ranges a placement over
/// old_config.pp stages, new_ranges a coarsening of it with fewer stages, owners (if any)
/// one per range, and every new stage made of old stages no other new stage takes from, the
/// first new stage of old stage 0. InvalidArgument naming what is wrong otherwise.
absl::Status ValidateShrinkPlan(const ShrinkPlan& plan);

/// For each new stage, the old stage whose ranks hold it after the shrink: the first old
/// stage of its group — the old stages whose ranges it takes (old stage 0 keeps the
/// embedding and world rank 0, which hosts the rendezvous store).
std::vector<int> SurvivingStages(const ShrinkPlan& plan);

/// The layout after the shrink: new_stages() stages, the same tp and dp.
parallel::ParallelConfig ShrunkConfig(const ShrinkPlan& plan);

/// The world ranks (old numbering) that survive, ascending — the order of their new world
/// ranks, which follows ShrunkConfig's rank order (pipeline stage slowest).
std::vector<int> SurvivingRanks(const ShrinkPlan& plan);

/// Old world rank `rank`'s rank after the shrink, or -1 when it is released.
int NewRank(const ShrinkPlan& plan, int rank);

/// One unit's state going from old world rank `src` to old world rank `dst` (the same
/// tensor- and data-parallel coordinates; NOTE [live shrink]).
struct ShrinkTransfer {
  int src = 0;
  int dst = 0;
  std::string unit;  ///< "embedding", "layers.<i>", "head".
};

/// Every transfer of the shrink, in the order every rank runs them: replica by replica,
/// tensor-parallel rank by tensor-parallel rank, new stage by new stage, units in global
/// order (NOTE [live shrink] step 3).
std::vector<ShrinkTransfer> ShrinkTransfers(const ShrinkPlan& plan);

/// Moves every unit's state to its owner after the shrink (NOTE [live shrink] step 3):
/// `old_model` is what this rank held before (the old stage), `new_model` the model of its
/// new stage (null on a released rank), built for ShrunkConfig and new_ranges. Collective
/// over `world`, the old world communicator (ranks as in plan.old_config). DataLoss when a
/// unit's state does not fit its new shell; communication failures throw CommError.
absl::Status ExchangeState(parallel::Communicator& world, const ShrinkPlan& plan,
                           const GptModel& old_model, GptModel* new_model);

}  // namespace fulcrum::pipeline
