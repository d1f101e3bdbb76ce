#include "recipes/elastic.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"
#include "parallel/communicator.h"
#include "recipes/relaunch_protocol.h"

namespace fulcrum {

absl::StatusOr<std::unique_ptr<ElasticController>> ElasticController::Create(
    ElasticOptions options, std::unique_ptr<parallel::ProcessGroupContext> context) {
  std::unique_ptr<ElasticController> controller(new ElasticController(std::move(options)));
  controller->context_ = std::move(context);
  const ElasticOptions& o = controller->options_;
  const int pp = controller->context_ != nullptr ? controller->context_->roles().pp_size : 1;
  if (pp > 1 && o.num_chunks > 1) {
    // NOTE [model chunks]: the schedule's layout (round-robin or V) cuts the model — the
    // same layout a live shrink gives the new stages (ShrinkOnce).
    FULCRUM_ASSIGN_OR_RETURN(const std::vector<pipeline::ChunkId> layout,
                             dynamic::RepackLayout(o.schedule, pp, o.num_chunks));
    std::vector<std::pair<int, int>> owners;
    for (const pipeline::ChunkId& id : layout) owners.emplace_back(id.stage, id.chunk);
    controller->context_->SetVirtualStages(std::move(owners));
  }
  if (controller->context_ != nullptr) {
    FULCRUM_RETURN_IF_ERROR(controller
                                ->InstallRunner(*controller->context_, controller->options_.timeline,
                                                /*one_stage=*/false)
                                .status());
  }
  return controller;
}

TrainerLayout ElasticController::trainer_layout() {
  return TrainerLayout{context_.get(), roles(), runner_.get()};
}

// A pipeline shrunk onto one stage keeps a one-stage runner: the trainer's own loop scales
// the loss by a division where the pipeline multiplies by the reciprocal, and re-packing
// must not change a loss bit. `one_stage`: install a runner even when pp = 1 (after a
// shrink); a run started on one stage has none.
absl::StatusOr<ForwardBackwardRunner*> ElasticController::InstallRunner(
    parallel::ProcessGroupContext& context, const std::string& timeline_path, bool one_stage) {
  const bool single = context.roles().pp_size == 1;
  if (single && !one_stage) return nullptr;
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<pipeline::Rebalancer> rebalancer,
                           options_.make_rebalancer());
  // Replicas of this stage (data- and tensor-parallel) agree on the loads, so all apply
  // the same moves. One stage runs one chunk, under the schedule's one-chunk form (NOTE
  // [re-packing under chunks] in dynamic/repack.h).
  auto runner = std::make_unique<pipeline::PipelineRunner>(
      &context.group(parallel::GroupKind::kPipeline),
      single ? pipeline::OneStageScheduleName(options_.schedule) : options_.schedule,
      options_.micro_batch_size, std::move(rebalancer),
      std::vector<parallel::Communicator*>{&context.group(parallel::GroupKind::kTensor),
                                           &context.group(parallel::GroupKind::kData)},
      single ? 1 : options_.num_chunks);
  runner->set_layer_timing(options_.layer_timing);
  runner->set_measured_zbv_order(options_.measured_zbv_order);
  if (!timeline_path.empty()) {
    timeline_ = std::make_unique<pipeline::TimelineRecorder>(&context.world(), timeline_path,
                                                             context.coords().pp);
    runner->SetTimeline(timeline_.get());
  }
  runner_ = std::move(runner);
  return runner_.get();
}

// Re-packing rides on the graceful stop: every rank decides alike after the iteration's
// pipeline run, and the trainer finishes (and saves) that iteration and returns.
void ElasticController::WatchForStop(Trainer& trainer, std::function<bool()> stop_signalled) {
  if (options_.repack.enabled && runner_ != nullptr) repack_trigger_.emplace(options_.repack.trigger);
  trainer.SetStopRequest(
      [this, &trainer, stop_signalled] {
        // Re-packing after the last iteration would release ranks with nothing left to
        // train (an overdue step met by a run resumed just before its end).
        if (repack_trigger_ && !repack_plan_ && repack_error_.ok() &&
            trainer.iteration() + 1 < options_.train_iters) {
          auto plan = repack_trigger_->Check(trainer.iteration() + 1, runner_->ranges(),
                                             runner_->last_loads(), trainer.model().frozen_prefix());
          if (!plan.ok()) {
            repack_error_ = plan.status();
          } else if (plan->has_value()) {
            repack_plan_ = std::move(**plan);
          }
          if (roles().is_logging_rank && !repack_trigger_->last_note().empty() &&
              (repack_plan_ || !plan.ok())) {
            FULCRUM_LOG(INFO) << repack_trigger_->last_note();
          }
        }
        return stop_signalled() || repack_plan_.has_value() || !repack_error_.ok();
      },
      [this, stop_signalled]() -> std::string {
        if (stop_signalled()) return "a stop signal";
        return repack_plan_ ? "re-packing" : "a re-packing error";
      });
}

absl::StatusOr<ElasticOutcome> ElasticController::Run(
    Trainer& trainer, std::optional<ckpt::CheckpointReader>& checkpoint,
    std::function<bool()> stop_signalled) {
  WatchForStop(trainer, stop_signalled);
  bool released = false;
  try {
    FULCRUM_RETURN_IF_ERROR(TrainAndShrink(trainer, checkpoint, stop_signalled, &released));
  } catch (const parallel::CommError& e) {
    // A peer gone or a collective timed out: not the caller's input.
    return absl::UnavailableError(e.what());
  }
  if (released) return ElasticOutcome::kReleased;
  if (!repack_error_.ok()) {
    return absl::InternalError(absl::StrCat("re-packing: ", repack_error_.message()));
  }
  if (repack_plan_ && options_.repack.via_checkpoint && trainer.stopped()) {
    FULCRUM_RETURN_IF_ERROR(RequestRelaunch(trainer));
    return ElasticOutcome::kRelaunch;
  }
  return ElasticOutcome::kFinished;
}

absl::Status ElasticController::TrainAndShrink(Trainer& trainer,
                                               std::optional<ckpt::CheckpointReader>& checkpoint,
                                               const std::function<bool()>& stop_signalled,
                                               bool* released) {
  if (checkpoint) {
    FULCRUM_RETURN_IF_ERROR(trainer.Load(*checkpoint));
    checkpoint.reset();  // Its shard files stay mapped only as long as needed.
  }
  FULCRUM_RETURN_IF_ERROR(trainer.Run());
  // A live shrink (NOTE [live shrink] in pipeline/shrink.h): the trainer stopped after the
  // decided iteration; the survivors go on from there on the smaller layout, the released
  // ranks exit 0.
  while (repack_plan_ && !options_.repack.via_checkpoint && trainer.stopped() &&
         !stop_signalled() && repack_error_.ok()) {
    FULCRUM_RETURN_IF_ERROR(ShrinkOnce(trainer, released));
    if (*released) return absl::OkStatus();
    FULCRUM_RETURN_IF_ERROR(trainer.Run());
  }
  return absl::OkStatus();
}

absl::Status ElasticController::ShrinkOnce(Trainer& trainer, bool* released) {
  const pipeline::LayerRanges old_ranges = runner_->ranges();
  pipeline::LayerRanges new_ranges;
  for (const auto& range : repack_plan_->placement) new_ranges.emplace_back(range.begin, range.end);
  const RankRoles old_roles = context_->roles();
  const int old_pp = old_roles.pp_size;
  const int old_world = old_roles.world_size;
  // With chunks the placement has a range per virtual stage (NOTE [re-packing under
  // chunks] in dynamic/repack.h); the new stages take the schedule's layout.
  const int new_pp = dynamic::RanksOf(static_cast<int>(new_ranges.size()),
                                      dynamic::ChunksPerRank(options_.schedule, options_.num_chunks));
  std::vector<std::pair<int, int>> new_chunks;
  if (new_pp > 1 && static_cast<int>(new_ranges.size()) > new_pp) {
    FULCRUM_ASSIGN_OR_RETURN(
        const std::vector<pipeline::ChunkId> layout,
        dynamic::RepackLayout(options_.schedule, new_pp, options_.num_chunks));
    for (const pipeline::ChunkId& id : layout) new_chunks.emplace_back(id.stage, id.chunk);
  }
  const int new_world = old_world / old_pp * new_pp;
  const auto shrink_start = pipeline::TimelineRecorder::Clock::now();
  // The state travels from the Parameters (the distributed optimizer's slices made whole
  // first; every rank of the old layout is here).
  FULCRUM_RETURN_IF_ERROR(trainer.GatherOptimizerState());
  // The old runner and timeline stay alive (the trainer holds the runner until it changes
  // layout) and go before the old groups they use.
  std::unique_ptr<pipeline::PipelineRunner> old_runner = std::move(runner_);
  std::unique_ptr<pipeline::TimelineRecorder> old_timeline = std::move(timeline_);
  const std::string timeline_path = TimelinePathAfterShrink(options_.timeline, new_pp);
  FULCRUM_ASSIGN_OR_RETURN(
      std::unique_ptr<parallel::ProcessGroupContext> shrunk,
      ShrinkLive(*context_, trainer, old_ranges, new_ranges, new_chunks, options_.tie_embeddings,
                 [&](parallel::ProcessGroupContext& next) {
                   return InstallRunner(next, timeline_path, /*one_stage=*/true);
                 }));
  old_timeline.reset();
  old_runner.reset();
  if (shrunk == nullptr) {
    FULCRUM_LOG(INFO) << "released after iteration " << trainer.iteration()
                      << ": the pipeline shrank from " << old_pp << " to " << new_pp
                      << " stages (" << old_world << " → " << new_world
                      << " ranks); this rank's layers went to the survivors; exiting 0";
    context_.reset();
    RunOnReleaseCommand(options_.repack.on_release_command, old_roles.world_rank);
    MarkReleased(old_roles.world_rank);
    *released = true;
    return absl::OkStatus();
  }
  context_ = std::move(shrunk);  // The old groups go; the trainer runs on the new ones.
  if (timeline_ != nullptr) {  // The shrink itself, on the new timeline's events row.
    timeline_->RecordSpan(absl::StrCat("re-pack ", old_pp, " -> ", new_pp, " stages after "
                                       "iteration ", trainer.iteration(), " (",
                                       old_world - new_world, " ranks released)"),
                          "repack", timeline_->MillisecondsSinceOrigin(shrink_start),
                          timeline_->NowMs());
  }
  if (roles().is_logging_rank) {
    FULCRUM_LOG(INFO) << "re-packed live after iteration " << trainer.iteration() << ": "
                      << old_pp << " → " << new_pp << " pipeline stages, " << old_world
                      << " → " << new_world << " ranks (" << old_world - new_world
                      << " released); placement " << pipeline::FormatRanges(new_ranges);
  }
  repack_plan_.reset();
  if (roles().pp_size == 1) repack_trigger_.reset();
  return absl::OkStatus();
}

absl::Status ElasticController::RequestRelaunch(const Trainer& trainer) {
  const int stages =
      dynamic::RanksOf(static_cast<int>(repack_plan_->placement.size()),
                       dynamic::ChunksPerRank(options_.schedule, options_.num_chunks));
  // Global rank 0 alone writes the launcher's request (NOTE [relaunch protocol]).
  if (roles().world_rank != 0) return absl::OkStatus();
  // One stage runs one chunk (NOTE [re-packing under chunks] in dynamic/repack.h); an
  // interleaved schedule's --virtual_pipeline_model_parallel_size would be refused there
  // (ZB-V's chunks come from the schedule and one stage accepts it).
  std::vector<std::string> extra;
  if (stages == 1 && options_.num_chunks > 1 && options_.schedule != "zbv") {
    extra.push_back("--virtual_pipeline_model_parallel_size=1");
  }
  FULCRUM_ASSIGN_OR_RETURN(
      std::string flags,
      WriteRelaunchRequest(options_.layout, stages, options_.save, repack_plan_->note, extra));
  const parallel::ParallelConfig& layout = options_.layout;
  FULCRUM_LOG(INFO) << "re-packing through a checkpoint: iteration " << trainer.iteration()
                    << " saved in " << options_.save << "; exiting with code "
                    << kRelaunchExitCode << " for a relaunch on "
                    << layout.world_size / layout.pp * stages << " ranks with " << flags
                    << (std::getenv(kRelaunchFileEnv) == nullptr
                            ? " (no fulcrum_launch asked for the request: relaunch by hand)"
                            : "");
  return absl::OkStatus();
}

}  // namespace fulcrum
