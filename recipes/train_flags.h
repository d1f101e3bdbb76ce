// fulcrum_train's command line: gflags definitions (Megatron-LM names with underscores)
// and their conversion into options structs. The only place these flags are read.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/data/indexed_dataset.h"
#include "core/threads.h"
#include "core/trainer.h"
#include "dynamic/balancing_rebalancer.h"
#include "parallel/parallel_config.h"
#include "parallel/world_communicator.h"
#include "pipeline/rebalancer.h"
#include "recipes/cli.h"

namespace fulcrum {

/// Applies --recipe: sets the recipe's flags as defaults, keeping every flag the user set
/// explicitly (command line or --flagfile). Unknown recipe → InvalidArgument listing them.
absl::Status ApplyRecipe();

/// fulcrum_train's --help: what it does, the registered recipes, routers and schedules, and
/// its flags in groups (recipes/cli.h).
cli::HelpSpec TrainHelpSpec();

/// The training corpus and its vocabulary size: --data_path (with --tokenizer_model or
/// --vocab_size, else the largest token id + 1), or the embedded default corpus.
struct TrainData {
  std::shared_ptr<const data::IndexedDataset> corpus;
  int64_t vocab_size = 0;      // Before padding.
  std::string description;
};
absl::StatusOr<TrainData> LoadTrainData();

/// The parallel layout of the flags over `world_size` processes, validated: sizes divide
/// the world, and the model's heads / MLP / vocabulary divide by tp; a pipeline needs a
/// layer per stage and a valid --pipeline_schedule for its micro-batch count; expert
/// parallelism needs MoE layers whose expert count it divides.
absl::StatusOr<parallel::ParallelConfig> ParallelConfigFromFlags(int world_size);

/// Flags → TrainerConfig, validated. The vocabulary is padded to a multiple of
/// --make_vocab_size_divisible_by whatever the layout (the padded size changes the softmax),
/// which tp must divide. `vocab_size` 0 means not known yet: every other flag is checked.
/// --device resolves for `local_rank` (LOCAL_RANK: cuda means that rank's GPU); a GPU that
/// is not visible, or --bf16 over fp64 masters, is refused naming the flag.
absl::StatusOr<TrainerConfig> ConfigFromFlags(int64_t vocab_size, int tp = 1, int local_rank = 0);


/// --distributed_backend and --distributed_timeout_minutes.
std::string DistributedBackendFlag();
/// --distributed_backend resolved against the run's device (the resolved --device, i.e.
/// ModelOptions::device_spec.device; parallel::ResolveBackend): auto picks nccl on a GPU and
/// gloo on the CPU; nccl on the CPU, or in a build without NCCL, is refused with a message
/// naming both flags.
absl::StatusOr<parallel::Backend> DistributedBackendFromFlags(const c10::Device& device);
std::string PipelineScheduleFlag();
/// The model chunks per stage v (virtual pipeline stages) for `pp` stages, from
/// --virtual_pipeline_model_parallel_size or --num_layers_per_virtual_pipeline_stage (one
/// of them; Megatron's names) and --pipeline_schedule (zbv implies 2 and refuses another v;
/// v > 1 needs pp > 1 and --num_layers ≥ pp·v). 1 without virtual stages. Whether the
/// schedule has a form with chunks, and interleaving's micro-batch rule (m % pp == 0), are
/// MakeSchedule's, checked with the layout.
absl::StatusOr<int> VirtualPipelineChunksFromFlags(int pp);
std::string TimelineFlag();
/// The balancing flags (--balance_by, --rebalance_*, --diffusion_max_rounds), validated.
absl::StatusOr<dynamic::BalancerOptions> BalancerOptionsFromFlags();
/// The rebalancer: --rebalance_script's, else --rebalancer's (none: never moves).
absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> RebalancerFromFlags();
/// --pipeline_initial_partition=params.
bool InitialPartitionByParamsFlag();
int64_t DistributedTimeoutMinutesFlag();
/// The compute threads per process: --num_threads, or when it is 0 DefaultComputeThreads()
/// ($OMP_NUM_THREADS, else all cores); InvalidArgument if < 0.
absl::StatusOr<ThreadChoice> NumThreadsFlag();

/// --load, or empty.
std::string LoadPathFlag();
/// --allow_unchecksummed_manifest (ckpt::CheckpointReadOptions).
bool AllowUnchecksummedManifestFlag();
/// --plugins as given (plugins::SelectPlugins adds those their own flags ask for).
std::string PluginsFlag();
/// --device as given (cpu, cuda, cuda:N, auto), for the startup log.
std::string DeviceFlag();
/// --layer_timing: whether pipeline runs time each layer (StageExecutor::set_layer_timing).
bool LayerTimingFlag();
/// --zbv_order=measured (NOTE [ZB-V at measured costs] in pipeline/measured_order.h).
bool MeasuredZbvOrderFlag();

}  // namespace fulcrum
