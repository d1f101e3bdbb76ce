// The distributed checkpoint protocol of a training run: which rank gathers, writes and
// commits what, around which barriers, and how a load restores a model's units and checks
// the checkpoint against the run. One call each way (SaveCheckpoint, LoadCheckpoint); the
// Trainer only says what to save and takes what was loaded.
//
// It lives in core/ beside the trainer, not in core/checkpoint/: that folder is the
// fulcrum_checkpoint library below the model (safetensors, manifest, atomic commit; it
// links no model code), while the protocol needs the model's units (Unit::StateTensors),
// the rank roles and the trainer's configuration, which are fulcrum_core's.
//
// Not thread-safe; SaveCheckpoint is collective over the whole job.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/optimizer/optimizer.h"
#include "core/parallel_context.h"
#include "core/rank_roles.h"
#include "core/training_manifest.h"
#include "core/unit.h"

namespace fulcrum {

namespace ckpt {
class CheckpointReader;
}  // namespace ckpt

struct TrainerConfig;  // core/trainer.h

/// Where every layer of the model is now, as a checkpoint records it (its manifest's
/// layer_placement): each pipeline stage's range, in stage order; with model chunks (NOTE
/// [model chunks]) every chunk's range, in layer order, so the checkpoint stays
/// layout-free and loads under any schedule. Collective over the pipeline group (layers may
/// have moved between stages, so it is gathered at every save).
std::vector<std::pair<int64_t, int64_t>> GatherLayerPlacement(const GptModel& stage,
                                                              ParallelContext& collectives);

/// The collectives a save runs, as plain functions (a test stands in for a job with
/// threads). CheckpointCollectivesOf gives those of a ParallelContext.
struct CheckpointCollectives {
  /// Waits for every rank of the job.
  std::function<void()> barrier;
  /// Sums each value over every rank of the job (data and model parallel), in place.
  std::function<void(std::vector<double>&)> sum_over_job;
  /// All-gathers a tensor-parallel shard along `dim` into the full tensor; null when the
  /// model is not sharded (tp == 1).
  Unit::ShardGatherer gather_shard;
};
CheckpointCollectives CheckpointCollectivesOf(ParallelContext& collectives);

/// One save: where, which iteration, what the manifest records.
struct CheckpointSave {
  FileSystem* fs = nullptr;
  std::string dir;         // --save: the save directory (NOTE [checkpoint directory layout]).
  int64_t iteration = 0;
  /// The caller's manifest fields (TrainingManifestToJson); used by the committing rank.
  nlohmann::json manifest_fields;
  /// --save_keep_last: after a commit, keep only the newest this many; 0 keeps all.
  int64_t keep_last = 0;
  /// --ckpt_format=sharded (NOTE [sharded checkpoints] in core/checkpoint/manifest_json.h):
  /// every rank writes the pieces it holds — a tensor-parallel shard as its box, an
  /// optimizer's moment slice as a flat range of it — into its own file, and nothing is
  /// gathered. False: the tensor-parallel group gathers whole tensors to one writer.
  bool sharded = false;
  /// The optimizer's moment slices when it holds the moments sliced (Optimizer::SlicesState:
  /// the units hold none); sharded saves only.
  std::optional<std::vector<MomentSlice>> moment_slices;
  /// An error this rank met preparing the save (e.g. the optimizer could not give its
  /// slices): the save then fails on every rank, reported, without a hang.
  absl::Status local_status;
};

/// Saves the state of `units` (this rank's part of the model) under `roles`' duties: the
/// tensor-parallel group gathers its shards and the shard writers write them (full), or
/// every rank writes what it holds (sharded); the committing rank begins, commits (and
/// prunes to keep_last) or aborts. Every rank passes every
/// barrier whatever fails, so a failure on one rank is reported on the committing rank,
/// never turned into a hang; a failed save leaves the earlier checkpoints untouched.
/// Collective over the whole job.
absl::Status SaveCheckpoint(const CheckpointSave& save, const std::vector<Unit*>& units,
                            const RankRoles& roles, const CheckpointCollectives& collectives);

/// What a loading run is, for the checks against the checkpoint (NOTE [resume checks],
/// NOTE [finetune]).
struct CheckpointLoad {
  const TrainerConfig* config = nullptr;  // Its TrainOptions::finetune picks the way in.
  DataIdentity data;
  int64_t data_max_token = 0;  // The largest token id of the run's data.
  bool log_warnings = true;    // The logging rank logs the checks' warnings.
  /// The optimizer's state slots a resume reads for every parameter (Optimizer::StateSlots).
  std::vector<std::string> optimizer_slots;
};

/// Where a load leaves training.
struct LoadedCheckpoint {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  /// The log line saying what was loaded, for after the caller's own steps succeed.
  std::string summary;
};

/// Restores `units` from `reader` and says where training goes on: a resume restores the
/// optimizer state and the default random generator too and goes on at the checkpoint's
/// iteration and data position; with finetune only the weights, from iteration 0. Refuses
/// an imported checkpoint without finetune, data outside the checkpoint's vocabulary, and
/// a run that may not resume it. Not collective.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const ckpt::CheckpointReader& reader,
                                                const std::vector<Unit*>& units,
                                                const CheckpointLoad& load);

}  // namespace fulcrum
