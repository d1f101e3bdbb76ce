// fulcrum_train: trains a GPT from the command line. See TrainHelpSpec() / --help.
// Exit codes: 0 success, 2 bad input (flags, files, checkpoint), 1 failure while training.
#include <gflags/gflags.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/logging.h"
#include "core/malloc_tuning.h"
#include "core/platform.h"
#include "core/tensorboard_writer.h"
#include "core/threads.h"
#include "core/trainer.h"
#include "parallel/parallel_context.h"
#include "pipeline/pipeline_runner.h"
#include "parallel/world.h"
#include "parallel/world_communicator.h"
#include "plugins/plugin_registry.h"
#include "recipes/initial_placement.h"
#include "recipes/output_paths.h"
#include "recipes/relaunch_protocol.h"
#include "recipes/repack_flags.h"
#include "recipes/train_flags.h"

namespace {

// NOTE [graceful stop] in core/trainer.h: the first SIGTERM/SIGINT asks the trainer to stop
// after the iteration in progress (and save it); a second one ends the process at once.
volatile std::sig_atomic_t g_stop_signal = 0;

void OnStopSignal(int signal_number) {
  if (g_stop_signal != 0) {
    std::signal(signal_number, SIG_DFL);
    std::raise(signal_number);
    return;
  }
  g_stop_signal = signal_number;
  constexpr char kMessage[] =
      "fulcrum_train: stop requested; finishing the iteration in progress (send the signal "
      "again to stop at once)\n";
  // write(2) is async-signal-safe; a short write only shortens the message.
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
}

void InstallStopHandlers() {
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  action.sa_flags = SA_RESTART;  // the transport's system calls carry on
  sigemptyset(&action.sa_mask);
  for (int s : {SIGTERM, SIGINT}) sigaction(s, &action, nullptr);
}

bool IsCallerError(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return true;
    default:
      return false;
  }
}

int Fail(const absl::Status& status) {
  std::cerr << "fulcrum_train: " << status.message() << std::endl;
  return IsCallerError(status) ? 2 : 1;
}

int Run(int argc, char** argv);

}  // namespace

// An exception that escapes the run (a plugin that refuses a model it cannot change throws
// from the model's construction, LibTorch throws c10::Error) ends it with one line and an
// exit code, not with std::terminate's abort: std::logic_error and its kin (the caller's
// configuration) exit 2, anything else 1.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::logic_error& e) {
    std::cerr << "fulcrum_train: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fulcrum_train: " << e.what() << std::endl;
    return 1;
  }
}

namespace {

int Run(int argc, char** argv) {
  if (std::optional<int> exit_code =
          fulcrum::cli::ParseCommandLine(&argc, &argv, fulcrum::TrainHelpSpec())) {
    return *exit_code;
  }
  if (argc > 1) {
    std::cerr << "fulcrum_train: unexpected argument '" << argv[1] << "' (flags are --name=value)"
              << std::endl;
    return 2;
  }
  fulcrum::InitLogging(argv[0]);
  // Step-sized blocks (the logits) stay in the heap instead of being unmapped and faulted
  // in again every step (core/malloc_tuning.h; docs/PERF.md).
  fulcrum::KeepStepMemoryInHeap();
  if (absl::Status s = fulcrum::ApplyRecipe(); !s.ok()) return Fail(s);
  auto requested_threads = fulcrum::NumThreadsFlag();
  if (!requested_threads.ok()) return Fail(requested_threads.status());
  fulcrum::SetComputeThreads(requested_threads->threads);

  // Validate everything that needs no data or peers before any work: the layout against
  // the job's size, then the model and training flags (the vocabulary is not known yet).
  auto world = fulcrum::parallel::WorldInfoFromEnvironment();
  if (!world.ok()) return Fail(world.status());
  auto layout = fulcrum::ParallelConfigFromFlags(world->world_size);
  if (!layout.ok()) return Fail(layout.status());
  auto backend = fulcrum::parallel::ParseBackend(fulcrum::DistributedBackendFlag());
  if (!backend.ok()) return Fail(backend.status());
  auto early = fulcrum::ConfigFromFlags(/*vocab_size=*/0, layout->tp);
  if (!early.ok()) return Fail(early.status());
  // --load is opened now: a missing or damaged checkpoint is reported before any work, and
  // the re-packing flags are checked against the iteration it resumes from.
  std::optional<fulcrum::ckpt::CheckpointReader> checkpoint;
  if (const std::string load = fulcrum::LoadPathFlag(); !load.empty()) {
    fulcrum::ckpt::CheckpointReadOptions read_options;
    read_options.allow_unchecksummed_manifest = fulcrum::AllowUnchecksummedManifestFlag();
    auto opened = fulcrum::ckpt::CheckpointReader::Open(fulcrum::DefaultFileSystem(), load,
                                                        read_options);
    if (!opened.ok()) return Fail(opened.status());
    checkpoint = std::move(*opened);
  }
  auto repack = fulcrum::RepackSettingsFromFlags(
      *layout, *early,
      checkpoint ? std::optional<int64_t>(early->train.finetune ? 0 : checkpoint->iteration())
                 : std::nullopt);
  if (!repack.ok()) return Fail(repack.status());
  // The plugins: --plugins, and those their own flags ask for (--num_experts: moe); their
  // flags are checked against the model and the layout now, before any work.
  auto plugin_names = fulcrum::plugins::SelectPlugins(fulcrum::PluginsFlag());
  if (!plugin_names.ok()) return Fail(plugin_names.status());
  if (absl::Status s = fulcrum::plugins::CheckFlagsOfUnselectedPlugins(*plugin_names); !s.ok()) {
    return Fail(s);
  }
  fulcrum::plugins::PluginSetup plugin_setup;
  plugin_setup.model = early->model;
  plugin_setup.layout = *layout;
  if (absl::Status s = fulcrum::plugins::ValidatePlugins(*plugin_names, plugin_setup); !s.ok()) {
    return Fail(s);
  }
  fulcrum::SetLogRank(world->world_size > 1 ? world->rank : -1, world->world_size);

  // An unwritable --save would be found only at the first save, after the work it was
  // meant to keep, an unwritable --timeline only at the end; --tensorboard_dir is checked
  // on every rank, before the data is read.
  if (absl::Status s = fulcrum::CheckOutputsWritable(early->train, fulcrum::TimelineFlag());
      !s.ok()) {
    return Fail(s);
  }
  if (const std::string& dir = early->train.tensorboard_dir; !dir.empty()) {
    if (absl::Status s = fulcrum::CheckTensorBoardDirWritable(fulcrum::DefaultFileSystem(), dir);
        !s.ok()) {
      return Fail(s);
    }
  }

  auto data = fulcrum::LoadTrainData();
  if (!data.ok()) return Fail(data.status());
  auto config = fulcrum::ConfigFromFlags(data->vocab_size, layout->tp);
  if (!config.ok()) return Fail(config.status());

  std::unique_ptr<fulcrum::parallel::ProcessGroupContext> parallel;
  std::unique_ptr<fulcrum::pipeline::TimelineRecorder> timeline;
  fulcrum::pipeline::PipelineRunner* pipeline_runner = nullptr;
  // The pipeline runner of `ctx` (again after a live shrink, with the schedule regenerated
  // for the new stage count); the timeline after a shrink goes to TIMELINE.ppN.json. A
  // pipeline shrunk onto one stage keeps a one-stage runner: the trainer's own loop scales
  // the loss by a division where the pipeline multiplies by the reciprocal, and re-packing
  // must not change a loss bit.
  auto install_runner = [&](fulcrum::parallel::ProcessGroupContext& ctx,
                            const std::string& timeline_path, bool one_stage) -> absl::Status {
    pipeline_runner = nullptr;
    if (ctx.pp_size() == 1 && !one_stage) return absl::OkStatus();
    auto rebalancer = fulcrum::RebalancerFromFlags();
    if (!rebalancer.ok()) return rebalancer.status();
    // Replicas of this stage (data- and tensor-parallel) agree on the loads, so all
    // apply the same moves.
    auto runner = std::make_unique<fulcrum::pipeline::PipelineRunner>(
        &ctx.group(fulcrum::parallel::GroupKind::kPipeline), fulcrum::PipelineScheduleFlag(),
        config->train.micro_batch_size, std::move(*rebalancer),
        std::vector<fulcrum::parallel::Communicator*>{
            &ctx.group(fulcrum::parallel::GroupKind::kTensor),
            &ctx.group(fulcrum::parallel::GroupKind::kData)});
    if (!timeline_path.empty()) {
      timeline = std::make_unique<fulcrum::pipeline::TimelineRecorder>(&ctx.world(), timeline_path,
                                                                       ctx.coords().pp);
      runner->SetTimeline(timeline.get());
    }
    pipeline_runner = runner.get();
    ctx.SetForwardBackward(std::move(runner));
    return absl::OkStatus();
  };
  if (world->world_size > 1) {
    const std::chrono::minutes timeout(fulcrum::DistributedTimeoutMinutesFlag());
    auto comm = fulcrum::parallel::CreateWorldCommunicator(*world, *backend, timeout);
    if (!comm.ok()) return Fail(comm.status());
    auto ctx = fulcrum::parallel::ProcessGroupContext::Create(std::move(*comm), *layout,
                                                              config->model.tie_embeddings);
    if (!ctx.ok()) return Fail(ctx.status());
    parallel = std::move(*ctx);
    if (absl::Status s = install_runner(*parallel, fulcrum::TimelineFlag(), false); !s.ok()) {
      return Fail(s);
    }
  }
  if (parallel == nullptr || parallel->is_logging_rank()) {
    FULCRUM_LOG(INFO) << "platform: " << fulcrum::DescribePlatform(fulcrum::CurrentPlatform());
    FULCRUM_LOG(INFO) << "data: " << data->description << "; vocabulary " << data->vocab_size
                      << " padded to " << config->model.vocab_size << "; layout "
                      << layout->ToString() << "; compute threads per process: "
                      << fulcrum::DescribeComputeThreads(*requested_threads);
  }

  plugin_setup.model = config->model;
  plugin_setup.corpus = data->corpus;
  plugin_setup.data = config->data;
  auto plugins = fulcrum::plugins::MakePlugins(*plugin_names, plugin_setup);
  if (!plugins.ok()) return Fail(plugins.status());
  config->feed_forward_shape = (*plugins)->CheckpointShape();
  if ((parallel == nullptr || parallel->is_logging_rank()) && !(*plugins)->empty()) {
    FULCRUM_LOG(INFO) << "plugins: " << (*plugins)->Names();
  }
  if (layout->pp > 1 && fulcrum::InitialPartitionByParamsFlag()) {
    // The layer shells measured below are built for the layout (the experts this rank holds).
    if (absl::Status s = (*plugins)->OnLayout(parallel.get()); !s.ok()) return Fail(s);
    auto placement = fulcrum::ParameterBalancedPlacement(config->model, plugins->get(),
                                                         parallel->tensor_parallel(), layout->pp);
    if (!placement.ok()) return Fail(placement.status());
    if (parallel->is_logging_rank()) {
      FULCRUM_LOG(INFO) << "initial placement balancing parameters (--pipeline_initial_partition="
                           "params): "
                        << fulcrum::pipeline::FormatRanges(*placement);
    }
    parallel->SetInitialPlacement(std::move(*placement));
  }

  auto trainer = fulcrum::Trainer::Create(*config, data->corpus, parallel.get(),
                                          fulcrum::DefaultFileSystem(), std::move(*plugins));
  if (!trainer.ok()) return Fail(trainer.status());
  InstallStopHandlers();
  // Re-packing through a checkpoint (recipes/repack_flags.h) rides on the graceful stop:
  // every rank decides alike after the iteration's pipeline run, the trainer saves that
  // iteration and returns, and main exits with kRelaunchExitCode.
  std::optional<fulcrum::dynamic::RepackTrigger> repack_trigger;
  std::optional<fulcrum::dynamic::RepackPlan> repack_plan;
  absl::Status repack_error = absl::OkStatus();
  if (repack->enabled && pipeline_runner != nullptr) repack_trigger.emplace(repack->trigger);
  fulcrum::Trainer* trainer_ptr = trainer->get();
  (*trainer)->SetStopRequest([&] {
    // Re-packing after the last iteration would release ranks with nothing left to train
    // (an overdue step met by a run resumed just before its end).
    if (repack_trigger && !repack_plan && repack_error.ok() &&
        trainer_ptr->iteration() + 1 < config->train.train_iters) {
      auto plan = repack_trigger->Check(trainer_ptr->iteration() + 1, pipeline_runner->ranges(),
                                        pipeline_runner->last_loads());
      if (!plan.ok()) {
        repack_error = plan.status();
      } else if (plan->has_value()) {
        repack_plan = std::move(**plan);
      }
      if (parallel->is_logging_rank() && !repack_trigger->last_note().empty() &&
          (repack_plan || !plan.ok())) {
        FULCRUM_LOG(INFO) << repack_trigger->last_note();
      }
    }
    return g_stop_signal != 0 || repack_plan.has_value() || !repack_error.ok();
  }, [&]() -> std::string {
    if (g_stop_signal != 0) return "a stop signal";
    return repack_plan ? "re-packing" : "a re-packing error";
  });
  try {
    if (checkpoint) {
      if (absl::Status s = (*trainer)->Load(*checkpoint); !s.ok()) return Fail(s);
      checkpoint.reset();  // Its shard files stay mapped only as long as needed.
    }
    if (absl::Status s = (*trainer)->Run(); !s.ok()) return Fail(s);
    // A live shrink (NOTE [live shrink] in pipeline/shrink.h): the trainer stopped after the
    // decided iteration; the survivors go on from there on the smaller layout, the released
    // ranks exit 0.
    while (repack_plan && !repack->via_checkpoint && (*trainer)->stopped() &&
           g_stop_signal == 0 && repack_error.ok()) {
      const fulcrum::pipeline::LayerRanges old_ranges = pipeline_runner->ranges();
      fulcrum::pipeline::LayerRanges new_ranges;
      for (const auto& range : repack_plan->placement) new_ranges.emplace_back(range.begin, range.end);
      const int old_pp = parallel->pp_size();
      const int old_world = parallel->world_size();
      const int old_rank = parallel->world_rank();
      const auto shrink_start = fulcrum::pipeline::TimelineRecorder::Clock::now();
      auto shrunk = fulcrum::ShrinkLive(*parallel, **trainer, old_ranges, new_ranges,
                                        config->model.tie_embeddings);
      if (!shrunk.ok()) return Fail(shrunk.status());
      const int new_pp = static_cast<int>(new_ranges.size());
      const int new_world = old_world / old_pp * new_pp;
      if (*shrunk == nullptr) {
        FULCRUM_LOG(INFO) << "released after iteration " << (*trainer)->iteration()
                          << ": the pipeline shrank from " << old_pp << " to " << new_pp
                          << " stages (" << old_world << " → " << new_world
                          << " ranks); this rank's layers went to the survivors; exiting 0";
        timeline.reset();
        parallel.reset();
        fulcrum::RunOnReleaseCommand(repack->on_release_command, old_rank);
        fulcrum::MarkReleased(old_rank);
        return 0;
      }
      std::string timeline_path = fulcrum::TimelineFlag();
      if (!timeline_path.empty()) {
        const size_t dot = timeline_path.rfind('.');
        const std::string suffix = absl::StrCat(".pp", new_pp);
        timeline_path = dot == std::string::npos || dot < timeline_path.rfind('/') + 1
                            ? timeline_path + suffix
                            : timeline_path.substr(0, dot) + suffix + timeline_path.substr(dot);
      }
      timeline.reset();
      parallel = std::move(*shrunk);  // The old groups go; the trainer runs on the new ones.
      if (absl::Status s = install_runner(*parallel, timeline_path, true); !s.ok()) return Fail(s);
      if (timeline != nullptr) {  // The shrink itself, on the new timeline's events row.
        timeline->RecordSpan(absl::StrCat("re-pack ", old_pp, " -> ", new_pp, " stages after "
                                          "iteration ", (*trainer)->iteration(), " (",
                                          old_world - new_world, " ranks released)"),
                             "repack", timeline->MillisecondsSinceOrigin(shrink_start),
                             timeline->NowMs());
      }
      if (parallel->is_logging_rank()) {
        FULCRUM_LOG(INFO) << "re-packed live after iteration " << (*trainer)->iteration()
                          << ": " << old_pp << " → " << new_pp << " pipeline stages, "
                          << old_world << " → " << new_world << " ranks ("
                          << old_world - new_world << " released); placement "
                          << fulcrum::pipeline::FormatRanges(new_ranges);
      }
      repack_plan.reset();
      if (parallel->pp_size() == 1) repack_trigger.reset();
      if (absl::Status s = (*trainer)->Run(); !s.ok()) return Fail(s);
    }
  } catch (const fulcrum::parallel::CommError& e) {
    std::cerr << "fulcrum_train: " << e.what() << std::endl;
    return 1;
  }
  if (!repack_error.ok()) {
    std::cerr << "fulcrum_train: re-packing: " << repack_error.message() << std::endl;
    return 1;
  }
  if (repack_plan && repack->via_checkpoint && (*trainer)->stopped()) {
    const int stages = static_cast<int>(repack_plan->placement.size());
    // Global rank 0 alone writes the launcher's request (NOTE [relaunch protocol]).
    if (parallel->world_rank() == 0) {
      absl::StatusOr<std::string> flags = fulcrum::WriteRelaunchRequest(
          *layout, stages, config->train.save, repack_plan->note);
      if (!flags.ok()) return Fail(flags.status());
      FULCRUM_LOG(INFO) << "re-packing through a checkpoint: iteration "
                        << (*trainer)->iteration() << " saved in " << config->train.save
                        << "; exiting with code " << fulcrum::kRelaunchExitCode
                        << " for a relaunch on " << layout->world_size / layout->pp * stages
                        << " ranks with " << *flags
                        << (std::getenv(fulcrum::kRelaunchFileEnv) == nullptr
                                ? " (no fulcrum_launch asked for the request: relaunch by hand)"
                                : "");
    }
    return fulcrum::kRelaunchExitCode;
  }
  if (!config->train.save.empty() && (parallel == nullptr || parallel->is_logging_rank())) {
    FULCRUM_LOG(INFO) << "checkpoints are in " << config->train.save;
  }
  return 0;
}

}  // namespace
