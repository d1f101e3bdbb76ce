// The roles of a rank (core/rank_roles.h) in a tp × pp × ep × dp layout: pure arithmetic on
// the ParallelConfig, no communicator, so every rank can tell any rank's duties.
#pragma once

#include "core/rank_roles.h"
#include "parallel/parallel_config.h"

namespace fulcrum::parallel {

/// The roles of global rank `rank` (0 .. config.world_size − 1) under `config`, which must
/// be valid (ParallelConfig::Validate).
RankRoles RankRolesOf(const ParallelConfig& config, int rank);

}  // namespace fulcrum::parallel
