// Who this process is in the job, as a plain value: its place in the tp × pp × ep × dp
// layout and the duties that follow from it (who logs, what it saves to a checkpoint).
// Nothing here talks to other ranks; parallel/rank_roles.h derives the value from a
// ParallelConfig and the rank, and the default value is the one-process job.
#pragma once

#include <string>

namespace fulcrum {

/// What a rank's tensor-parallel group saves to a checkpoint: everything (data-parallel
/// rank 0), only expert-parallel parameters (the other ranks of the first expert-parallel
/// group, which hold other experts), or nothing (replicas). The group gathers its shards;
/// tensor-parallel rank 0 writes them.
enum class CheckpointPart { kNothing, kExpertParallel, kEverything };

/// This rank's roles. Defaults: the single process of a one-process job, which does
/// everything.
struct RankRoles {
  int world_rank = 0;
  int world_size = 1;
  int tp_size = 1;
  int pp_size = 1;
  int ep_size = 1;
  int dp_rank = 0;
  int dp_size = 1;
  /// This rank's place among the ranks that hold different parts of one model replica
  /// (tensor × pipeline parallel), 0 .. model_parallel_size − 1, the same order on every
  /// replica: for decisions that need a canonical order of the model's parts.
  int model_parallel_rank = 0;
  int model_parallel_size = 1;
  /// Whether this rank logs iterations and writes the metrics file (one rank per job).
  bool is_logging_rank = true;
  CheckpointPart checkpoint_part = CheckpointPart::kEverything;
  /// Whether this rank writes a checkpoint shard (one rank per distinct part of the model).
  bool writes_checkpoint_shard = true;
  /// Whether this rank commits checkpoints (one rank per job).
  bool commits_checkpoint = true;
  /// Name of this rank's checkpoint shard file, unique among writers.
  std::string checkpoint_shard_name = "rank_00000";
};

}  // namespace fulcrum
