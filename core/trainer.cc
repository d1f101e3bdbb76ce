#include "core/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checkpoint.h"
#include "core/distributed_checkpoint.h"
#include "core/linear.h"
#include "core/logging.h"
#include "core/optimizer/adamw.h"
#include "core/optimizer/distributed_adamw.h"
#include "core/status.h"
#include "core/training_manifest.h"

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

double MillisecondsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// The JSON-lines file `path` that flag `flag` (metrics_file, load_trace) names, opened for
// appending; an error names the flag.
absl::StatusOr<std::unique_ptr<MetricsWriter>> OpenJsonLines(const std::string& path,
                                                             const char* flag) {
  absl::StatusOr<std::unique_ptr<MetricsWriter>> writer = MetricsWriter::Open(path);
  if (!writer.ok()) {
    return absl::Status(writer.status().code(),
                        absl::StrCat("--", flag, ": ", writer.status().message()));
  }
  return writer;
}

}  // namespace

nlohmann::json ConfigToJson(const TrainerConfig& c) {
  nlohmann::json j;
  j["model"] = {{"num_layers", c.model.num_layers},
                {"hidden_size", c.model.hidden_size},
                {"num_attention_heads", c.model.num_attention_heads},
                {"ffn_hidden_size", c.model.ffn_hidden_size},
                {"vocab_size", c.model.vocab_size},
                {"seq_length", c.model.seq_length},
                {"position_embedding_type", PositionEmbeddingName(c.model.position_embedding)},
                // The learned table's rows; 0: rotary positions, no table.
                {"max_position_embeddings",
                 c.model.position_embedding == PositionEmbedding::kLearned
                     ? c.model.position_rows()
                     : int64_t{0}},
                {"rotary_base", c.model.rotary_base},
                {"tie_embeddings", c.model.tie_embeddings},
                {"init_method_std", c.model.init_method_std},
                {"layernorm_epsilon", c.model.layernorm_epsilon},
                {"normalization", NormalizationName(c.model.normalization)},
                {"swiglu", c.model.swiglu},
                {"num_query_groups", c.model.query_groups()},
                {"add_bias_linear", c.model.add_bias_linear},
                {"openai_gelu", c.model.openai_gelu},
                {"hidden_dropout", c.model.hidden_dropout},
                {"attention_dropout", c.model.attention_dropout},
                {"seed", c.model.seed},
                {"params_dtype", DtypeName(c.model.device_spec.master_dtype)}};
  // Where and in which precision the run computed (NOTE [device seam]): for the reader, not
  // a resume check — a checkpoint holds master-dtype values whatever the compute dtype or
  // device, so a bf16 run may resume an fp32 one's checkpoint and the other way round.
  j["device"] = {{"device", c.model.device_spec.device.str()},
                 {"compute_dtype", DtypeName(c.model.device_spec.compute_dtype)},
                 {"master_dtype", DtypeName(c.model.device_spec.master_dtype)}};
  j["optimizer"] = {{"lr", c.optimizer.lr},
                    {"min_lr", c.optimizer.min_lr},
                    {"weight_decay", c.optimizer.weight_decay},
                    {"adam_beta1", c.optimizer.adam_beta1},
                    {"adam_beta2", c.optimizer.adam_beta2},
                    {"adam_eps", c.optimizer.adam_eps},
                    {"clip_grad", c.optimizer.clip_grad}};
  j["lr_schedule"] = {{"lr", c.schedule.lr},
                      {"min_lr", c.schedule.min_lr},
                      {"warmup_iters", c.schedule.warmup_iters},
                      {"decay_iters", c.schedule.decay_iters},
                      {"decay_style", LrDecayStyleName(c.schedule.decay_style)}};
  j["train"] = {{"micro_batch_size", c.train.micro_batch_size},
                {"global_batch_size", c.train.global_batch_size},
                {"train_iters", c.train.train_iters}};
  j["data"] = {{"seq_length", c.data.seq_length}, {"seed", c.data.seed}, {"split", c.data.split}};
  j["feed_forward"] = nlohmann::json::object();
  for (const auto& [name, value] : c.feed_forward_shape) j["feed_forward"][name] = value;
  return j;
}

absl::Status TrainerConfig::Validate() const {
  FULCRUM_RETURN_IF_ERROR(model.Validate());
  FULCRUM_RETURN_IF_ERROR(optimizer.Validate());
  FULCRUM_RETURN_IF_ERROR(schedule.Validate());
  FULCRUM_RETURN_IF_ERROR(train.Validate());
  if (data.seq_length != model.seq_length) {
    return absl::InvalidArgumentError(absl::StrCat("data seq_length ", data.seq_length,
                                                   " differs from model seq_length ",
                                                   model.seq_length));
  }
  return absl::OkStatus();
}

Trainer::~Trainer() = default;

Trainer::Trainer(const TrainerConfig& config, const TrainerLayout& layout, FileSystem* fs)
    : config_(config),
      layout_(layout),
      fs_(fs),
      optimizer_(config.optimizer.use_distributed_optimizer
                     ? std::unique_ptr<Optimizer>(std::make_unique<DistributedAdamW>(config.optimizer))
                     : std::make_unique<AdamW>(config.optimizer)),
      schedule_(config.schedule, config.train.train_iters) {}

namespace {

// A plugin that only replaces MLPs, for Trainer::Create's FeedForwardFactory overload.
class FeedForwardOnly final : public Plugin {
 public:
  explicit FeedForwardOnly(FeedForwardFactory factory) : factory_(std::move(factory)) {}
  const char* name() const override { return "feed_forward"; }
  // A block sees the whole sequence (NOTE [sequence parallelism]).
  bool SupportsSequenceParallel() const override { return true; }
  std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit& unit, bool initialize) override {
    return factory_(layer, unit, initialize);
  }

 private:
  FeedForwardFactory factory_;
};

// A layout without collectives is the one-process job: roles of a bigger job there would
// make this rank skip its share of logging or saving with nobody to do it instead.
absl::Status ValidateLayout(const TrainerLayout& layout) {
  if (layout.parallel == nullptr && layout.roles.world_size != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the roles of rank ", layout.roles.world_rank, " of ", layout.roles.world_size,
        " ranks need a ParallelContext (TrainerLayout::parallel is null)"));
  }
  return absl::OkStatus();
}

// Plugins that cannot run under a feature the config turns on, refused by name before any
// work starts.
absl::Status RefuseUnsupportedPlugins(const TrainerConfig& config, const PluginSet* plugins) {
  if (plugins == nullptr) return absl::OkStatus();
  for (const auto& plugin : plugins->plugins()) {
    if (config.model.recompute_layers && !plugin->SupportsRecompute()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--recompute_granularity=full: plugin '", plugin->name(),
          "' does not support recomputation yet (its blocks would measure the recomputed "
          "forward a second time)"));
    }
    if (config.model.sequence_parallel && !plugin->SupportsSequenceParallel()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sequence_parallel: plugin '", plugin->name(),
          "' does not support sequence-parallel layers yet (it reads or edits hidden states "
          "that a layer holds only in sequence shards)"));
    }
    if (config.optimizer.use_distributed_optimizer && plugin->ReadsWholeGradients()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--use_distributed_optimizer: plugin '", plugin->name(),
          "' reads or edits reduced gradients or optimizer state through the Parameters "
          "(ReadsWholeGradients), which the distributed optimizer does not reduce into or "
          "keeps only in slices; a plugin that uses PluginContext::gradients() and "
          "OptimizerStateParts() runs under it"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const TrainerConfig& config, std::shared_ptr<const data::IndexedDataset> corpus,
    const TrainerLayout& layout, FileSystem* fs, FeedForwardFactory feed_forward) {
  auto plugins = std::make_shared<PluginSet>();
  if (feed_forward) plugins->Add(std::make_unique<FeedForwardOnly>(std::move(feed_forward)));
  return Create(config, std::move(corpus), layout, fs, std::move(plugins));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const TrainerConfig& config, std::shared_ptr<const data::IndexedDataset> corpus,
    const TrainerLayout& layout, FileSystem* fs, std::shared_ptr<PluginSet> plugins) {
  FULCRUM_RETURN_IF_ERROR(config.Validate());
  FULCRUM_RETURN_IF_ERROR(ValidateLayout(layout));
  ParallelContext* parallel = layout.parallel;
  const int dp = layout.roles.dp_size;
  if (config.train.global_batch_size % (config.train.micro_batch_size * dp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--global_batch_size=", config.train.global_batch_size,
        " is not a multiple of --micro_batch_size=", config.train.micro_batch_size,
        " × data-parallel size ", dp));
  }
  FULCRUM_RETURN_IF_ERROR(RefuseUnsupportedPlugins(config, plugins.get()));
  // NOTE [sequence parallelism]: the sequence splits evenly over the tensor-parallel ranks
  // (the flags check this too; a config built in code meets it here, before any work).
  if (TensorParallelGroup* tp = parallel ? parallel->tensor_parallel() : nullptr;
      config.model.sequence_parallel && tp != nullptr && config.model.seq_length % tp->size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sequence_parallel: seq_length ", config.model.seq_length,
        " is not a multiple of the tensor-parallel size ", tp->size()));
  }
  std::unique_ptr<Trainer> trainer(new Trainer(config, layout, fs));
  trainer->plugins_ = plugins ? std::move(plugins) : std::make_shared<PluginSet>();
  trainer->corpus_documents_ = corpus->num_sequences();
  trainer->corpus_tokens_ = corpus->num_tokens();
  FULCRUM_ASSIGN_OR_RETURN(trainer->train_data_,
                           data::GptDataset::Create(corpus, data::Split::kTrain, config.data));
  if (config.train.eval_interval > 0) {
    FULCRUM_ASSIGN_OR_RETURN(trainer->valid_data_,
                             data::GptDataset::Create(corpus, data::Split::kValid, config.data));
  }
  const int64_t max_token = corpus->MaxToken();
  trainer->corpus_max_token_ = max_token;
  if (max_token >= config.model.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the data holds token id ", max_token, " but the vocabulary has ",
        config.model.vocab_size, " entries (--vocab_size / --tokenizer_model)"));
  }
  if (!config.train.metrics_file.empty() && trainer->is_logging_rank()) {
    FULCRUM_ASSIGN_OR_RETURN(trainer->metrics_,
                             OpenJsonLines(config.train.metrics_file, "metrics_file"));
  }
  if (!config.train.load_trace.empty() && trainer->is_logging_rank()) {
    FULCRUM_ASSIGN_OR_RETURN(trainer->load_trace_,
                             OpenJsonLines(config.train.load_trace, "load_trace"));
  }
  if (!config.train.tensorboard_dir.empty() && trainer->is_logging_rank()) {
    FULCRUM_ASSIGN_OR_RETURN(trainer->tensorboard_,
                             TensorBoardWriter::Open(fs, config.train.tensorboard_dir));
  }
  // The plugins learn the layout before any layer is built (NOTE [plugin doors]).
  FULCRUM_RETURN_IF_ERROR(trainer->plugins_->OnLayout(parallel));
  trainer->model_ = std::make_unique<GptModel>(
      config.model, trainer->collectives().Stage(config.model.num_layers),
      trainer->collectives().tensor_parallel(), trainer->plugins_);
  trainer->HookOptimizerToLayerMoves();
  return trainer;
}

at::Tensor Trainer::MicroBatch(const data::GptDataset& dataset, int64_t first_sample) const {
  at::Tensor tokens;
  ReadMicroBatch(dataset, first_sample, &tokens, nullptr);
  return tokens;
}

void Trainer::ReadMicroBatch(const data::GptDataset& dataset, int64_t first_sample,
                             at::Tensor* tokens, at::Tensor* positions) const {
  const int64_t mbs = config_.train.micro_batch_size;
  const int64_t width = config_.data.seq_length + 1;
  at::Tensor what = tokens ? at::empty({mbs, width}, at::kLong) : at::Tensor();
  at::Tensor where = positions ? at::empty({mbs, width}, at::kLong) : at::Tensor();
  for (int64_t i = 0; i < mbs; ++i) {
    dataset.GetSample(first_sample + i, tokens ? what.data_ptr<int64_t>() + i * width : nullptr,
                      positions ? where.data_ptr<int64_t>() + i * width : nullptr);
  }
  if (tokens) *tokens = what;
  if (positions) *positions = where.narrow(1, 0, width - 1).t().contiguous();
}

absl::StatusOr<IterationStats> Trainer::TrainIteration() {
  const auto start = Clock::now();
  const TrainOptions& t = config_.train;
  // Micro-batch m of the global batch covers samples [m·mbs, (m+1)·mbs) after the consumed
  // ones whatever the layout; data-parallel rank d runs a contiguous block of them.
  const int64_t local_micro = t.global_batch_size / (t.micro_batch_size * dp_size());
  const int64_t first_micro = dp_rank() * local_micro;
  const auto first_sample = [&](int64_t m) {
    return consumed_samples_ + (first_micro + m) * t.micro_batch_size;
  };
  const double total_tokens =
      static_cast<double>(t.global_batch_size) * static_cast<double>(config_.data.seq_length);
  const int64_t iteration = iteration_ + 1;
  const int64_t epoch = train_data_->EpochOf(consumed_samples_);

  model_->ZeroGrad();
  {
    PluginContext ctx = MakePluginContext(iteration);
    FULCRUM_RETURN_IF_ERROR(plugins_->BeforeIteration(ctx));
  }
  // NOTE [overlapped gradient reduction]: the buckets are cut on the model the plugins
  // left; each unit is reported as its gradients become final.
  std::function<absl::Status(const Unit&)> gradients_final;
  if (config_.optimizer.overlap_grad_reduce) {
    FULCRUM_RETURN_IF_ERROR(optimizer_->BeginGradientReduction(model_->Units(), collectives()));
    gradients_final = [this](const Unit& unit) {
      return optimizer_->GradientsFinal(unit, collectives());
    };
  }
  double loss_sum = 0.0;
  // Each micro-batch's loss is scaled by the global token count, so accumulated (and
  // data-parallel summed) gradients are those of the mean loss over the global batch.
  ForwardBackwardRunner* pipeline = layout_.runner;
  if (pipeline != nullptr) {
    MicroBatchPlan plan;
    plan.gradients_final = gradients_final;
    plan.count = static_cast<int>(local_micro);
    plan.first_sample = first_sample;
    plan.tokens = [&](int m) { return MicroBatch(*train_data_, plan.first_sample(m)); };
    plan.token_positions = [&](int m) {
      at::Tensor positions;
      ReadMicroBatch(*train_data_, plan.first_sample(m), nullptr, &positions);
      return positions;
    };
    plan.epoch = epoch;
    FULCRUM_ASSIGN_OR_RETURN(auto result, pipeline->Run(*model_, iteration, plan, 1.0 / total_tokens));
    loss_sum = result.first;
  } else {
    // NOTE [no host waits inside the step]: on a GPU a host copy of the batch or a read of
    // the loss waits for the work queued before it, and the device idles while the host then
    // launches the next micro-batch. So every micro-batch's tokens go to the device before
    // the first forward, and the losses add up there (fp64, in micro-batch order: the same
    // bits as adding them on the host) and are read once, after the last backward.
    const c10::Device device = model_->options().device_spec.device;
    std::vector<at::Tensor> tokens(local_micro), positions(local_micro);
    for (int64_t m = 0; m < local_micro; ++m) {
      ReadMicroBatch(*train_data_, first_sample(m), &tokens[m],
                     model_->needs_token_positions() ? &positions[m] : nullptr);
      tokens[m] = tokens[m].to(device);
    }
    at::Tensor losses;
    for (int64_t m = 0; m < local_micro; ++m) {
      ForwardContext ctx{/*training=*/true, iteration, first_sample(m), 1.0 / total_tokens};
      ctx.epoch = epoch;
      ctx.token_positions = positions[m];
      LossSum loss = model_->ForwardLoss(tokens[m], ctx);
      const at::Tensor sum = loss.sum.detach().to(at::kDouble);
      losses = losses.defined() ? losses + sum : sum;
      if (m + 1 < local_micro || !gradients_final) {
        (loss.sum / total_tokens).backward();
        continue;
      }
      // The last micro-batch under --overlap_grad_reduce: its weight gradients deferred
      // (NOTE [B/W split]) and run one layer at a time, last first, each layer's reduction
      // starting after its own (NOTE [overlapped gradient reduction]).
      WeightGradStore store;
      {
        WeightGradStore::Scope scope(&store);
        (loss.sum / total_tokens).backward();
      }
      FULCRUM_RETURN_IF_ERROR(model_->ReportFinalGradients(
          0, model_->options().num_layers, /*with_head=*/true, /*with_embedding=*/true,
          [&](std::optional<int64_t> tag) { store.Run(tag); },
          gradients_final));
    }
    if (losses.defined()) loss_sum += losses.item<double>();
  }
  // NOTE [tied head on the embedding's rank] (a no-op unless one stage runs both chunks).
  model_->FoldTiedHeadGradient();
  // The units are read only now: a pipeline run may have moved layers between stages
  // (NOTE [layer migration]), and the optimizer step runs on the new layout.
  const std::vector<Unit*> units = model_->Units();
  // The stop flag rides along (NOTE [graceful stop]): summed over data parallelism with the
  // loss, then over the model-parallel ranks with the gradient norm — over the whole job.
  StepRequest request;
  request.lr = schedule_.At(iteration);
  request.data_parallel_sums = {loss_sum};
  request.job_sums = {stop_request_ && stop_request_() ? 1.0 : 0.0};
  request.after_reduce = [&](ReducedGradients& gradients) {
    // The gradients are complete and agree over the replicas (e.g. masked by pruning).
    PluginContext ctx = MakePluginContext(iteration);
    ctx.set_gradients(&gradients);
    return plugins_->AfterBackward(ctx);
  };
  FULCRUM_ASSIGN_OR_RETURN(const StepResult step,
                           optimizer_->ReduceAndStep(units, collectives(), request));
  const double lr = request.lr;
  const double grad_norm = step.grad_norm;
  const bool stop_requested = step.job_sums[0] > 0;
  loss_sum = step.data_parallel_sums[0];
  if (!step.stepped) {
    return absl::InternalError(absl::StrCat("iteration ", iteration, ": gradient norm is ",
                                            grad_norm, " (loss ", loss_sum / total_tokens,
                                            "); lower --lr or check the data"));
  }
  for (const auto& [index, layer] : model_->layers()) {
    if (FeedForward* block = layer->feed_forward()) block->AfterOptimizerStep();
  }
  {
    PluginContext ctx = MakePluginContext(iteration);
    FULCRUM_RETURN_IF_ERROR(plugins_->AfterOptimizerStep(ctx));
  }

  iteration_ = iteration;
  consumed_samples_ += t.global_batch_size;
  IterationStats stats;
  stats.iteration = iteration;
  stats.loss = loss_sum / total_tokens;
  stats.lr = lr;
  stats.grad_norm = grad_norm;
  stats.iteration_ms = MillisecondsSince(start);
  stats.tokens_per_second = total_tokens / (stats.iteration_ms / 1000.0);
  stats.stop_requested = stop_requested;
  stats.grad_reduce_ms = step.reduce_ms;
  return stats;
}

void Trainer::NotifyModelChanged(const std::string& reason) {
  if (ForwardBackwardRunner* pipeline = layout_.runner) {
    pipeline->ModelChanged(iteration_, reason);
  }
}

PluginContext Trainer::MakePluginContext(int64_t iteration) {
  ForwardBackwardRunner* pipeline = layout_.runner;
  PluginContext ctx(
      iteration, *model_, layout_.parallel,
      [pipeline, iteration](const std::string& reason) {
        if (pipeline != nullptr) pipeline->ModelChanged(iteration, reason);
      },
      layout_.roles);
  ctx.set_optimizer_state_parts([this] { return optimizer_->StateParts(model_->Units(), collectives()); });
  return ctx;
}

nlohmann::json Trainer::LayerLoads() {
  // Each layer's load once: from tensor-parallel rank 0 of the stage holding it, summed
  // over the model-parallel ranks (zeros elsewhere).
  std::vector<double> loads(config_.model.num_layers, 0.0);
  const std::vector<Unit*> units = model_->Units();
  const bool first_shard = units.empty() || units[0]->tp_rank() == 0;
  if (first_shard) {
    for (const auto& [index, layer] : model_->layers()) loads[index] = layer->Load();
  }
  collectives().SumOverModelParallel(loads);
  nlohmann::json out = nlohmann::json::object();
  for (size_t i = 0; i < loads.size(); ++i) out[absl::StrCat("layers.", i)] = loads[i];
  return out;
}

nlohmann::json Trainer::BlockStatistics() {
  // This stage's statistics, then every stage's: scalars summed over layers, vectors kept
  // per layer ({"expert_tokens": {"layers.1": [...], ...}}).
  nlohmann::json mine = nlohmann::json::object();
  for (const auto& [index, layer] : model_->layers()) {
    const FeedForward* block = layer->feed_forward();
    if (block == nullptr) continue;
    for (const BlockStatistic& stat : block->Statistics()) {
      if (stat.per_layer) {
        mine[stat.name][layer->name()] = stat.values;
      } else if (!stat.values.empty()) {
        mine[stat.name] = mine.value(stat.name, 0.0) + stat.values[0];
      }
    }
  }
  const std::vector<std::string> stages = collectives().GatherOverPipeline(mine.dump());
  nlohmann::json merged = nlohmann::json::object();
  for (const std::string& text : stages) {
    const nlohmann::json stage = nlohmann::json::parse(text);
    for (const auto& [name, value] : stage.items()) {
      if (value.is_number()) {
        merged[name] = merged.value(name, 0.0) + value.get<double>();
      } else {
        if (!merged.contains(name)) merged[name] = nlohmann::json::object();
        merged[name].update(value);
      }
    }
  }
  return merged;
}

absl::StatusOr<double> Trainer::Evaluate() {
  if (!valid_data_) {
    return absl::FailedPreconditionError("evaluation needs a non-empty valid split (--split)");
  }
  at::NoGradGuard no_grad;
  const TrainOptions& t = config_.train;
  const int64_t local_micro = t.global_batch_size / (t.micro_batch_size * dp_size());
  std::vector<double> sums{0.0, 0.0};  // loss, tokens
  ForwardBackwardRunner* pipeline = layout_.runner;
  for (int64_t batch = 0; batch < t.eval_iters; ++batch) {
    MicroBatchPlan plan;
    plan.count = static_cast<int>(local_micro);
    plan.first_sample = [&](int m) {
      return (batch * (local_micro * dp_size()) + dp_rank() * local_micro + m) * t.micro_batch_size;
    };
    plan.tokens = [&](int m) { return MicroBatch(*valid_data_, plan.first_sample(m)); };
    if (pipeline != nullptr) {
      FULCRUM_ASSIGN_OR_RETURN(auto result, pipeline->Evaluate(*model_, plan));
      sums[0] += result.first;
      sums[1] += static_cast<double>(result.second);
      continue;
    }
    for (int m = 0; m < plan.count; ++m) {
      ForwardContext ctx{/*training=*/false, iteration_, plan.first_sample(m)};
      LossSum loss = model_->ForwardLoss(plan.tokens(m), ctx);
      sums[0] += loss.sum.item<double>();
      sums[1] += static_cast<double>(loss.tokens);
    }
  }
  collectives().SumOverDataParallel(sums);
  return sums[0] / sums[1];
}

nlohmann::json Trainer::ManifestFields(
    const std::vector<std::pair<int64_t, int64_t>>& stage_ranges) const {
  TrainingManifest m;
  m.iteration = iteration_;
  m.consumed_samples = consumed_samples_;
  m.lr = iteration_ > 0 ? schedule_.At(iteration_) : 0.0;
  m.data_seed = config_.data.seed;
  m.split = config_.data.split;
  m.seq_length = config_.data.seq_length;
  m.samples_per_epoch = train_data_->samples_per_epoch();
  m.data = {config_.data_path, corpus_documents_, corpus_tokens_};
  m.config = ConfigToJson(config_);
  m.tp = layout_.roles.tp_size;
  m.pp = layout_.roles.pp_size;
  m.dp = dp_size();
  m.ep = layout_.roles.ep_size;
  m.layer_placement = stage_ranges;
  return TrainingManifestToJson(m);
}

std::unique_ptr<SaveInProgress> Trainer::BeginSave(bool snapshot) {
  CheckpointSave save;
  save.fs = fs_;
  save.dir = config_.train.save;
  save.iteration = iteration_;
  save.manifest_fields = ManifestFields(GatherLayerPlacement(*model_, collectives()));
  save.keep_last = config_.train.save_keep_last;
  save.sharded = config_.train.sharded_checkpoints;
  save.snapshot = snapshot;
  const std::vector<Unit*> units = model_->Units();
  const CheckpointCollectives ckpt_collectives = CheckpointCollectivesOf(collectives());
  if (save.sharded && optimizer_->SlicesState()) {
    // Each rank writes the moment slices it owns (NOTE [sharded checkpoints]); a rank that
    // cannot still takes part, so the save fails everywhere instead of hanging.
    absl::StatusOr<std::vector<MomentSlice>> slices = optimizer_->MomentSlices(units, collectives());
    if (slices.ok()) {
      save.moment_slices = std::move(*slices);
    } else {
      save.moment_slices.emplace();
      save.local_status = slices.status();
    }
    return StartSave(save, units, layout_.roles, ckpt_collectives);
  }
  // NOTE [optimizer state residency]: a full checkpoint reads whole moments from the units.
  // Released as soon as StartSave holds them (ReleaseState drops the Parameters' references
  // only), so the optimizer's next step takes its slices back whatever the save does.
  save.local_status = optimizer_->GatherState(units, collectives());
  std::unique_ptr<SaveInProgress> started = StartSave(save, units, layout_.roles, ckpt_collectives);
  // Only what was gathered is released: a refused gather may have left nothing consistent.
  if (save.local_status.ok()) optimizer_->ReleaseState(units);
  return started;
}

absl::Status Trainer::Save() {
  if (config_.train.save.empty()) return absl::FailedPreconditionError("no --save directory");
  FULCRUM_RETURN_IF_ERROR(FinishBackgroundSave(/*wait=*/true));
  std::unique_ptr<SaveInProgress> save = BeginSave(/*snapshot=*/false);
  save->Write();
  return FinishSave(*save, CheckpointCollectivesOf(collectives()));
}

absl::Status Trainer::SaveInBackground() {
  if (background_save_ != nullptr) {
    // The next save came due before the last was written: training waits for it here.
    const auto wait_start = Clock::now();
    const int64_t previous = background_save_->save().iteration();
    FULCRUM_RETURN_IF_ERROR(FinishBackgroundSave(/*wait=*/true));
    if (layout_.roles.commits_checkpoint) {
      FULCRUM_LOG(WARNING) << absl::StrFormat(
          "the checkpoint of iteration %d was still being written when iteration %d's came "
          "due; training waited %.2f s for it (--async_save; a longer --save_interval avoids "
          "this)",
          previous, iteration_, MillisecondsSince(wait_start) / 1000.0);
    }
  }
  std::unique_ptr<SaveInProgress> save = BeginSave(/*snapshot=*/true);
  if (layout_.roles.commits_checkpoint) {
    FULCRUM_LOG(INFO) << absl::StrFormat(
        "checkpoint of iteration %d: training waited %.2f s to start it (the state gathered and "
        "copied, %.1f MB on this rank); writing it in the background (--async_save)",
        iteration_, save->start_seconds(), static_cast<double>(save->bytes()) / 1e6);
  }
  background_save_ = std::make_unique<BackgroundSave>(std::move(save));
  return absl::OkStatus();
}

absl::Status Trainer::FinishBackgroundSave(bool wait) {
  if (background_save_ == nullptr) return absl::OkStatus();
  const CheckpointCollectives ckpt_collectives = CheckpointCollectivesOf(collectives());
  const auto finish_start = Clock::now();
  absl::Status status;
  if (wait) {
    status = background_save_->Finish(ckpt_collectives);
  } else {
    std::optional<absl::Status> finished = background_save_->FinishIfWritten(ckpt_collectives);
    if (!finished.has_value()) return absl::OkStatus();  // Some rank is still writing.
    status = std::move(*finished);
  }
  const int64_t saved = background_save_->save().iteration();
  background_save_.reset();
  if (status.ok() && layout_.roles.commits_checkpoint) {
    FULCRUM_LOG(INFO) << absl::StrFormat(
        "checkpoint of iteration %d committed after iteration %d (written in the background; "
        "training waited %.2f s for the commit)",
        saved, iteration_, MillisecondsSince(finish_start) / 1000.0);
  }
  return status;
}

absl::Status Trainer::Load(const std::string& path) {
  FULCRUM_ASSIGN_OR_RETURN(const ckpt::CheckpointReader reader,
                           ckpt::CheckpointReader::Open(fs_, path));
  return Load(reader);
}

absl::Status Trainer::Load(const ckpt::CheckpointReader& reader) {
  CheckpointLoad load;
  load.optimizer_slots = optimizer_->StateSlots();
  load.config = &config_;
  load.data = {config_.data_path, corpus_documents_, corpus_tokens_};
  load.data_max_token = corpus_max_token_;
  load.log_warnings = is_logging_rank();
  FULCRUM_ASSIGN_OR_RETURN(const LoadedCheckpoint loaded,
                           LoadCheckpoint(reader, model_->Units(), load));
  iteration_ = loaded.iteration;
  consumed_samples_ = loaded.consumed_samples;
  {
    PluginContext ctx = MakePluginContext(iteration_);
    FULCRUM_RETURN_IF_ERROR(plugins_->AfterLoad(ctx));
  }
  FULCRUM_LOG(INFO) << loaded.summary;
  return absl::OkStatus();
}

void Trainer::HookOptimizerToLayerMoves() {
  if (layout_.runner == nullptr) return;
  // A moving layer takes its whole optimizer state with it (NOTE [optimizer state
  // residency]): the distributed optimizer gathers it into the Parameters first, and adopts
  // its slices of the new layout at the next step.
  // An overlapped reduction's buckets would outlive the moving units: this iteration
  // reduces at the step (nothing has started: the hook runs before any backward).
  layout_.runner->SetBeforeLayersMove([this] {
    optimizer_->CancelGradientReduction();
    return optimizer_->GatherState(model_->Units(), collectives());
  });
}

absl::Status Trainer::ChangeLayout(
    const TrainerLayout& layout,
    const std::function<absl::Status(const GptModel& old_model, GptModel& new_model)>& fill) {
  ParallelContext* parallel = layout.parallel;
  if (parallel == nullptr || layout.roles.dp_size != dp_size()) {
    return absl::InvalidArgumentError(
        "ChangeLayout needs a parallel context with the same data-parallel size");
  }
  FULCRUM_RETURN_IF_ERROR(ValidateLayout(layout));
  // Run finishes its background saves before it returns: one in flight here is a bug.
  TORCH_INTERNAL_ASSERT(background_save_ == nullptr, "ChangeLayout with a background save in flight");
  // The new layers must use the new groups only: the plugins rebuild what they built on the
  // old ones (the old model keeps its own until it goes, after `fill`).
  FULCRUM_RETURN_IF_ERROR(plugins_->OnLayout(parallel));
  auto model = std::make_unique<GptModel>(config_.model, parallel->Stage(config_.model.num_layers),
                                          parallel->tensor_parallel(), plugins_);
  FULCRUM_RETURN_IF_ERROR(fill(*model_, *model));
  model_ = std::move(model);
  layout_ = layout;
  HookOptimizerToLayerMoves();
  // The metrics file and the load trace follow the logging rank (the last stage's), which
  // may have changed; both are opened for appending, so the new writer goes on after the
  // old one's last line. A new logging rank starts a new TensorBoard file, which sorts
  // after the old one (NOTE [tensorboard resume]).
  if (!is_logging_rank()) {
    metrics_.reset();
    load_trace_.reset();
    tensorboard_.reset();
  } else {
    if (!tensorboard_ && !config_.train.tensorboard_dir.empty()) {
      FULCRUM_ASSIGN_OR_RETURN(tensorboard_,
                               TensorBoardWriter::Open(fs_, config_.train.tensorboard_dir));
    }
    if (!metrics_ && !config_.train.metrics_file.empty()) {
      FULCRUM_ASSIGN_OR_RETURN(metrics_, OpenJsonLines(config_.train.metrics_file, "metrics_file"));
    }
    if (!load_trace_ && !config_.train.load_trace.empty()) {
      FULCRUM_ASSIGN_OR_RETURN(load_trace_, OpenJsonLines(config_.train.load_trace, "load_trace"));
    }
  }
  PluginContext ctx = MakePluginContext(iteration_);
  return plugins_->AfterLoad(ctx);
}

absl::Status Trainer::Run() {
  absl::Status status = RunIterations();
  // A failure may have left a background save in flight; it is abandoned uncommitted (its
  // temporary directory goes at the next save's Begin), never finished: the other ranks
  // may not be there to finish it with.
  if (!status.ok()) background_save_.reset();
  return status;
}

absl::Status Trainer::RunIterations() {
  const TrainOptions& t = config_.train;
  const int64_t tokens_per_iteration = t.global_batch_size * config_.data.seq_length;
  // Parameters of the whole model: each rank counts what it alone holds (its shards; a
  // replicated tensor on tensor-parallel rank 0; no mirrors), summed over the model.
  std::vector<double> count{0.0};
  std::vector<double> expert_count{0.0};  // Different on each expert-parallel rank.
  for (Unit* unit : model_->Units()) {
    for (const Parameter& p : unit->parameters()) {
      if (p.sharding.CountedOn(unit->tp_rank(), unit->tp_size())) {  // NOTE [parameter sharding]
        (p.sharding.expert_parallel ? expert_count : count)[0] += static_cast<double>(p.value.numel());
      }
    }
  }
  collectives().SumOverExpertParallel(expert_count);
  count[0] += expert_count[0];
  collectives().SumOverModelParallel(count);
  if (is_logging_rank()) {
    FULCRUM_LOG(INFO) << "training " << static_cast<int64_t>(count[0])
                      << " parameters from iteration " << iteration_ << " to " << t.train_iters
                      << "; " << tokens_per_iteration << " tokens per iteration; "
                      << train_data_->samples_per_epoch() << " samples per epoch";
  }
  // NOTE [tensorboard resume]: steps from here on replace those of earlier files.
  if (tensorboard_) FULCRUM_RETURN_IF_ERROR(tensorboard_->WriteStart(iteration_ + 1));
  const auto run_start = Clock::now();
  const int64_t first_iteration = iteration_;
  stopped_ = false;
  double interval_loss = 0.0;
  int64_t interval_count = 0;
  bool exited_early = false;
  double previous_iteration_ms = 0;  // The iteration a --load_trace line describes.
  while (iteration_ < t.train_iters) {
    FULCRUM_ASSIGN_OR_RETURN(IterationStats stats, TrainIteration());
    interval_loss += stats.loss;
    ++interval_count;
    nlohmann::json record = {{"iteration", stats.iteration},
                             {"loss", stats.loss},
                             {"lr", stats.lr},
                             {"grad_norm", stats.grad_norm},
                             {"tokens_per_second", stats.tokens_per_second},
                             {"iteration_ms", stats.iteration_ms},
                             {"grad_reduce_ms", stats.grad_reduce_ms},
                             {"consumed_samples", consumed_samples_},
                             // Since this Run began: the saves, evaluations and logs between
                             // iterations included, which iteration_ms leaves out.
                             {"elapsed_s", MillisecondsSince(run_start) / 1000.0}};
    // The layout the iteration ran on: re-packing (dynamic/repack.h) shrinks it.
    record["pipeline_size"] = layout_.roles.pp_size;
    record["active_ranks"] = layout_.roles.world_size;
    // This (logging) rank's Adam moments: a data-parallel slice under the distributed optimizer.
    record["optimizer_state_bytes"] = OptimizerStateBytes();
    if (config_.optimizer.overlap_grad_reduce) {
      // How many of this rank's gradient buckets started during the backward (NOTE
      // [overlapped gradient reduction]); the rest ran at the step.
      record["grad_buckets_overlapped"] = optimizer_->buckets_started_early();
    }
    std::string extra;
    if (ForwardBackwardRunner* pipeline = layout_.runner) {
      pipeline->Metrics(&record, &extra);
    }
    if (!plugins_->empty()) {
      PluginContext ctx = MakePluginContext(stats.iteration);
      FULCRUM_RETURN_IF_ERROR(plugins_->Metrics(ctx, &record, &extra));
      record["layer_loads"] = LayerLoads();
      const nlohmann::json block_statistics = BlockStatistics();
      for (const auto& [name, value] : block_statistics.items()) {
        record[name] = value;
        if (value.is_number() && absl::EndsWith(name, "_loss")) {
          absl::StrAppend(&extra, absl::StrFormat(" | %s %.4g", name, value.get<double>()));
        }
      }
    }
    if (is_logging_rank() &&
        (stats.iteration % t.log_interval == 0 || stats.iteration == t.train_iters)) {
      const double elapsed = MillisecondsSince(run_start) / 1000.0;
      const double per_iteration = elapsed / static_cast<double>(iteration_ - first_iteration);
      FULCRUM_LOG(INFO) << absl::StrFormat(
          "iteration %6d/%d | loss %.4f (avg %.4f) | lr %.3e | grad norm %.3f | %.0f tokens/s | "
          "%.0f ms%s | ETA %s",
          stats.iteration, t.train_iters, stats.loss, interval_loss / interval_count, stats.lr,
          stats.grad_norm, stats.tokens_per_second, stats.iteration_ms, extra,
          FormatDuration(per_iteration * static_cast<double>(t.train_iters - iteration_)));
      interval_loss = 0.0;
      interval_count = 0;
    }
    if (t.eval_interval > 0 &&
        (stats.iteration % t.eval_interval == 0 || stats.iteration == t.train_iters)) {
      FULCRUM_ASSIGN_OR_RETURN(double valid_loss, Evaluate());
      std::string eval_extra;
      if (!plugins_->empty()) {
        PluginContext ctx = MakePluginContext(stats.iteration);
        FULCRUM_RETURN_IF_ERROR(plugins_->AfterEvaluation(ctx, &record, &eval_extra));
      }
      if (is_logging_rank()) {
        FULCRUM_LOG(INFO) << absl::StrFormat(
            "validation at iteration %d | loss %.4f | ppl %.2f%s", stats.iteration, valid_loss,
            std::exp(valid_loss), eval_extra);
      }
      record["valid_loss"] = valid_loss;
    }
    if (metrics_) FULCRUM_RETURN_IF_ERROR(metrics_->Write(record));
    if (tensorboard_) {
      FULCRUM_RETURN_IF_ERROR(
          tensorboard_->WriteScalars(stats.iteration, TensorBoardScalars(record)));
    }
    if (ForwardBackwardRunner* pipeline = layout_.runner;
        load_trace_ && pipeline != nullptr) {
      // The runner's line describes the iteration before this one (its measurement is what
      // this iteration's plan was made from): add that iteration's own measured time.
      nlohmann::json line;
      pipeline->LoadTrace(&line);
      if (!line.is_null() && !line.empty()) {
        line["measured"]["iteration_ms"] = previous_iteration_ms;
        FULCRUM_RETURN_IF_ERROR(load_trace_->Write(line));
      }
    }
    previous_iteration_ms = stats.iteration_ms;
    const bool exiting = t.exit_interval > 0 && iteration_ % t.exit_interval == 0;
    const bool finished = iteration_ == t.train_iters;
    const bool interval_save = t.save_interval > 0 && iteration_ % t.save_interval == 0;
    // A background save is committed at the first iteration end after every rank wrote it.
    FULCRUM_RETURN_IF_ERROR(FinishBackgroundSave(/*wait=*/false));
    const bool last = exiting || finished || stats.stop_requested;
    if (!t.save.empty() && (interval_save || last)) {
      // The save that ends the Run is complete before it returns.
      FULCRUM_RETURN_IF_ERROR(t.async_save && !last ? SaveInBackground() : Save());
    }
    if (stats.stop_requested && !finished) {
      stopped_ = true;
      break;
    }
    if (exiting && !finished) {
      exited_early = true;
      break;
    }
  }
  FULCRUM_RETURN_IF_ERROR(FinishBackgroundSave(/*wait=*/true));
  if (ForwardBackwardRunner* runner = layout_.runner) {
    FULCRUM_RETURN_IF_ERROR(runner->Finish());
  }
  if (exited_early && is_logging_rank()) {
    FULCRUM_LOG(INFO) << "exiting at iteration " << iteration_ << " (--exit_interval="
                      << t.exit_interval << ")";
  }
  if (stopped_ && is_logging_rank()) {
    FULCRUM_LOG(INFO) << "stopped at iteration " << iteration_ << " of " << t.train_iters
                      << " on request ("
                      << (stop_reason_ ? stop_reason_() : std::string("a stop signal")) << "); "
                      << (t.save.empty() ? std::string("no --save, so nothing was saved")
                                         : absl::StrCat("checkpoint of iteration ", iteration_,
                                                        " saved in ", t.save));
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
