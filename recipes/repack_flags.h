// fulcrum_train's re-packing flags (--repack, --repack_min_stages, --repack_interval,
// --repack_max_slowdown, --repack_script, --repack_via_checkpoint, --on_release_command)
// and what carries a re-packing decision out through a checkpoint (NOTE [relaunch
// protocol] in recipes/relaunch_protocol.h). The decision itself is dynamic/repack.h's.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/trainer.h"
#include "dynamic/repack_trigger.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "pipeline/rebalancer.h"

namespace fulcrum {

/// The re-packing settings of the flags.
struct RepackSettings {
  bool enabled = false;         ///< --repack=auto or a --repack_script.
  bool via_checkpoint = false;  ///< --repack_via_checkpoint.
  dynamic::RepackTriggerOptions trigger;
  std::string on_release_command;
};

/// The re-packing flags, validated against the layout and the training settings before any
/// work: --repack off|auto; a script's steps within the run; a pipeline (pp > 1) with
/// stages to spare; --save for --repack_via_checkpoint; no --rebalance_script (its
/// placements are for the first stage count). Live (the default) works for any tp and ep
/// and every plugin (NOTE [live shrink] in pipeline/shrink.h). `resumed_iteration` is the
/// iteration of the --load checkpoint (nullopt: a fresh run).
/// A script step onto at least the current stage count, or any re-packing at pp = 1, is an
/// error unless the checkpoint is past it: then it is a step the run that saved it already
/// took (a relaunch with the same flags, NOTE [relaunch protocol]).
absl::StatusOr<RepackSettings> RepackSettingsFromFlags(const parallel::ParallelConfig& layout,
                                                       const TrainerConfig& config,
                                                       std::optional<int64_t> resumed_iteration);

/// Asks the launcher to relaunch the job with `num_stages` pipeline stages, resuming from
/// the checkpoint in `save_dir` (NOTE [relaunch protocol]). Called by global rank 0 after
/// the checkpoint is written. Returns the flags to add to the command line (for the log,
/// and for a relaunch by hand when no launcher asked for a request file). `extra_args`
/// follow (e.g. dropping virtual stages on one stage).
absl::StatusOr<std::string> WriteRelaunchRequest(const parallel::ParallelConfig& layout,
                                                 int num_stages, const std::string& save_dir,
                                                 const std::string& reason,
                                                 const std::vector<std::string>& extra_args = {});

/// Builds the pipeline runner of a new layout for the trainer (null: the trainer's own
/// loop); whoever supplies the factory owns the runner and keeps it alive for the trainer.
using RunnerFactory =
    std::function<absl::StatusOr<ForwardBackwardRunner*>(parallel::ProcessGroupContext& context)>;

/// Carries out a live shrink on this rank (NOTE [live shrink] in pipeline/shrink.h) from
/// `old` (the current layout, whose stages hold `old_ranges`) onto `new_ranges`; with
/// virtual pipeline stages the ranges are per virtual stage, `old`'s virtual stages say
/// where the old ones are and `new_chunks` (stage, chunk) where the new ones go (empty: one
/// chunk per stage; NOTE [re-packing under chunks] in dynamic/repack.h). A survivor
/// gets the new context, which `trainer` already trains on with the runner `make_runner`
/// built on it (both must outlive the trainer); a released rank gets null, has sent its
/// state away and should exit 0. Collective over the old world.
absl::StatusOr<std::unique_ptr<parallel::ProcessGroupContext>> ShrinkLive(
    parallel::ProcessGroupContext& old, Trainer& trainer, const pipeline::LayerRanges& old_ranges,
    const pipeline::LayerRanges& new_ranges, const std::vector<std::pair<int, int>>& new_chunks,
    bool tie_embeddings, const RunnerFactory& make_runner);

/// Tells fulcrum_launch that global rank `rank` was released on purpose (NOTE [relaunch
/// protocol]); nothing without a launcher that asked.
void MarkReleased(int rank);

/// Runs --on_release_command (sh -c) with FULCRUM_RELEASED_RANK=`rank`; logs a failure.
void RunOnReleaseCommand(const std::string& command, int rank);

}  // namespace fulcrum
