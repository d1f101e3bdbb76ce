#include "recipes/train_flags.h"

#include <gflags/gflags.h>

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/data/default_corpus.h"
#include "core/data/tokenizer.h"
#include "core/device.h"
#include "core/status.h"
#include "dynamic/balancers.h"
#include "plugins/plugin_registry.h"
#include "moe/router.h"
#include "parallel/world_communicator.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "recipes/recipes.h"

// recipes/repack_flags.cc's: --repack=auto needs the per-layer times.
DECLARE_string(repack);

// Model.
DEFINE_string(recipe, "tiny", "Preset of flags (see the list above); explicit flags override it.");
DEFINE_int64(num_layers, 4, "Number of transformer layers.");
DEFINE_int64(hidden_size, 128, "Transformer hidden size.");
DEFINE_int64(num_attention_heads, 4, "Attention heads; must divide --hidden_size.");
DEFINE_int64(ffn_hidden_size, 0, "MLP hidden size; 0 = 4 x --hidden_size.");
DEFINE_int64(seq_length, 128,
             "Tokens per sample (and the learned position table's rows, unless "
             "--max_position_embeddings).");
DEFINE_string(position_embedding_type, "learned_absolute", "learned_absolute or rope.");
DEFINE_int64(max_position_embeddings, 0,
             "Rows of the learned position table (0: --seq_length). A run may train at any "
             "--seq_length up to it: fine-tune GPT-2 (1024 positions) at 512 tokens with "
             "--max_position_embeddings=1024 --seq_length=512. Learned positions only.");
DEFINE_double(rotary_base, 10000.0, "Base of the rotary frequencies (with rope).");
DEFINE_bool(untie_embeddings_and_output_weights, false,
            "Give the LM head its own weight instead of the word embeddings.");
DEFINE_double(init_method_std, 0.02, "Std of the normal initialisation.");
DEFINE_double(norm_epsilon, 1e-5, "Epsilon of the layer norms (LayerNorm or RMSNorm).");
DEFINE_string(normalization, "LayerNorm", "LayerNorm (GPT-2) or RMSNorm (Llama: no norm biases).");
DEFINE_bool(swiglu, false,
            "SwiGLU MLP (and MoE experts): fc2(silu(gate) * up), gate and up each "
            "--ffn_hidden_size wide (Llama, Mixtral).");
DEFINE_bool(group_query_attention, false,
            "Grouped-query attention: --num_query_groups key/value heads shared by the query heads.");
DEFINE_int64(num_query_groups, 1,
             "Key/value heads with --group_query_attention; must divide --num_attention_heads "
             "and be a multiple of --tensor_model_parallel_size.");
DEFINE_bool(disable_bias_linear, false,
            "No biases on the attention and MLP projections (and experts), as in Llama.");
DEFINE_bool(openai_gelu, false, "tanh-approximate GeLU (GPT-2's gelu_new) instead of the exact one.");
DEFINE_double(hidden_dropout, 0.0, "Dropout after attention and MLP outputs and embeddings.");
DEFINE_double(attention_dropout, 0.0, "Dropout on attention probabilities.");
DEFINE_int64(make_vocab_size_divisible_by, 128, "Pad the vocabulary to a multiple of this.");
DEFINE_uint64(seed, 1234, "Seed of initialisation, dropout and data shuffling.");
DEFINE_string(params_dtype, "fp32",
              "fp32, or fp64 for numerical checks (parameters, gradients, optimizer state and "
              "activations in float64; initial values still drawn in fp32): tells rounding "
              "from bugs when layouts disagree. Dense models on CPU only.");
DEFINE_string(device, "auto",
              "cpu, cuda (the GPU of LOCAL_RANK), cuda:N, or auto: cuda when this process sees "
              "a GPU, else cpu. Every tensor of the model follows it; logged at start.");
DEFINE_bool(bf16, false,
            "bf16 mixed precision as Megatron does it: activations and GEMMs in bf16 over fp32 "
            "master weights, fp32 gradient accumulation and optimizer state; checkpoints hold "
            "the fp32 masters; routing, exit and hashing decisions and the losses in fp32. Needs "
            "--params_dtype=fp32; every built-in plugin runs under it.");
// Optimizer and schedule.
DEFINE_double(lr, 1e-3, "Peak learning rate.");
DEFINE_double(min_lr, 0.0, "Minimum learning rate at the end of decay.");
DEFINE_int64(lr_warmup_iters, 0, "Linear warmup iterations.");
DEFINE_int64(lr_decay_iters, 0, "Iterations of decay (0 = --train_iters).");
DEFINE_string(lr_decay_style, "cosine", "constant, linear or cosine.");
DEFINE_double(weight_decay, 0.01, "Decoupled weight decay (not on biases and norms).");
DEFINE_double(adam_beta1, 0.9, "Adam beta1.");
DEFINE_double(adam_beta2, 0.999, "Adam beta2.");
DEFINE_double(adam_eps, 1e-8, "Adam epsilon.");
DEFINE_double(clip_grad, 1.0, "Clip the global gradient L2 norm to this; 0 disables.");
DEFINE_string(recompute_granularity, "",
              "Activation recomputation: 'full' keeps only each recomputed layer's input in "
              "the forward pass and runs the layer again in the backward; 'selective' does "
              "that for every layer's attention core alone (q·kᵀ, softmax, attention dropout, "
              "·v: the s×s tensors, kept only with --attention_dropout); empty: none. Full "
              "runs every plugin (moe without --moe_assignment_cache_threshold); selective "
              "leaves plugins' attention cores alone.");
DEFINE_int64(recompute_num_layers, 0,
             "With --recompute_granularity=full: how many layers of each pipeline stage (each "
             "model chunk), first ones first, are recomputed; 0: all of them.");
DEFINE_bool(use_distributed_optimizer, false,
            "Shard the Adam moments over the data-parallel group (the expert-data-parallel "
            "group for experts; ZeRO-1): gradients reduce-scattered, updated weights "
            "all-gathered. Every plugin runs under it.");
DEFINE_bool(overlap_grad_reduce, false,
            "Start each bucket's data-parallel gradient reduction as soon as its gradients are "
            "final (after a layer's last weight-gradient pass), while the backward goes on; "
            "the step waits only for what is in flight. Buckets are cut last layer first. "
            "Gloo runs them on its worker thread; NCCL's communicator has no non-blocking "
            "forms yet (there they are issued early as its ordinary collectives).");
DEFINE_int64(ddp_bucket_size, 0,
             "Elements per gradient bucket of --use_distributed_optimizer and "
             "--overlap_grad_reduce (0: 25 MiB of fp32). Smaller buckets start sooner.");
// Batches and iterations.
DEFINE_int64(micro_batch_size, 8, "Samples per forward/backward.");
DEFINE_int64(global_batch_size, 16, "Samples per optimizer step (accumulated micro-batches).");
DEFINE_int64(train_iters, 100, "Total iterations (optimizer steps) of the run.");
DEFINE_int64(exit_interval, 0, "Save and exit when the iteration is a multiple of this.");
DEFINE_int64(log_interval, 10, "Log every this many iterations.");
DEFINE_int64(eval_interval, 0, "Evaluate on the valid split every this many iterations (0 = never).");
DEFINE_int64(eval_iters, 10, "Global batches per evaluation.");
// Data.
DEFINE_string(data_path, "",
              "Prefix of a Megatron indexed dataset (PREFIX.bin/.idx); empty = the embedded "
              "corpus (/usr/share/common-licenses, byte tokens).");
DEFINE_string(split, "969,30,1", "Train/valid/test proportions of the documents.");
DEFINE_string(tokenizer_model, "", "SentencePiece model of --data_path (gives the vocab size).");
DEFINE_int64(vocab_size, 0,
             "The model's vocabulary size before padding (default: --tokenizer_model's, else the "
             "data's largest token + 1, or 257 byte tokens without --data_path); every token of the "
             "data must fit.");
// Parallelism.
DEFINE_int32(tensor_model_parallel_size, 1, "Tensor-parallel size (splits heads and MLP).");
DEFINE_bool(sequence_parallel, false,
            "With --tensor_model_parallel_size > 1: split the norms, dropouts and residual adds "
            "along the sequence over the tensor-parallel ranks (Korthikanti et al. 2022); their "
            "activations shrink by that size, the losses stay the same. --seq_length must be a "
            "multiple of the size. Not with the mod and early_exit plugins.");
DEFINE_int32(pipeline_model_parallel_size, 1, "Pipeline stages (layers split evenly).");
DEFINE_string(pipeline_schedule, "1f1b",
              "Pipeline schedule: 1f1b (interleaved 1F1B with virtual stages), zbh1 (interleaved "
              "ZB-H1 with virtual stages), zbh2 or zbv (ZB-V: two chunks per stage in a V).");
DEFINE_int32(virtual_pipeline_model_parallel_size, 0,
             "Model chunks per pipeline stage (Megatron's virtual pipeline stages): the model is "
             "cut into pp × this many pieces, dealt round-robin (1f1b: interleaved 1F1B) or in a "
             "V (zbv, which needs 2). 0: one chunk (two for zbv).");
DEFINE_int32(num_layers_per_virtual_pipeline_stage, 0,
             "Layers per virtual pipeline stage; the chunks per stage are then --num_layers / "
             "(pp × this). Give this or --virtual_pipeline_model_parallel_size, not both.");
DEFINE_string(timeline, "",
              "Write a Chrome trace / Perfetto JSON of every rank's F/B/W actions, waits and "
              "layer moves to this file (pipeline runs, --pipeline_model_parallel_size > 1).");
DEFINE_string(rebalance_script, "",
              "Scripted placements instead of a balancer: ITER:LAYER->STAGE[,...] (boundary "
              "layers to a neighbouring stage) or ITER:N0,N1,... (each stage's layer count, any "
              "placement), steps separated by ';', e.g. '5:1->1;9:2,2' (in iteration 5's "
              "backward tail layer 1 goes to stage 1; in 9's, two layers per stage).");
// Balancing (dynamic/).
DEFINE_string(zbv_order, "measured",
              "With --pipeline_schedule=zbv: measured (rebuild the V's order from the measured "
              "chunk F/B/W costs, as the zero-bubble authors build theirs from profiled ones; "
              "the same losses) or unit (the order for equal F, B and W).");
DEFINE_bool(layer_timing, true,
            "Pipeline runs: time every layer's F, B and W (events on a GPU, read once per "
            "iteration; the balancers' loads). false: only each schedule action is timed "
            "(the bubble and the timeline still are) — refused with --rebalancer, "
            "--load_trace and --repack=auto, which need the per-layer times.");
DEFINE_string(rebalancer, "none",
              "Who decides where layers run (see the list above): none (the initial placement "
              "stays), partition (exact minimum of the bottleneck stage) or diffusion "
              "(neighbouring stages exchange boundary layers).");
DEFINE_string(balance_by, "time",
              "The balancers' cost of a layer: time (its measured F+B+W) or params (its "
              "trainable parameters, the static DeepSpeed-style measure).");
DEFINE_int32(rebalance_window, 3,
             "Per-layer costs are the median of this many last measured iterations.");
DEFINE_int32(rebalance_interval, 1,
             "Consider a new placement every this many iterations (and after a plugin "
             "reports that the model changed).");
DEFINE_double(rebalance_min_gain, 0.05,
              "Apply a placement only if it lowers the predicted bottleneck by at least this "
              "fraction (hysteresis: noise never makes layers ping-pong).");
DEFINE_int64(rebalance_max_moves, 0,
             "At most this many layers migrate per iteration (0 = no cap; a capped plan goes "
             "part of the way and continues in later iterations).");
DEFINE_double(rebalance_memory_budget_mb, 0,
              "Memory a stage may hold (MiB: weights, gradients, Adam state and the activations "
              "in flight); 0 = unlimited.");
DEFINE_int32(diffusion_max_rounds, 32, "Diffusion: most rounds of exchanges per decision.");
DEFINE_string(pipeline_initial_partition, "uniform",
              "The placement training starts with: uniform (Megatron: an even split of the "
              "layers) or params (DeepSpeed: balanced trainable parameters, embedding and head "
              "counted).");
DEFINE_int32(expert_model_parallel_size, 1,
             "Expert-parallel size: the experts of each MoE layer are shared out over this many "
             "data-parallel ranks (needs --num_experts divisible by it).");
// Plugins (their own flags are in their files, plugins/*.cc).
DEFINE_string(plugins, "",
              "Dynamism plugins, in order (see the list above), e.g. moe,freeze,prune. The moe "
              "plugin is also selected by --num_experts > 0.");
DEFINE_string(distributed_backend, "auto",
              "auto (nccl on a CUDA --device, else gloo), gloo or nccl (CUDA tensors; the CPU "
              "control values still ride a Gloo communicator). gloo on a GPU stages every "
              "tensor through host memory: slow, but several ranks may share one GPU "
              "(--device=cuda:0), which NCCL refuses.");
DEFINE_int64(distributed_timeout_minutes, 10,
             "Bound on rendezvous and on every collective; a dead peer fails after this.");
DEFINE_int32(num_threads, 0,
             "Compute threads of each process (LibTorch's intra-op pool: OpenMP, MKL and oneDNN). "
             "0: $OMP_NUM_THREADS when set (fulcrum_launch sets it to the cores per process), "
             "else every core the process may use. The data log line says what is used.");
// Checkpoints and outputs.
DEFINE_string(save, "", "Directory to save checkpoints into.");
DEFINE_string(load, "", "Checkpoint directory (or one iter_XXXXXXX in it) to resume from.");
DEFINE_int64(save_interval, 0, "Save every this many iterations (also saved at exit and end).");
DEFINE_bool(async_save, false,
            "Write interval checkpoints in the background: training waits only while each rank "
            "copies its part into host memory, and the checkpoint becomes `latest` at the first "
            "iteration end after every rank wrote it. The last save of a run completes before "
            "it exits.");
DEFINE_int32(save_keep_last, 0,
             "Keep only the newest this many checkpoints in --save (older ones are deleted after "
             "each save; the one `latest` names is always kept); 0 = keep all.");
DEFINE_string(ckpt_format, "sharded",
              "How --save writes: sharded (every rank writes the pieces it holds, its tensor-"
              "parallel shards and its distributed-optimizer slices, into its own file; nothing "
              "is gathered) or full (each tensor-parallel group gathers whole tensors to one "
              "writer). Both load under any layout; fulcrum_ckpt consolidate makes a full one.");
DEFINE_bool(allow_data_change, false,
            "Resume --load on other data than the checkpoint trained on (another --data_path, "
            "--split or --seed), on purpose; without it such a resume is refused.");
DEFINE_bool(finetune, false,
            "Start from the model weights of --load alone (a checkpoint imported by fulcrum_ckpt "
            "import-hf, or any checkpoint): iteration 0, a fresh optimizer and schedule, any "
            "data. The model flags must still give the checkpoint's model.");
DEFINE_bool(allow_unchecksummed_manifest, false,
            "Resume --load from a checkpoint whose manifest predates manifest checksums "
            "(format_version 1), whose fields (iteration, data position) nothing verifies; "
            "without it such a checkpoint is refused.");
DEFINE_string(metrics_file, "", "Append one JSON object per iteration to this file.");
DEFINE_string(load_trace, "",
              "Append each iteration's measured per-layer F/B/W times, plugin loads and "
              "placement to this file (JSON lines; pipeline runs) for fulcrum_sim --trace.");
DEFINE_string(tensorboard_dir, "",
              "Write TensorBoard event files into this directory (created if missing): each "
              "iteration's loss, learning rate, grad norm, throughput, validation loss and, "
              "for pipeline runs, every stage's load and bubble. A resumed run adds a new file.");

namespace fulcrum {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

int64_t PadVocab(int64_t vocab, int64_t multiple) {
  return multiple <= 1 ? vocab : (vocab + multiple - 1) / multiple * multiple;
}

}  // namespace

cli::HelpSpec TrainHelpSpec() {
  cli::HelpSpec spec;
  spec.program = "fulcrum_train";
  spec.usage =
      "fulcrum_train: trains a GPT model (Megatron-style flags).\n\n"
      "  fulcrum_train [--recipe=NAME] [--flag=value ...] [--flagfile=FILE]\n"
      "  fulcrum_launch --nproc_per_node=N -- fulcrum_train ...   (several processes)\n\n"
      "With no --data_path it trains on the embedded corpus. Exit status: 0 done (also after\n"
      "SIGTERM/SIGINT: the iteration in progress ends and is saved when --save is set),\n"
      "2 bad flags, files or checkpoints (before any work), 1 a failure while training,\n"
      "75 saved for a relaunch on fewer ranks (--repack_via_checkpoint; fulcrum_launch does it).\n\n"
      "Recipes (--recipe; explicit flags override the recipe's):\n";
  for (const auto* entry : RecipeRegistry::Global().List()) {
    spec.usage += absl::StrCat("  ", entry->name,
                               std::string(12 - std::min<size_t>(11, entry->name.size()), ' '),
                               entry->help, "\n");
  }
  spec.usage += "\nMoE routers (--moe_router, with --num_experts > 0):\n" + moe::RouterHelp();
  spec.usage += "\nPipeline schedules (--pipeline_schedule):\n" + pipeline::ScheduleHelp();
  spec.usage += "\nBalancers (--rebalancer):\n" + dynamic::BalancerHelp();
  spec.usage += "\nPlugins (--plugins; each file's flags are listed under \"Plugins\" below):\n" +
                plugins::PluginHelp();
  spec.groups = {
      {"Model",
       {"recipe", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "seq_length", "position_embedding_type", "max_position_embeddings", "rotary_base",
        "untie_embeddings_and_output_weights", "init_method_std", "normalization", "norm_epsilon",
        "swiglu", "openai_gelu", "disable_bias_linear", "group_query_attention", "num_query_groups",
        "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by", "seed",
        "params_dtype"}},
      {"Device and precision", {"device", "bf16"}},
      {"Training",
       {"train_iters", "micro_batch_size", "global_batch_size", "lr", "min_lr",
        "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "weight_decay", "adam_beta1",
        "adam_beta2", "adam_eps", "clip_grad", "use_distributed_optimizer", "overlap_grad_reduce",
        "ddp_bucket_size", "exit_interval",
        "eval_interval", "eval_iters", "recompute_granularity", "recompute_num_layers"}},
      {"Data", {"data_path", "split", "tokenizer_model", "vocab_size"}},
      {"Parallel",
       {"tensor_model_parallel_size", "sequence_parallel", "pipeline_model_parallel_size",
        "expert_model_parallel_size", "distributed_backend", "distributed_timeout_minutes",
        "num_threads"}},
      {"Pipeline and balancing",
       {"pipeline_schedule", "virtual_pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage", "pipeline_initial_partition", "rebalancer",
        "balance_by",
        "rebalance_window", "rebalance_interval", "rebalance_min_gain", "rebalance_max_moves",
        "rebalance_memory_budget_mb", "diffusion_max_rounds", "rebalance_script",
        "layer_timing", "zbv_order"}},
      {"Re-packing (fewer pipeline stages when the work shrinks)",
       {"repack", "repack_min_stages", "repack_interval", "repack_max_slowdown", "repack_script",
        "repack_via_checkpoint", "on_release_command"}},
      {"MoE",
       {"num_experts", "moe_layer_freq", "moe_router", "moe_router_topk",
        "moe_router_topk_schedule", "moe_ffn_hidden_size", "moe_capacity_factor",
        "moe_per_expert_capacity", "moe_batch_prioritized_routing", "moe_aux_loss_coeff",
        "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_init_std", "moe_noise_epsilon",
        "moe_router_bias_update_rate", "moe_sinkhorn_iterations",
        "moe_expert_choice_capacity_factor", "moe_cosine_projection_dim",
        "moe_cosine_init_temperature", "moe_cosine_min_temperature", "moe_a2a_overlap_degree",
        "moe_hierarchical_a2a_node_size", "moe_assignment_cache_threshold"}},
      {"Plugins", {"plugins"}},
      {"Checkpoints", {"save", "load", "finetune", "save_interval", "async_save", "save_keep_last",
                       "ckpt_format", "allow_data_change", "allow_unchecksummed_manifest"}},
      {"Logging", {"log_interval", "metrics_file", "tensorboard_dir", "load_trace", "timeline"}},
  };
  spec.per_file_dir = "plugins";
  spec.per_file_title = "Plugins";
  return spec;
}

absl::Status ApplyRecipe() {
  const auto* recipe = RecipeRegistry::Global().Find(FLAGS_recipe);
  if (recipe == nullptr) {
    return Invalid(absl::StrCat("--recipe='", FLAGS_recipe, "' is unknown; recipes: ",
                                RecipeRegistry::Global().Names()));
  }
  for (const auto& [name, value] : recipe->value.flags) {
    // SET_FLAG_IF_DEFAULT leaves flags the user set (command line or flagfile) alone.
    if (gflags::SetCommandLineOptionWithMode(name.c_str(), value.c_str(),
                                             gflags::SET_FLAG_IF_DEFAULT)
            .empty()) {
      gflags::CommandLineFlagInfo info;
      if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
        return absl::InternalError(absl::StrCat("recipe ", FLAGS_recipe, " sets unknown flag --", name));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainData> LoadTrainData() {
  TrainData out;
  if (FLAGS_data_path.empty()) {
    data::ByteTokenizer tokenizer;
    FULCRUM_ASSIGN_OR_RETURN(out.corpus, data::BuildDefaultCorpus(tokenizer));
    out.vocab_size = tokenizer.vocab_size();
    out.description = data::DefaultCorpusDescription() + ", byte tokens";
    if (!FLAGS_tokenizer_model.empty()) {
      return Invalid("--tokenizer_model needs --data_path (the embedded corpus uses byte tokens)");
    }
    // A larger vocabulary is allowed: a model imported from elsewhere (fulcrum_ckpt
    // import-hf prints its --vocab_size) fine-tunes on the byte tokens, which fit.
    if (FLAGS_vocab_size > 0) {
      if (FLAGS_vocab_size < out.vocab_size) {
        return Invalid(absl::StrCat("--vocab_size=", FLAGS_vocab_size, " is below the embedded corpus's ",
                                    out.vocab_size, " byte tokens"));
      }
      out.vocab_size = FLAGS_vocab_size;
    }
    return out;
  }
  FULCRUM_ASSIGN_OR_RETURN(out.corpus, data::IndexedDataset::Open(FLAGS_data_path));
  if (!FLAGS_tokenizer_model.empty()) {
    FULCRUM_ASSIGN_OR_RETURN(auto tokenizer,
                             data::SentencePieceTokenizer::Load(FLAGS_tokenizer_model));
    out.vocab_size = tokenizer->vocab_size();
  } else if (FLAGS_vocab_size > 0) {
    out.vocab_size = FLAGS_vocab_size;
  } else {
    out.vocab_size = out.corpus->MaxToken() + 1;
  }
  out.description = absl::StrCat(FLAGS_data_path, " (", out.corpus->num_sequences(),
                                 " documents, ", out.corpus->num_tokens(), " tokens)");
  return out;
}

absl::StatusOr<parallel::ParallelConfig> ParallelConfigFromFlags(int world_size) {
  parallel::ParallelConfig config;
  config.world_size = world_size;
  config.tp = FLAGS_tensor_model_parallel_size;
  config.pp = FLAGS_pipeline_model_parallel_size;
  config.ep = FLAGS_expert_model_parallel_size;
  FULCRUM_RETURN_IF_ERROR(config.Validate());
  const int64_t ffn = FLAGS_ffn_hidden_size > 0 ? FLAGS_ffn_hidden_size : 4 * FLAGS_hidden_size;
  if (FLAGS_num_attention_heads % config.tp != 0) {
    return Invalid(absl::StrCat("--num_attention_heads=", FLAGS_num_attention_heads,
                                " is not divisible by --tensor_model_parallel_size=", config.tp));
  }
  if (FLAGS_group_query_attention && FLAGS_num_query_groups % config.tp != 0) {
    // Megatron's rule too. Replicating key/value heads over ranks would make a parameter
    // half sharded and half replicated, which the checkpoint gather and the gradient
    // reduction do not express.
    return Invalid(absl::StrCat("--num_query_groups=", FLAGS_num_query_groups,
                                " is not divisible by --tensor_model_parallel_size=", config.tp,
                                " (key/value heads are split over tensor-parallel ranks, not "
                                "replicated)"));
  }
  if (ffn % config.tp != 0) {
    return Invalid(absl::StrCat("the MLP size ", ffn,
                                " is not divisible by --tensor_model_parallel_size=", config.tp));
  }
  if (FLAGS_num_layers < 1) {
    return Invalid(absl::StrCat("--num_layers=", FLAGS_num_layers, " must be ≥ 1"));
  }
  if (config.pp > FLAGS_num_layers) {
    return Invalid(absl::StrCat("--pipeline_model_parallel_size=", config.pp, " exceeds --num_layers=",
                                FLAGS_num_layers, "; every stage needs a layer"));
  }
  if (!FLAGS_timeline.empty() && config.pp == 1) {
    return Invalid("--timeline records pipeline stages; it needs --pipeline_model_parallel_size > 1");
  }
  FULCRUM_ASSIGN_OR_RETURN(const dynamic::BalancerOptions balancing, BalancerOptionsFromFlags());
  if (FLAGS_pipeline_initial_partition != "uniform" && FLAGS_pipeline_initial_partition != "params") {
    return Invalid(absl::StrCat("--pipeline_initial_partition='", FLAGS_pipeline_initial_partition,
                                "' is unknown; expected uniform or params"));
  }
  if (!FLAGS_layer_timing) {
    // What balances or records layers needs their times.
    if (FLAGS_rebalancer != "none") {
      return Invalid(absl::StrCat("--rebalancer=", FLAGS_rebalancer, " balances the measured "
                                  "per-layer times; it needs --layer_timing=true"));
    }
    if (!FLAGS_load_trace.empty()) {
      return Invalid("--load_trace records the per-layer times; it needs --layer_timing=true");
    }
    if (FLAGS_repack == "auto") {
      return Invalid("--repack=auto decides from the per-layer times; it needs "
                     "--layer_timing=true");
    }
  }
  if (FLAGS_rebalancer != "none") {
    if (!FLAGS_rebalance_script.empty()) {
      return Invalid(absl::StrCat("--rebalancer=", FLAGS_rebalancer, " and --rebalance_script both "
                                  "decide the placement; give one of them"));
    }
    if (config.pp == 1) {
      return Invalid(absl::StrCat("--rebalancer=", FLAGS_rebalancer, " moves layers between "
                                  "pipeline stages; it needs --pipeline_model_parallel_size > 1"));
    }
    // Unknown names are refused here, before any work.
    FULCRUM_RETURN_IF_ERROR(dynamic::MakeRebalancer(FLAGS_rebalancer, balancing).status());
  }
  if (!FLAGS_rebalance_script.empty()) {
    if (FLAGS_pipeline_initial_partition != "uniform") {
      return Invalid("--rebalance_script is played from the even split; it needs "
                     "--pipeline_initial_partition=uniform");
    }
    if (config.pp == 1) {
      return Invalid("--rebalance_script moves layers between pipeline stages; it needs "
                     "--pipeline_model_parallel_size > 1");
    }
    FULCRUM_ASSIGN_OR_RETURN(auto script, pipeline::ScriptedRebalancer::Parse(FLAGS_rebalance_script));
    // The script is deterministic: play it through now, so a move that cannot happen is
    // refused before any work rather than at its iteration. With virtual pipeline stages
    // the script places the p·v virtual stages, from their even split (a bad chunk count
    // is named below).
    const absl::StatusOr<int> script_chunks = VirtualPipelineChunksFromFlags(config.pp);
    const int virtual_stages = config.pp * (script_chunks.ok() ? *script_chunks : 1);
    pipeline::LayerRanges ranges;
    for (int s = 0; s < virtual_stages; ++s) {
      const StageSpec spec = EvenStage(FLAGS_num_layers, virtual_stages, s);
      ranges.emplace_back(spec.layer_begin, spec.layer_end);
    }
    if (auto played = script->Placements(ranges); !played.ok()) {
      return Invalid(std::string(played.status().message()));
    }
  }
  if (FLAGS_zbv_order != "measured" && FLAGS_zbv_order != "unit") {
    return Invalid(absl::StrCat("--zbv_order='", FLAGS_zbv_order,
                                "' is unknown; expected measured or unit"));
  }
  FULCRUM_ASSIGN_OR_RETURN(const int chunks, VirtualPipelineChunksFromFlags(config.pp));
  if (config.pp > 1) {
    const int64_t micro = FLAGS_global_batch_size / std::max<int64_t>(1, FLAGS_micro_batch_size * config.dp());
    auto schedule = pipeline::MakeSchedule(FLAGS_pipeline_schedule, config.pp,
                                           static_cast<int>(micro), chunks);
    if (!schedule.ok()) return schedule.status();
  } else if (pipeline::ScheduleRegistry::Global().Find(FLAGS_pipeline_schedule) == nullptr) {
    // One stage runs no schedule, but a misspelt name is still a mistake worth naming (a
    // re-pack or a resume at another pp would meet it later).
    return Invalid(absl::StrCat("--pipeline_schedule='", FLAGS_pipeline_schedule,
                                "' is unknown; schedules: ", pipeline::ScheduleNames()));
  }
  if (FLAGS_distributed_timeout_minutes < 1) {
    return Invalid(absl::StrCat("--distributed_timeout_minutes=", FLAGS_distributed_timeout_minutes,
                                " must be ≥ 1"));
  }
  return config;
}

std::string DistributedBackendFlag() { return FLAGS_distributed_backend; }

absl::StatusOr<parallel::Backend> DistributedBackendFromFlags(const c10::Device& device) {
  return parallel::ResolveBackend(FLAGS_distributed_backend, device, parallel::HaveNccl());
}
std::string PipelineScheduleFlag() { return FLAGS_pipeline_schedule; }

absl::StatusOr<int> VirtualPipelineChunksFromFlags(int pp) {
  const int v_flag = FLAGS_virtual_pipeline_model_parallel_size;
  const int per_stage = FLAGS_num_layers_per_virtual_pipeline_stage;
  if (v_flag < 0) {
    return Invalid(absl::StrCat("--virtual_pipeline_model_parallel_size=", v_flag, " must be ≥ 0"));
  }
  if (per_stage < 0) {
    return Invalid(absl::StrCat("--num_layers_per_virtual_pipeline_stage=", per_stage,
                                " must be ≥ 0"));
  }
  if (v_flag > 0 && per_stage > 0) {
    return Invalid("give --virtual_pipeline_model_parallel_size or "
                   "--num_layers_per_virtual_pipeline_stage, not both");
  }
  int v = v_flag;
  if (per_stage > 0) {
    // Megatron's rule: the layers divide evenly into pp × per_stage-layer pieces.
    if (FLAGS_num_layers % (static_cast<int64_t>(pp) * per_stage) != 0) {
      return Invalid(absl::StrCat("--num_layers=", FLAGS_num_layers, " is not divisible by "
                                  "--pipeline_model_parallel_size × "
                                  "--num_layers_per_virtual_pipeline_stage = ", pp, " × ",
                                  per_stage));
    }
    v = static_cast<int>(FLAGS_num_layers / (static_cast<int64_t>(pp) * per_stage));
  }
  const bool zbv = FLAGS_pipeline_schedule == "zbv";
  if (zbv) {
    if (v != 0 && v != 2) {
      return Invalid(absl::StrCat("--pipeline_schedule=zbv runs two chunks per stage (a V); "
                                  "--virtual_pipeline_model_parallel_size (or the layers per "
                                  "virtual stage) gives ", v));
    }
    v = 2;
  }
  if (v == 0) v = 1;
  if (v > 1) {
    if (pp < 2 && !zbv) {
      return Invalid(absl::StrCat("--virtual_pipeline_model_parallel_size=", v,
                                  " needs --pipeline_model_parallel_size > 1"));
    }
    // Whether --pipeline_schedule has a form with chunks is MakeSchedule's answer (checked
    // with the layout: zbh2, for one, has none).
    if (FLAGS_num_layers < static_cast<int64_t>(pp) * v) {
      return Invalid(absl::StrCat("--num_layers=", FLAGS_num_layers, " is below the ", pp * v,
                                  " virtual pipeline stages (--pipeline_model_parallel_size × "
                                  "chunks = ", pp, " × ", v, "); each needs a layer"));
    }
  }
  return v;
}
std::string TimelineFlag() { return FLAGS_timeline; }

absl::StatusOr<dynamic::BalancerOptions> BalancerOptionsFromFlags() {
  dynamic::BalancerOptions o;
  if (FLAGS_rebalancer != "none") o.algorithm = FLAGS_rebalancer;
  FULCRUM_RETURN_IF_ERROR(dynamic::ParseBalanceBy(FLAGS_balance_by, &o.load.by));
  o.load.window = FLAGS_rebalance_window;
  if (FLAGS_rebalance_memory_budget_mb < 0 || !std::isfinite(FLAGS_rebalance_memory_budget_mb)) {
    return Invalid(absl::StrCat("--rebalance_memory_budget_mb=", FLAGS_rebalance_memory_budget_mb,
                                " must be ≥ 0 (0 = unlimited)"));
  }
  if (FLAGS_rebalance_memory_budget_mb > 0) {
    o.load.memory_budget_bytes = FLAGS_rebalance_memory_budget_mb * 1024.0 * 1024.0;
  }
  o.interval = FLAGS_rebalance_interval;
  o.min_gain = FLAGS_rebalance_min_gain;
  o.max_moves = FLAGS_rebalance_max_moves;
  o.diffusion_max_rounds = FLAGS_diffusion_max_rounds;
  FULCRUM_RETURN_IF_ERROR(o.load.Validate());
  FULCRUM_RETURN_IF_ERROR(o.Validate());
  return o;
}

absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> RebalancerFromFlags() {
  if (!FLAGS_rebalance_script.empty()) {
    FULCRUM_ASSIGN_OR_RETURN(auto scripted, pipeline::ScriptedRebalancer::Parse(FLAGS_rebalance_script));
    return std::unique_ptr<pipeline::Rebalancer>(std::move(scripted));
  }
  FULCRUM_ASSIGN_OR_RETURN(const dynamic::BalancerOptions options, BalancerOptionsFromFlags());
  return dynamic::MakeRebalancer(FLAGS_rebalancer, options);
}

bool InitialPartitionByParamsFlag() { return FLAGS_pipeline_initial_partition == "params"; }
int64_t DistributedTimeoutMinutesFlag() { return FLAGS_distributed_timeout_minutes; }

absl::StatusOr<ThreadChoice> NumThreadsFlag() {
  if (FLAGS_num_threads < 0) {
    return Invalid(absl::StrCat("--num_threads=", FLAGS_num_threads,
                                " must be ≥ 0 (0: $OMP_NUM_THREADS, else all cores)"));
  }
  if (FLAGS_num_threads > 0) return ThreadChoice{FLAGS_num_threads, "--num_threads"};
  return DefaultComputeThreads();
}

absl::StatusOr<TrainerConfig> ConfigFromFlags(int64_t vocab_size, int tp, int local_rank) {
  TrainerConfig c;
  ModelOptions& m = c.model;
  m.num_layers = FLAGS_num_layers;
  m.hidden_size = FLAGS_hidden_size;
  m.num_attention_heads = FLAGS_num_attention_heads;
  m.ffn_hidden_size = FLAGS_ffn_hidden_size > 0 ? FLAGS_ffn_hidden_size : 4 * FLAGS_hidden_size;
  m.seq_length = FLAGS_seq_length;
  m.max_position_embeddings = FLAGS_max_position_embeddings;
  FULCRUM_RETURN_IF_ERROR(ParsePositionEmbedding(FLAGS_position_embedding_type,
                                                 &m.position_embedding));
  m.rotary_base = FLAGS_rotary_base;
  m.tie_embeddings = !FLAGS_untie_embeddings_and_output_weights;
  m.init_method_std = FLAGS_init_method_std;
  m.layernorm_epsilon = FLAGS_norm_epsilon;
  FULCRUM_RETURN_IF_ERROR(ParseNormalization(FLAGS_normalization, &m.normalization));
  m.swiglu = FLAGS_swiglu;
  if (FLAGS_group_query_attention) {
    if (FLAGS_num_query_groups < 1) {
      return Invalid(absl::StrCat("--num_query_groups=", FLAGS_num_query_groups, " must be ≥ 1"));
    }
    m.num_query_groups = FLAGS_num_query_groups;
  } else if (!gflags::GetCommandLineFlagInfoOrDie("num_query_groups").is_default) {
    return Invalid("--num_query_groups needs --group_query_attention");
  }
  m.add_bias_linear = !FLAGS_disable_bias_linear;
  m.openai_gelu = FLAGS_openai_gelu;
  if (m.swiglu && m.openai_gelu) return Invalid("--openai_gelu and --swiglu exclude each other");
  m.hidden_dropout = FLAGS_hidden_dropout;
  m.attention_dropout = FLAGS_attention_dropout;
  // NOTE [activation recomputation] in core/transformer_layer.h.
  if (FLAGS_recompute_granularity == "full") {
    m.recompute_layers = true;
    if (FLAGS_recompute_num_layers < 0) {
      return Invalid(absl::StrCat("--recompute_num_layers=", FLAGS_recompute_num_layers,
                                  " must be ≥ 0 (0: every layer)"));
    }
    m.recompute_num_layers = FLAGS_recompute_num_layers;
  } else if (FLAGS_recompute_granularity == "selective") {
    if (FLAGS_recompute_num_layers != 0) {
      return Invalid("--recompute_num_layers is for --recompute_granularity=full; selective "
                     "recomputes the attention core of every layer");
    }
    m.recompute_attention = true;
  } else if (!FLAGS_recompute_granularity.empty()) {
    return Invalid(absl::StrCat("--recompute_granularity='", FLAGS_recompute_granularity,
                                "' is unknown; expected full or selective (or empty: none)"));
  } else if (FLAGS_recompute_num_layers != 0) {
    return Invalid("--recompute_num_layers needs --recompute_granularity=full");
  }
  // NOTE [sequence parallelism] in core/tensor_parallel.h.
  if (FLAGS_sequence_parallel) {
    if (tp < 2) {
      return Invalid(absl::StrCat("--sequence_parallel needs --tensor_model_parallel_size > 1 "
                                  "(it splits the sequence over the tensor-parallel ranks); got ",
                                  tp));
    }
    if (m.seq_length % tp != 0) {
      return Invalid(absl::StrCat("--sequence_parallel: --seq_length=", m.seq_length,
                                  " is not a multiple of --tensor_model_parallel_size=", tp));
    }
    m.sequence_parallel = true;
  }
  m.seed = FLAGS_seed;
  // NOTE [device seam]: one DeviceSpec from --device, --params_dtype and --bf16.
  FULCRUM_RETURN_IF_ERROR(ParseParamsDtype(FLAGS_params_dtype, &m.device_spec));
  FULCRUM_ASSIGN_OR_RETURN(m.device_spec.device, ResolveDevice(FLAGS_device, local_rank));
  if (FLAGS_bf16) {
    if (m.device_spec.master_dtype != at::kFloat) {
      return Invalid(absl::StrCat("--bf16 computes over fp32 master weights; it excludes --params_dtype=",
                                  FLAGS_params_dtype));
    }
    m.device_spec.compute_dtype = at::kBFloat16;
  }
  FULCRUM_RETURN_IF_ERROR(m.device_spec.Validate());
  if (FLAGS_make_vocab_size_divisible_by < 1) {
    return Invalid(absl::StrCat("--make_vocab_size_divisible_by=",
                                FLAGS_make_vocab_size_divisible_by, " must be ≥ 1"));
  }
  // Padding depends on the flag alone, never on the layout: the padded rows take part in the
  // softmax, so the same model under any tp needs the same padded size (unlike Megatron,
  // which pads to a multiple of divisible_by × tp).
  // vocab_size 0: not known yet (the early check before the data is read); the padded
  // size is checked once it is.
  m.vocab_size = vocab_size > 0 ? PadVocab(vocab_size, FLAGS_make_vocab_size_divisible_by)
                                : FLAGS_make_vocab_size_divisible_by * tp;
  if (vocab_size > 0 && m.vocab_size % tp != 0) {
    return Invalid(absl::StrCat("the padded vocabulary (", m.vocab_size,
                                ") is not divisible by --tensor_model_parallel_size=", tp,
                                "; make --make_vocab_size_divisible_by a multiple of it"));
  }

  OptimizerOptions& o = c.optimizer;
  o.lr = FLAGS_lr;
  o.min_lr = FLAGS_min_lr;
  o.weight_decay = FLAGS_weight_decay;
  o.adam_beta1 = FLAGS_adam_beta1;
  o.adam_beta2 = FLAGS_adam_beta2;
  o.adam_eps = FLAGS_adam_eps;
  o.clip_grad = FLAGS_clip_grad;
  o.use_distributed_optimizer = FLAGS_use_distributed_optimizer;
  o.overlap_grad_reduce = FLAGS_overlap_grad_reduce;
  o.ddp_bucket_size = FLAGS_ddp_bucket_size;

  LrScheduleOptions& s = c.schedule;
  s.lr = FLAGS_lr;
  s.min_lr = FLAGS_min_lr;
  s.warmup_iters = FLAGS_lr_warmup_iters;
  s.decay_iters = FLAGS_lr_decay_iters;
  FULCRUM_RETURN_IF_ERROR(ParseLrDecayStyle(FLAGS_lr_decay_style, &s.decay_style));

  TrainOptions& t = c.train;
  t.micro_batch_size = FLAGS_micro_batch_size;
  t.global_batch_size = FLAGS_global_batch_size;
  t.train_iters = FLAGS_train_iters;
  t.exit_interval = FLAGS_exit_interval;
  t.log_interval = FLAGS_log_interval;
  t.eval_interval = FLAGS_eval_interval;
  t.eval_iters = FLAGS_eval_iters;
  t.save_interval = FLAGS_save_interval;
  t.save = FLAGS_save;
  t.load = FLAGS_load;
  t.metrics_file = FLAGS_metrics_file;
  t.load_trace = FLAGS_load_trace;
  t.tensorboard_dir = FLAGS_tensorboard_dir;
  t.save_keep_last = FLAGS_save_keep_last;
  t.async_save = FLAGS_async_save;
  if (FLAGS_ckpt_format != "sharded" && FLAGS_ckpt_format != "full") {
    return Invalid(absl::StrCat("--ckpt_format='", FLAGS_ckpt_format,
                                "' is not a checkpoint format; expected sharded or full"));
  }
  t.sharded_checkpoints = FLAGS_ckpt_format == "sharded";
  t.allow_data_change = FLAGS_allow_data_change;
  t.finetune = FLAGS_finetune;
  c.data_path = FLAGS_data_path;

  c.data.seq_length = FLAGS_seq_length;
  c.data.seed = FLAGS_seed;
  c.data.split = FLAGS_split;
  FULCRUM_RETURN_IF_ERROR(c.Validate());
  return c;
}

std::string LoadPathFlag() { return FLAGS_load; }
bool AllowUnchecksummedManifestFlag() { return FLAGS_allow_unchecksummed_manifest; }
std::string PluginsFlag() { return FLAGS_plugins; }
std::string DeviceFlag() { return FLAGS_device; }
bool LayerTimingFlag() { return FLAGS_layer_timing; }
bool MeasuredZbvOrderFlag() { return FLAGS_zbv_order == "measured"; }

}  // namespace fulcrum
