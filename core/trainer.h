// The training loop of one process: data → micro-batches → forward/backward with gradient
// accumulation → global grad-norm clipping → AdamW step on the learning-rate schedule →
// logs, metrics, evaluation and checkpoints.
//
// The loop's whole state is (model units, iteration, consumed samples): the data position
// is the number of consumed samples (NOTE [Stateless data position]) and every random draw
// is keyed by counters (NOTE [layout-independent randomness]), so a run saved at iteration
// N and resumed reproduces the uninterrupted run bit for bit on CPU.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/data/gpt_dataset.h"
#include "core/data/indexed_dataset.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/metrics.h"
#include "core/optimizer/lr_schedule.h"
#include "core/optimizer/optimizer.h"
#include "core/parallel_context.h"
#include "core/plugin.h"
#include "core/rank_roles.h"
#include "core/tensorboard_writer.h"

namespace fulcrum {

namespace ckpt {
class CheckpointReader;
}  // namespace ckpt
class BackgroundSave;   // core/distributed_checkpoint.h
class SaveInProgress;

/// Everything a training run is configured by.
struct TrainerConfig {
  ModelOptions model;
  OptimizerOptions optimizer;
  LrScheduleOptions schedule;
  TrainOptions train;
  data::GptDatasetOptions data;  // seq_length must equal model.seq_length.
  /// Where the corpus came from (--data_path; empty: the embedded corpus). Recorded in
  /// checkpoints with the corpus's size, so a resume on other data is noticed.
  std::string data_path;
  /// Settings of the plugins (core/plugin.h; the MoE layers) that decide their parameters,
  /// as (flag name, value), e.g. {"num_experts", "8"}: recorded in checkpoints, and a
  /// resume with other values is refused naming the flag. Empty for a dense model.
  std::vector<std::pair<std::string, std::string>> feed_forward_shape;
  absl::Status Validate() const;
};

/// What one iteration measured.
struct IterationStats {
  int64_t iteration = 0;
  double loss = 0;         // Mean token cross-entropy over the global batch.
  double lr = 0;
  double grad_norm = 0;    // Global L2 norm before clipping.
  double iteration_ms = 0;
  double tokens_per_second = 0;
  /// Wall time the step spent on the data-parallel gradient reduction: all of it, or with
  /// --overlap_grad_reduce what was left to wait for (StepResult::reduce_ms).
  double grad_reduce_ms = 0;
  /// A stop was requested on some rank before this iteration's reductions (every rank sees
  /// the same value; NOTE [graceful stop]).
  bool stop_requested = false;
};

/// Where a trainer sits in the job. The default is the one-process job, which runs its
/// micro-batches itself.
struct TrainerLayout {
  /// The collectives of the layout; null: one process. Must outlive the trainer.
  ParallelContext* parallel = nullptr;
  /// This rank's roles under that layout (parallel/rank_roles.h, RankRolesOf); the default
  /// is the one-process job's, the only one allowed without `parallel`.
  RankRoles roles;
  /// Runs each iteration's forward and backward passes over the pipeline's stages; null:
  /// the trainer's own loop (one stage). Must outlive the trainer.
  ForwardBackwardRunner* runner = nullptr;
};

class Trainer {
 public:
  /// Waits for a background save still being written; it is not committed (NOTE
  /// [background saves]).
  ~Trainer();
  /// Builds the model and the train/valid sample sets over `corpus`. Validates `config`
  /// and `layout` first; nothing heavy happens before validation passes. `plugins` (may be
  /// null: none) build parts of the layers and act at fixed points of each iteration
  /// (core/plugin.h). With TrainOptions::async_save, `fs` is used from the background
  /// save's thread too and must be thread-safe.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const TrainerConfig& config, std::shared_ptr<const data::IndexedDataset> corpus,
      const TrainerLayout& layout = {}, FileSystem* fs = DefaultFileSystem(),
      std::shared_ptr<PluginSet> plugins = nullptr);
  /// The same with only a FeedForwardFactory replacing the MLP of chosen layers.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(
      const TrainerConfig& config, std::shared_ptr<const data::IndexedDataset> corpus,
      const TrainerLayout& layout, FileSystem* fs, FeedForwardFactory feed_forward);

  /// Restores model, optimizer state, iteration and data position from `path` (a save
  /// directory following its `latest`, or one iteration directory). With
  /// TrainOptions::finetune, the model weights only, from iteration 0 (NOTE [finetune]).
  /// An imported checkpoint (ckpt::kImportedFromField) needs finetune.
  absl::Status Load(const std::string& path);
  /// The same from a checkpoint already opened (fulcrum_train opens --load before any work,
  /// with the reading options its flags give).
  absl::Status Load(const ckpt::CheckpointReader& reader);

  /// Trains until train_iters (or the next multiple of exit_interval), saving on the
  /// configured intervals and at the end — or until a stop is requested (SetStopRequest):
  /// then it finishes the iteration in progress, saves it (when train.save is set) and
  /// returns OK. stopped() tells which.
  absl::Status Run();

  // NOTE [graceful stop]
  // A scheduler pre-empts a job with SIGTERM (SIGINT from a terminal); fulcrum_launch
  // forwards it to every rank, but each rank sees it at its own moment. So the request is
  // not acted on where it is seen: each rank adds its flag to the reductions every
  // iteration already does (the loss over data parallelism, the gradient norm over the
  // model-parallel ranks), which makes it a sum over the whole job at no extra collective,
  // and every rank stops after the same iteration. main() owns the signal handlers; the
  // trainer only reads the flag through the function given here.
  /// `requested` (may be empty) says whether this rank was asked to stop; it is read once
  /// per iteration and must be cheap and async-signal-safe to back (an atomic flag).
  /// `reason` (may be empty: "a stop signal") names the request in the log line of the stop.
  void SetStopRequest(std::function<bool()> requested,
                      std::function<std::string()> reason = nullptr) {
    stop_request_ = std::move(requested);
    stop_reason_ = std::move(reason);
  }
  /// Whether the last Run ended on a stop request.
  bool stopped() const { return stopped_; }

  /// Continues on another parallel layout (a live shrink after re-packing, dynamic/repack.h
  /// and pipeline/shrink.h): builds the model of `layout.parallel`'s stage, lets `fill` load
  /// the state of its units (from `old_model`, this rank's model so far, and from other
  /// ranks), then trains on it under `layout` (its context and runner must outlive the
  /// trainer). The plugins' AfterLoad runs as after a checkpoint load. Call between Runs, on
  /// every rank that goes on; `layout.parallel` must be set and the data-parallel size must
  /// not change.
  absl::Status ChangeLayout(
      const TrainerLayout& layout,
      const std::function<absl::Status(const GptModel& old_model, GptModel& new_model)>& fill);

  /// A dynamism changed the model after the current iteration (pruned, froze layers...):
  /// the pipeline's measured per-layer costs are stale, so its rebalancer profiles the next
  /// iteration and decides after it (pipeline/rebalancer.h, Rebalancer::OnModelChanged).
  /// Every rank must call it alike; a no-op without a pipeline.
  void NotifyModelChanged(const std::string& reason);

  /// One optimizer step over one global batch.
  absl::StatusOr<IterationStats> TrainIteration();

  /// Mean validation loss over eval_iters global batches from the start of the valid
  /// split (the same batches every time, so values are comparable across evaluations).
  absl::StatusOr<double> Evaluate();

  /// Writes a checkpoint of the current state into train.save, complete when this returns
  /// (after finishing a background save still in flight). Collective over the whole job.
  absl::Status Save();

  GptModel& model() { return *model_; }
  /// Makes every parameter's whole optimizer state readable from its Parameter (NOTE
  /// [optimizer state residency]), for code that moves state itself (the live shrink);
  /// the optimizer takes it back at its next step. Collective over the data-parallel groups.
  absl::Status GatherOptimizerState() {
    return optimizer_->GatherState(model_->Units(), collectives());
  }
  /// Bytes of optimizer state (Adam moments) this rank holds: all of its parameters' under
  /// AdamW, a data-parallel slice under the distributed optimizer (after its first step).
  int64_t OptimizerStateBytes() const { return optimizer_->StateBytes(model_->Units()); }
  int64_t iteration() const { return iteration_; }
  int64_t consumed_samples() const { return consumed_samples_; }
  const TrainerConfig& config() const { return config_; }

 private:
  Trainer(const TrainerConfig& config, const TrainerLayout& layout, FileSystem* fs);
  /// Run's loop; Run abandons a background save it leaves in flight on failure.
  absl::Status RunIterations();
  /// The first phase of a save of the current state (StartSave), with the optimizer's state
  /// where the checkpoint format reads it. Collective over the whole job.
  std::unique_ptr<SaveInProgress> BeginSave(bool snapshot);
  /// --async_save: snapshots the current state and writes it in the background (NOTE
  /// [background saves]), after finishing the one still in flight. Collective.
  absl::Status SaveInBackground();
  /// Finishes the background save in flight, if any: with `wait`, once this rank's write
  /// ends; without, only if every rank's write has already ended. Collective.
  absl::Status FinishBackgroundSave(bool wait);
  int dp_rank() const { return layout_.roles.dp_rank; }
  int dp_size() const { return layout_.roles.dp_size; }
  bool is_logging_rank() const { return layout_.roles.is_logging_rank; }
  /// Tokens [b, s+1] of the micro-batch at `first_sample`.
  at::Tensor MicroBatch(const data::GptDataset& dataset, int64_t first_sample) const;
  /// Reads the micro-batch at `first_sample` in one pass over the data: its tokens [b, s+1]
  /// and the inputs' positions in the split [s, b] (ForwardContext::token_positions); a
  /// null pointer skips that part.
  void ReadMicroBatch(const data::GptDataset& dataset, int64_t first_sample, at::Tensor* tokens,
                      at::Tensor* positions) const;
  nlohmann::json ManifestFields(const std::vector<std::pair<int64_t, int64_t>>& stage_ranges) const;
  /// What the run trains on (checkpoints record it; NOTE [resume checks]).
  int64_t corpus_documents_ = 0;
  int64_t corpus_tokens_ = 0;
  int64_t corpus_max_token_ = 0;  // The largest token id in the data.
  /// The FeedForward blocks' statistics of the last step, over every stage (collective
  /// over the pipeline group).
  nlohmann::json BlockStatistics();
  /// Every layer's Load() (TransformerLayer: a block's or plugin's measure of its work),
  /// by layer, over every stage (collective over the model-parallel ranks).
  nlohmann::json LayerLoads();
  /// A hook's context for `iteration`.
  PluginContext MakePluginContext(int64_t iteration);

  TrainerConfig config_;
  TrainerLayout layout_;
  // The collectives the trainer runs: layout_.parallel's, or the identities of one process.
  SingleProcessContext single_process_;
  ParallelContext& collectives() {
    return layout_.parallel != nullptr ? *layout_.parallel : single_process_;
  }
  FileSystem* fs_;
  std::unique_ptr<GptModel> model_;
  // Lets the runner ask the optimizer for whole state before layers move.
  void HookOptimizerToLayerMoves();
  // AdamW (core/optimizer/adamw.h), or with --use_distributed_optimizer DistributedAdamW.
  std::unique_ptr<Optimizer> optimizer_;
  LrSchedule schedule_;
  std::unique_ptr<data::GptDataset> train_data_;
  std::unique_ptr<data::GptDataset> valid_data_;  // Null when the valid split is empty.
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<MetricsWriter> load_trace_;  // --load_trace; logging rank only.
  std::unique_ptr<TensorBoardWriter> tensorboard_;  // --tensorboard_dir; logging rank only.
  int64_t iteration_ = 0;
  int64_t consumed_samples_ = 0;
  std::shared_ptr<PluginSet> plugins_;  // Never null; may be empty.
  std::function<bool()> stop_request_;
  std::function<std::string()> stop_reason_;
  bool stopped_ = false;
  // --async_save: the save being written in the background; null when none is. Last, so it
  // is destroyed (its thread joined) first.
  std::unique_ptr<BackgroundSave> background_save_;
};

/// The configuration as JSON (recorded in checkpoint manifests and logged at start).
nlohmann::json ConfigToJson(const TrainerConfig& config);

}  // namespace fulcrum
