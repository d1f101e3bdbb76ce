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
// Not thread-safe, but for SaveInProgress::Write (NOTE [background saves]); SaveCheckpoint,
// StartSave and FinishSave are collective over the whole job.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/optimizer/optimizer.h"
#include "core/parallel_context.h"
#include "core/rank_roles.h"
#include "core/training_manifest.h"
#include "core/unit.h"

namespace fulcrum {

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
  /// Copy every tensor this rank writes into new CPU memory at StartSave, so the model
  /// may change before the write (NOTE [background saves]). Default: false (the tensors are
  /// written as the units give them; nothing may change them until FinishSave).
  bool snapshot = false;
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
/// Collective over the whole job; a save that fails returns an error on every rank. StartSave,
/// SaveInProgress::Write and FinishSave in turn.
absl::Status SaveCheckpoint(const CheckpointSave& save, const std::vector<Unit*>& units,
                            const RankRoles& roles, const CheckpointCollectives& collectives);

// NOTE [background saves] (--async_save): a save is three phases. StartSave is collective:
// it gathers what this rank writes (tensor-parallel gathers, the committer's Begin, the
// writers' Join) and, with CheckpointSave::snapshot, copies it into memory of its own, so
// the model may go on changing. SaveInProgress::Write serialises, checksums and fsyncs this
// rank's shard and is not collective, so it may run on a thread of its own (BackgroundSave)
// while training goes on. FinishSave is collective again: the committer commits only once
// every writer reported success. Until then `latest` names the previous checkpoint, so a
// crash during the background write loses only the save in flight (NOTE [checkpoint crash
// safety] in core/checkpoint/checkpoint.h). The price is one host copy of what a rank
// writes, held until its write ends.

/// One rank's part of a save between StartSave and FinishSave: the tensors it writes and
/// the writer it writes them with. Not copyable; Write may run on another thread than
/// StartSave and FinishSave, never at the same time as them.
class SaveInProgress {
 public:
  SaveInProgress(const SaveInProgress&) = delete;
  SaveInProgress& operator=(const SaveInProgress&) = delete;
  ~SaveInProgress();

  /// Writes this rank's shard, unless the rank writes none or its save already failed (the
  /// failure is then FinishSave's to report). Not collective. Call once.
  void Write();

  int64_t iteration() const { return save_.iteration; }
  /// Seconds StartSave took on this rank: what training waits for with a background save.
  double start_seconds() const { return start_seconds_; }
  /// The bytes of the tensors this rank writes (its snapshot's size with
  /// CheckpointSave::snapshot).
  int64_t bytes() const;

 private:
  friend std::unique_ptr<SaveInProgress> StartSave(const CheckpointSave&,
                                                   const std::vector<Unit*>&, const RankRoles&,
                                                   const CheckpointCollectives&);
  friend absl::Status FinishSave(SaveInProgress&, const CheckpointCollectives&);
  friend class BackgroundSave;
  SaveInProgress();

  CheckpointSave save_;  // Its moment_slices are moved into pieces_ and left empty.
  bool committer_ = false;
  bool writer_ = false;
  bool written_ = false;
  std::string shard_name_;
  NamedTensors tensors_;
  std::vector<ckpt::TensorPiece> pieces_;
  std::unique_ptr<ckpt::CheckpointWriter> ckpt_writer_;
  absl::Status status_;  // This rank's first failure.
  std::chrono::steady_clock::time_point start_;
  double start_seconds_ = 0;
};

/// The collective first phase of a save (NOTE [background saves]): gathers what this rank
/// writes (copied, with save.snapshot), begins the checkpoint on the committer and joins it
/// on the other writers. A failure is kept for FinishSave, never returned early, so every
/// rank goes on through the protocol. Collective over the whole job.
std::unique_ptr<SaveInProgress> StartSave(const CheckpointSave& save,
                                          const std::vector<Unit*>& units, const RankRoles& roles,
                                          const CheckpointCollectives& collectives);

/// The collective last phase: after every rank's Write, the committer commits (and prunes to
/// keep_last) if every rank succeeded, or aborts. Returns this rank's own failure, the
/// save's on the committer, and on every other rank an error saying the checkpoint was not
/// committed: a failed save fails on every rank. Collective over the whole job.
absl::Status FinishSave(SaveInProgress& save, const CheckpointCollectives& collectives);

/// A save whose shard is written on a thread of its own while training goes on (NOTE
/// [background saves]). Used from one thread; the writing thread is its own.
class BackgroundSave {
 public:
  /// Starts writing `save`'s shard. Its tensors must be snapshots (CheckpointSave::snapshot).
  explicit BackgroundSave(std::unique_ptr<SaveInProgress> save);
  /// Waits for the write. A save never finished is neither committed nor aborted: its
  /// temporary directory stays until the next save's Begin removes it.
  ~BackgroundSave();
  BackgroundSave(const BackgroundSave&) = delete;
  BackgroundSave& operator=(const BackgroundSave&) = delete;

  const SaveInProgress& save() const { return *save_; }
  /// Whether this rank's write has ended (successfully or not).
  bool written() const { return written_.load(std::memory_order_acquire); }
  /// Finishes the save if every rank's write has ended (one sum over the job) and returns its
  /// status; nullopt, and nothing done, while some rank is still writing. Collective.
  std::optional<absl::Status> FinishIfWritten(const CheckpointCollectives& collectives);
  /// Waits for this rank's write, then finishes the save. Collective.
  absl::Status Finish(const CheckpointCollectives& collectives);

 private:
  void Join();
  // The writing thread's body: Write, any exception turned into this rank's failure.
  void WriteAndMark();

  std::unique_ptr<SaveInProgress> save_;
  std::atomic<bool> written_{false};
  std::thread thread_;
  bool finished_ = false;
};

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
