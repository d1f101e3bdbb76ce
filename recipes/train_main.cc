// fulcrum_train: trains a GPT from the command line. See TrainHelpSpec() / --help.
// main checks the flags before any work, builds the data, the layout, the plugins and the
// trainer, and hands the run to the elastic controller (recipes/elastic.h), which stops,
// shrinks and resumes it when re-packing says so.
// Exit codes: 0 success (or a rank released by a live shrink), 2 bad input (flags, files,
// checkpoint), 1 failure while training, kRelaunchExitCode for a relaunch on fewer stages.
#include <ATen/Context.h>
#include <gflags/gflags.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/logging.h"
#include "core/malloc_tuning.h"
#include "core/platform.h"
#include "core/status.h"
#include "core/tensorboard_writer.h"
#include "core/threads.h"
#include "core/trainer.h"
#include "parallel/process_groups.h"
#include "parallel/rank_roles.h"
#include "parallel/world.h"
#include "parallel/world_communicator.h"
#include "pipeline/rebalancer.h"
#include "plugins/plugin_registry.h"
#include "recipes/elastic.h"
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

// What main learns and checks from the flags before any work, and carries into the run.
struct Checked {
  fulcrum::ThreadChoice threads;
  fulcrum::parallel::WorldInfo world;
  fulcrum::parallel::ParallelConfig layout;
  fulcrum::parallel::Backend backend = fulcrum::parallel::Backend::kGloo;
  fulcrum::TrainerConfig early;  // The flags' configuration, before the vocabulary is known.
  std::optional<fulcrum::ckpt::CheckpointReader> checkpoint;  // --load, opened.
  fulcrum::RepackSettings repack;
  int num_chunks = 1;  // Model chunks per pipeline stage (virtual pipeline stages).
  std::vector<std::string> plugin_names;
  fulcrum::plugins::PluginSetup plugin_setup;
};

// Validates everything that needs no data or peers before any work: the layout against
// the job's size, then the model and training flags (the vocabulary is not known yet).
absl::Status CheckBeforeWork(Checked& c) {
  FULCRUM_RETURN_IF_ERROR(fulcrum::ApplyRecipe());
  FULCRUM_ASSIGN_OR_RETURN(c.threads, fulcrum::NumThreadsFlag());
  fulcrum::SetComputeThreads(c.threads.threads);
  FULCRUM_ASSIGN_OR_RETURN(c.world, fulcrum::parallel::WorldInfoFromEnvironment());
  FULCRUM_ASSIGN_OR_RETURN(c.layout, fulcrum::ParallelConfigFromFlags(c.world.world_size));
  FULCRUM_ASSIGN_OR_RETURN(c.num_chunks, fulcrum::VirtualPipelineChunksFromFlags(c.layout.pp));
  FULCRUM_ASSIGN_OR_RETURN(c.early, fulcrum::ConfigFromFlags(/*vocab_size=*/0, c.layout.tp,
                                                                c.world.local_rank));
  FULCRUM_ASSIGN_OR_RETURN(c.backend,
                           fulcrum::DistributedBackendFromFlags(c.early.model.device_spec.device));
  // --load is opened now: a missing or damaged checkpoint is reported before any work, and
  // the re-packing flags are checked against the iteration it resumes from.
  if (const std::string load = fulcrum::LoadPathFlag(); !load.empty()) {
    fulcrum::ckpt::CheckpointReadOptions read_options;
    read_options.allow_unchecksummed_manifest = fulcrum::AllowUnchecksummedManifestFlag();
    FULCRUM_ASSIGN_OR_RETURN(c.checkpoint, fulcrum::ckpt::CheckpointReader::Open(
                                               fulcrum::DefaultFileSystem(), load, read_options));
  }
  FULCRUM_ASSIGN_OR_RETURN(
      c.repack, fulcrum::RepackSettingsFromFlags(
                    c.layout, c.early,
                    c.checkpoint ? std::optional<int64_t>(
                                       c.early.train.finetune ? 0 : c.checkpoint->iteration())
                                 : std::nullopt));
  // The plugins: --plugins, and those their own flags ask for (--num_experts: moe); their
  // flags are checked against the model and the layout now, before any work.
  FULCRUM_ASSIGN_OR_RETURN(c.plugin_names,
                           fulcrum::plugins::SelectPlugins(fulcrum::PluginsFlag()));
  FULCRUM_RETURN_IF_ERROR(fulcrum::plugins::CheckFlagsOfUnselectedPlugins(c.plugin_names));
  c.plugin_setup.model = c.early.model;
  c.plugin_setup.layout = fulcrum::parallel::RankRolesOf(c.layout, c.world.rank);
  FULCRUM_RETURN_IF_ERROR(fulcrum::plugins::ValidatePlugins(c.plugin_names, c.plugin_setup));
  fulcrum::SetLogRank(c.world.world_size > 1 ? c.world.rank : -1, c.world.world_size);

  // An unwritable --save would be found only at the first save, after the work it was
  // meant to keep, an unwritable --timeline only at the end; --tensorboard_dir is checked
  // on every rank, before the data is read.
  FULCRUM_RETURN_IF_ERROR(fulcrum::CheckOutputsWritable(c.early.train, fulcrum::TimelineFlag()));
  if (const std::string& dir = c.early.train.tensorboard_dir; !dir.empty()) {
    FULCRUM_RETURN_IF_ERROR(fulcrum::CheckTensorBoardDirWritable(fulcrum::DefaultFileSystem(), dir));
  }
  return absl::OkStatus();
}

// The job's process groups over the world communicator; null for one process.
absl::StatusOr<std::unique_ptr<fulcrum::parallel::ProcessGroupContext>> Connect(
    const Checked& c, bool tie_embeddings) {
  if (c.world.world_size == 1) return nullptr;
  const std::chrono::minutes timeout(fulcrum::DistributedTimeoutMinutesFlag());
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<fulcrum::parallel::Communicator> comm,
                           fulcrum::parallel::CreateWorldCommunicator(c.world, c.backend, timeout));
  const c10::Device& device = c.early.model.device_spec.device;
  if (c.backend == fulcrum::parallel::Backend::kGloo && device.is_cuda() && c.world.rank == 0) {
    FULCRUM_LOG(WARNING) << "--distributed_backend=gloo on " << device.str()
                         << ": every tensor between ranks is staged through host memory "
                            "(correct, slow; for several ranks on one GPU). Train at speed "
                            "with nccl, one GPU per rank.";
  }
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<fulcrum::parallel::ProcessGroupContext> context,
                           fulcrum::parallel::ProcessGroupContext::Create(std::move(comm), c.layout,
                                                                          tie_embeddings));
  return context;
}

fulcrum::ElasticOptions ElasticOptionsOf(const Checked& c, const fulcrum::TrainerConfig& config) {
  fulcrum::ElasticOptions options;
  options.layout = c.layout;
  options.schedule = fulcrum::PipelineScheduleFlag();
  options.num_chunks = c.num_chunks;
  options.layer_timing = fulcrum::LayerTimingFlag();
  options.measured_zbv_order = fulcrum::MeasuredZbvOrderFlag();
  options.micro_batch_size = config.train.micro_batch_size;
  options.make_rebalancer = fulcrum::RebalancerFromFlags;
  options.timeline = fulcrum::TimelineFlag();
  options.tie_embeddings = config.model.tie_embeddings;
  options.repack = c.repack;
  options.save = config.train.save;
  options.train_iters = config.train.train_iters;
  return options;
}

// Builds the plugins (they learn the layout from the trainer, NOTE [plugin doors]) and, with
// --pipeline_initial_partition=params, the placement training starts with.
absl::StatusOr<std::shared_ptr<fulcrum::PluginSet>> BuildPlugins(
    Checked& c, const fulcrum::TrainData& data, fulcrum::TrainerConfig& config,
    fulcrum::ElasticController& controller) {
  fulcrum::parallel::ProcessGroupContext* parallel = controller.context();
  c.plugin_setup.model = config.model;
  c.plugin_setup.corpus = data.corpus;
  c.plugin_setup.data = config.data;
  FULCRUM_ASSIGN_OR_RETURN(std::shared_ptr<fulcrum::PluginSet> plugins,
                           fulcrum::plugins::MakePlugins(c.plugin_names, c.plugin_setup));
  config.feed_forward_shape = plugins->CheckpointShape();
  const bool logging = controller.roles().is_logging_rank;
  if (logging && !plugins->empty()) FULCRUM_LOG(INFO) << "plugins: " << plugins->Names();
  if (c.layout.pp > 1 && fulcrum::InitialPartitionByParamsFlag()) {
    // The layer shells measured below are built for the layout (the experts this rank holds).
    FULCRUM_RETURN_IF_ERROR(plugins->OnLayout(parallel));
    // With virtual stages (set by the controller) one range per virtual stage.
    FULCRUM_ASSIGN_OR_RETURN(auto placement, fulcrum::ParameterBalancedPlacement(
                                                 config.model, plugins.get(),
                                                 parallel->tensor_parallel(), c.layout.pp,
                                                 parallel->VirtualStageRanks()));
    if (logging) {
      FULCRUM_LOG(INFO) << "initial placement balancing parameters (--pipeline_initial_partition="
                           "params): "
                        << fulcrum::pipeline::FormatRanges(placement);
    }
    parallel->SetInitialPlacement(std::move(placement));
  }
  return plugins;
}

int Run(int argc, char** argv) {
  if (std::optional<int> exit_code =
          fulcrum::cli::ParseCommandLine(&argc, &argv, fulcrum::TrainHelpSpec())) {
    return *exit_code;
  }

  fulcrum::InitLogging(argv[0]);
  // Step-sized blocks (the logits) stay in the heap instead of being unmapped and faulted
  // in again every step (core/malloc_tuning.h; docs/PERF.md).
  fulcrum::KeepStepMemoryInHeap();
  Checked checked;
  if (absl::Status s = CheckBeforeWork(checked); !s.ok()) return Fail(s);

  auto data = fulcrum::LoadTrainData();
  if (!data.ok()) return Fail(data.status());
  auto config =
      fulcrum::ConfigFromFlags(data->vocab_size, checked.layout.tp, checked.world.local_rank);
  if (!config.ok()) return Fail(config.status());
  auto context = Connect(checked, config->model.tie_embeddings);
  if (!context.ok()) return Fail(context.status());
  auto controller =
      fulcrum::ElasticController::Create(ElasticOptionsOf(checked, *config), std::move(*context));
  if (!controller.ok()) return Fail(controller.status());
  if ((*controller)->roles().is_logging_rank) {
    FULCRUM_LOG(INFO) << "platform: " << fulcrum::DescribePlatform(fulcrum::CurrentPlatform());
    FULCRUM_LOG(INFO) << "device: " << config->model.device_spec.ToString()
                      << " (--device=" << fulcrum::DeviceFlag()
                      << (config->model.device_spec.mixed_precision() ? ", --bf16)" : ")");
    FULCRUM_LOG(INFO) << "data: " << data->description << "; vocabulary " << data->vocab_size
                      << " padded to " << config->model.vocab_size << "; layout "
                      << checked.layout.ToString() << "; compute threads per process: "
                      << fulcrum::DescribeComputeThreads(checked.threads);
  }
  // LibTorch seeds its default generators nondeterministically. Training never draws from
  // them (NOTE [layout-independent randomness]), but user and plugin code may, and a
  // checkpoint saves the CPU one (rng.torch_cpu): seed them from --seed, as Megatron's
  // initialisation does, so two runs of one command draw alike. A resume then restores the
  // saved state.
  at::manual_seed(config->model.seed);
  auto plugins = BuildPlugins(checked, *data, *config, **controller);
  if (!plugins.ok()) return Fail(plugins.status());

  auto trainer = fulcrum::Trainer::Create(*config, data->corpus, (*controller)->trainer_layout(),
                                          fulcrum::DefaultFileSystem(), std::move(*plugins));
  if (!trainer.ok()) return Fail(trainer.status());
  InstallStopHandlers();
  absl::StatusOr<fulcrum::ElasticOutcome> outcome = (*controller)->Run(
      **trainer, checked.checkpoint, [] { return g_stop_signal != 0; });
  if (!outcome.ok()) return Fail(outcome.status());
  if (*outcome == fulcrum::ElasticOutcome::kReleased) return 0;
  if (*outcome == fulcrum::ElasticOutcome::kRelaunch) return fulcrum::kRelaunchExitCode;
  if (!config->train.save.empty() && (*controller)->roles().is_logging_rank) {
    FULCRUM_LOG(INFO) << "checkpoints are in " << config->train.save;
  }
  return 0;
}

}  // namespace
