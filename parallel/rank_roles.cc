#include "parallel/rank_roles.h"

#include "absl/strings/str_format.h"
#include <c10/util/Exception.h>

namespace fulcrum::parallel {

RankRoles RankRolesOf(const ParallelConfig& config, int rank) {
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank < config.world_size, "rank ", rank,
                        " outside the world of ", config.ToString());
  const RankCoords c = config.Coords(rank);
  RankRoles roles;
  roles.world_rank = rank;
  roles.world_size = config.world_size;
  roles.tp_size = config.tp;
  roles.pp_size = config.pp;
  roles.ep_size = config.ep;
  roles.dp_rank = c.dp;
  roles.dp_size = config.dp();
  // The model-parallel group lists its members stage by stage, tensor-parallel rank within
  // a stage (ParallelConfig::GroupOf), so this is the rank's index in that group.
  roles.model_parallel_rank = c.pp * config.tp + c.tp;
  roles.model_parallel_size = config.tp * config.pp;
  // The rank that owns the loss: last pipeline stage, first tensor- and data-parallel rank.
  roles.is_logging_rank = c.tp == 0 && c.dp == 0 && c.pp == config.pp - 1;
  // Data-parallel replicas hold identical state, except that the ranks of an expert-
  // parallel group hold different experts: the first replica saves everything, the other
  // members of its expert-parallel group their experts.
  if (c.dp == 0) {
    roles.checkpoint_part = CheckpointPart::kEverything;
  } else if (c.edp == 0) {
    roles.checkpoint_part = CheckpointPart::kExpertParallel;
  } else {
    roles.checkpoint_part = CheckpointPart::kNothing;
  }
  // Tensor-parallel shards are gathered to tp rank 0.
  roles.writes_checkpoint_shard = c.tp == 0 && roles.checkpoint_part != CheckpointPart::kNothing;
  roles.commits_checkpoint = rank == 0;
  roles.checkpoint_shard_name = c.ep == 0 ? absl::StrFormat("stage_%03d", c.pp)
                                          : absl::StrFormat("stage_%03d_ep_%03d", c.pp, c.ep);
  return roles;
}

}  // namespace fulcrum::parallel
