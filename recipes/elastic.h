// fulcrum_train's elastic controller: it owns the job's parallel layout (the process
// groups, the pipeline runner, the timeline) and runs the trainer on it. When re-packing is
// on (recipes/repack_flags.h), it watches for the trigger after each iteration's pipeline
// run, and on a decision stops the trainer (NOTE [graceful stop] in core/trainer.h), then
// either shrinks the job live onto fewer pipeline stages and runs on (NOTE [live shrink] in
// pipeline/shrink.h), or leaves the saved iteration to a relaunch (NOTE [relaunch protocol]
// in recipes/relaunch_protocol.h).
//
// Not thread-safe; Create and Run are collective over the job.
#pragma once

#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/checkpoint.h"
#include "core/trainer.h"
#include "dynamic/repack_trigger.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "pipeline/pipeline_runner.h"
#include "pipeline/rebalancer.h"
#include "pipeline/timeline.h"
#include "recipes/repack_flags.h"
#include "recipes/timeline_path.h"

namespace fulcrum {

/// How the controller builds its pipeline runners and re-packs.
struct ElasticOptions {
  /// The layout the job starts on.
  parallel::ParallelConfig layout;
  /// --pipeline_schedule.
  std::string schedule;
  /// Model chunks per stage (VirtualPipelineChunksFromFlags); > 1: virtual pipeline stages.
  int num_chunks = 1;
  int64_t micro_batch_size = 1;
  /// --layer_timing: whether the runner times each layer (StageExecutor::set_layer_timing).
  bool layer_timing = true;
  /// --zbv_order=measured: the V's order from the measured costs
  /// (PipelineRunner::set_measured_zbv_order).
  bool measured_zbv_order = true;
  /// A fresh rebalancer for each runner (the flags' --rebalancer...).
  std::function<absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>>()> make_rebalancer;
  /// --timeline; empty: none. After a live shrink onto N stages the timeline goes on in
  /// TimelinePathAfterShrink(timeline, N) (recipes/timeline_path.h).
  std::string timeline;
  /// Whether the model ties its output weight to the word embeddings (process groups).
  bool tie_embeddings = true;
  RepackSettings repack;
  /// --save (where a relaunch resumes from) and --train_iters.
  std::string save;
  int64_t train_iters = 0;
};

/// How a run under the controller ended, for main's exit code.
enum class ElasticOutcome {
  kFinished,  ///< Trained to the end, or stopped by a signal (the trainer saved).
  kReleased,  ///< A live shrink released this rank: its layers went to the survivors.
  kRelaunch,  ///< Stopped and saved for a relaunch on fewer stages (kRelaunchExitCode).
};

class ElasticController {
 public:
  /// Takes over `context` (null: one process) and builds its pipeline runner (pp > 1).
  static absl::StatusOr<std::unique_ptr<ElasticController>> Create(
      ElasticOptions options, std::unique_ptr<parallel::ProcessGroupContext> context);

  /// The process groups (null: one process), e.g. for the plugins and the initial placement.
  parallel::ProcessGroupContext* context() { return context_.get(); }
  /// This rank's roles (the one-process job's without a context).
  RankRoles roles() const { return context_ ? context_->roles() : RankRoles(); }
  /// What the trainer runs on now; changes with a live shrink.
  TrainerLayout trainer_layout();

  /// Loads `checkpoint` (when set; it is released after), then trains with `trainer` (built
  /// on trainer_layout()) until the end, a stop signal (`stop_signalled`, cheap and async-
  /// signal-safe to back) or a re-packing decision, and carries the decision out. An error
  /// of the trainer, of the re-packing, or of a collective (a peer gone) is returned.
  absl::StatusOr<ElasticOutcome> Run(Trainer& trainer,
                                     std::optional<ckpt::CheckpointReader>& checkpoint,
                                     std::function<bool()> stop_signalled);

 private:
  explicit ElasticController(ElasticOptions options) : options_(std::move(options)) {}
  /// Builds the pipeline runner (and timeline at `timeline_path`) of context_ (kept for a
  /// pipeline shrunk onto one stage when `one_stage`); returns it, or null for none.
  absl::StatusOr<ForwardBackwardRunner*> InstallRunner(parallel::ProcessGroupContext& context,
                                                       const std::string& timeline_path,
                                                       bool one_stage);
  /// The trainer's stop request: a signal, or the re-packing trigger's decision.
  void WatchForStop(Trainer& trainer, std::function<bool()> stop_signalled);
  /// Loads and trains, then shrinks live and trains on as long as decisions come.
  absl::Status TrainAndShrink(Trainer& trainer, std::optional<ckpt::CheckpointReader>& checkpoint,
                              const std::function<bool()>& stop_signalled, bool* released);
  /// One live shrink onto repack_plan_; sets `released` on a rank that leaves.
  absl::Status ShrinkOnce(Trainer& trainer, bool* released);
  /// Rank 0's request for a relaunch on fewer stages, and its log line.
  absl::Status RequestRelaunch(const Trainer& trainer);

  ElasticOptions options_;
  // Destroyed in reverse: the runner and the timeline before the groups they use.
  std::unique_ptr<parallel::ProcessGroupContext> context_;
  std::unique_ptr<pipeline::TimelineRecorder> timeline_;
  std::unique_ptr<pipeline::PipelineRunner> runner_;  // Null without a pipeline.
  std::optional<dynamic::RepackTrigger> repack_trigger_;
  std::optional<dynamic::RepackPlan> repack_plan_;  // The decision taken, until carried out.
  absl::Status repack_error_;
};

}  // namespace fulcrum
