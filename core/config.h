// Options structs for the model, optimizer, learning-rate schedule and training loop.
// These are plain values with documented defaults; flags become these structs in
// recipes/ (and only there). Each struct validates itself before any work starts.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "core/device.h"

namespace fulcrum {

enum class PositionEmbedding { kLearned, kRotary };
/// The layer norms' kind: LayerNorm (GPT-2: weight and bias) or RMSNorm (Llama: weight only,
/// x / sqrt(mean(x²) + eps), computed in fp32 as Hugging Face's LlamaRMSNorm does).
enum class Normalization { kLayerNorm, kRMSNorm };
enum class LrDecayStyle { kConstant, kLinear, kCosine };

/// "learned" / "rope" (also "rotary") → enum; error names the flag otherwise.
absl::Status ParsePositionEmbedding(const std::string& text, PositionEmbedding* out);
const char* PositionEmbeddingName(PositionEmbedding p);
/// "LayerNorm" / "RMSNorm" (Megatron's spellings) → enum; error names --normalization otherwise.
absl::Status ParseNormalization(const std::string& text, Normalization* out);
const char* NormalizationName(Normalization n);
absl::Status ParseLrDecayStyle(const std::string& text, LrDecayStyle* out);
/// --params_dtype: "fp32" / "fp64" (also float32, float64) becomes spec's master and compute
/// dtype (bf16 compute is --bf16's, over fp32 masters); error names the flag otherwise.
absl::Status ParseParamsDtype(const std::string& text, DeviceSpec* spec);
const char* LrDecayStyleName(LrDecayStyle s);

struct ModelOptions {
  int64_t num_layers = 4;             // Default: 4. Must be ≥ 1.
  int64_t hidden_size = 128;          // Default: 128. Must be divisible by num_attention_heads.
  int64_t num_attention_heads = 4;    // Default: 4.
  int64_t ffn_hidden_size = 512;      // Default: 512 (4 × hidden_size in the recipes).
  int64_t vocab_size = 0;             // Padded vocabulary size. Must be > 0 (set from the data).
  int64_t seq_length = 128;           // Default: 128. Tokens per sample.
  PositionEmbedding position_embedding = PositionEmbedding::kLearned;
  /// Default: 0 = seq_length. Rows of the learned position table (--max_position_embeddings,
  /// GPT-2's n_positions): a run trains at any seq_length up to it, e.g. GPT-2's 1024-row
  /// table fine-tuned at 512 tokens (NOTE [finetune]). Learned positions only: rotary ones
  /// have no table.
  int64_t max_position_embeddings = 0;
  double rotary_base = 10000.0;       // Default: 10000 (RoFormer).
  bool tie_embeddings = true;         // Default: true. LM head reuses the word embeddings.
  double init_method_std = 0.02;      // Default: 0.02. Output projections get std/√(2·layers).
  double layernorm_epsilon = 1e-5;    // Default: 1e-5 (--norm_epsilon). Of either norm.
  Normalization normalization = Normalization::kLayerNorm;  // Default: LayerNorm.
  /// Default: false. The MLP (and MoE experts) compute fc2(silu(gate) ⊙ up) with fc1 holding
  /// the gate and up rows interleaved (NOTE [SwiGLU rows]); ffn_hidden_size is the width of
  /// gate and of up.
  bool swiglu = false;
  /// Default: 0 = num_attention_heads (multi-head attention). Key/value heads, each shared by
  /// num_attention_heads / num_query_groups query heads (grouped-query attention; NOTE [QKV
  /// rows]). Must divide num_attention_heads.
  int64_t num_query_groups = 0;
  bool add_bias_linear = true;        // Default: true. Biases on qkv, proj, fc1, fc2, experts.
  bool openai_gelu = false;           // Default: false. tanh-approximate GeLU (GPT-2's gelu_new).
  double hidden_dropout = 0.0;        // Default: 0. Dropout after attention and MLP.
  double attention_dropout = 0.0;     // Default: 0. Dropout on attention probabilities.
  uint64_t seed = 1234;               // Default: 1234. Initialisation and dropout masks.
  /// Default: false (--sequence_parallel). NOTE [sequence parallelism] in
  /// core/tensor_parallel.h: with a tensor-parallel group of more than one rank, the residual
  /// stream between the parallel regions is split along the sequence over the group. A
  /// layout choice, not the model: checkpoints do not record it.
  bool sequence_parallel = false;
  /// NOTE [activation recomputation] (core/transformer_layer.h): with recompute_layers the
  /// first recompute_num_layers layers of every stage (every model chunk) keep only their
  /// input in the forward pass and run again in the backward (0: all of them).
  bool recompute_layers = false;      // Default: false (--recompute_granularity=full sets it).
  int64_t recompute_num_layers = 0;   // Default: 0, every layer when recompute_layers.
  /// Default: false (--recompute_granularity=selective sets it). Every layer's dense attention
  /// core keeps only q, k, v and runs again in the backward (NOTE [activation recomputation]).
  bool recompute_attention = false;
  /// Default: cpu, fp32 masters and compute. Where every tensor of the model lives and in
  /// which precision it computes (NOTE [device seam] in core/device.h) — the one source of
  /// truth for the dtype: --params_dtype sets the master dtype (fp64 is for numerical
  /// checks, telling rounding from bugs: slower, CPU only), --bf16 the compute dtype over
  /// fp32 masters, --device the device. Initial values are drawn in fp32 whatever the
  /// dtype, so fp64 starts from them.
  DeviceSpec device_spec;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  /// Rows of the learned position table: max_position_embeddings, or seq_length when 0.
  int64_t position_rows() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  /// Key/value heads: num_query_groups, or num_attention_heads when it is 0.
  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  /// Rows of the fused QKV weight: queries of every head plus keys and values of every group.
  int64_t qkv_rows() const { return (num_attention_heads + 2 * query_groups()) * head_dim(); }
  absl::Status Validate() const;
};

struct OptimizerOptions {
  double lr = 1e-3;                   // Default: 1e-3. Peak learning rate.
  double min_lr = 0.0;                // Default: 0. Floor of the decay.
  double weight_decay = 0.01;         // Default: 0.01. Decoupled (AdamW); none on biases/norms.
  double adam_beta1 = 0.9;            // Default: 0.9.
  double adam_beta2 = 0.999;          // Default: 0.999.
  double adam_eps = 1e-8;             // Default: 1e-8.
  double clip_grad = 1.0;             // Default: 1.0. Global L2 norm; 0 disables clipping.
  bool use_distributed_optimizer = false;  // Default: false. Shard the moments over data
                                           //   parallelism (core/optimizer/distributed_adamw.h).
  bool overlap_grad_reduce = false;   // Default: false. Start each bucket's data-parallel
                                      //   reduction once its gradients are final, during the
                                      //   backward (core/optimizer/overlapped_reduction.h).
  int64_t ddp_bucket_size = 0;        // Default: 0 = 25 MiB of fp32. Elements per bucket of
                                      //   the distributed optimizer and overlapped reduction.
  /// The byte budget of one such bucket (gradients are fp32 masters: 4 bytes an element).
  int64_t BucketBytes() const { return ddp_bucket_size > 0 ? 4 * ddp_bucket_size : 25 << 20; }
  absl::Status Validate() const;
};

struct LrScheduleOptions {
  double lr = 1e-3;                   // Default: 1e-3. Peak, reached at the end of warmup.
  double min_lr = 0.0;                // Default: 0.
  int64_t warmup_iters = 0;           // Default: 0. Linear warmup from 0 over these steps.
  int64_t decay_iters = 0;            // Default: 0 = train_iters. Decay ends here at min_lr.
  LrDecayStyle decay_style = LrDecayStyle::kCosine;  // Default: cosine.
  absl::Status Validate() const;
};

struct TrainOptions {
  int64_t micro_batch_size = 8;       // Default: 8. Samples per forward/backward.
  int64_t global_batch_size = 16;     // Default: 16. Must be a multiple of micro_batch_size
                                      //   (times data-parallel size).
  int64_t train_iters = 100;          // Default: 100. Total optimizer steps of the run.
  int64_t exit_interval = 0;          // Default: 0 (off). Save and stop at a multiple of this.
  int64_t log_interval = 10;          // Default: 10.
  int64_t eval_interval = 0;          // Default: 0 (off).
  int64_t eval_iters = 10;            // Default: 10. Global batches per evaluation.
  int64_t save_interval = 0;          // Default: 0 (only at exit and at the end when save set).
  std::string save;                   // Default: none. Checkpoint directory.
  std::string load;                   // Default: none. Checkpoint directory (or iter_ dir).
  /// Default: 0 (keep all). After each save, delete all but the newest this many
  /// checkpoints of `save` (never the one `latest` names).
  int64_t save_keep_last = 0;
  /// Default: true (--ckpt_format=sharded). Every rank writes the pieces of the state it
  /// holds, nothing gathered (NOTE [sharded checkpoints]); false (full): each tensor-parallel
  /// group gathers whole tensors to one writer. Either loads under any layout.
  bool sharded_checkpoints = true;
  /// Default: false. Interval saves are written in the background (NOTE [background saves]
  /// in core/distributed_checkpoint.h): training waits only while each rank copies what it
  /// writes into host memory, and the checkpoint is committed at the first iteration end
  /// after every rank's write. The save that ends a Run (at train_iters, exit_interval or a
  /// stop) is complete before Run returns. Needs `save`, and a FileSystem that may be used
  /// from two threads at once (DefaultFileSystem() may).
  bool async_save = false;
  std::string metrics_file;           // Default: none. JSON lines, one per iteration.
  /// Default: none. JSON lines of each iteration's measured per-layer F/B/W, plugin loads
  /// and placement (pipeline/load_trace.h), for fulcrum_sim --trace.
  std::string load_trace;
  /// Default: none. A directory for TensorBoard event files: the metrics record's scalars
  /// each iteration (core/metrics.h, TensorBoardScalars), one new file per run.
  std::string tensorboard_dir;
  /// Default: false. Resume from a checkpoint that trained on other data (another
  /// --data_path, --split or --seed) instead of refusing (NOTE [resume checks]).
  bool allow_data_change = false;
  /// Default: false. Start from the model weights of `load` alone (an imported Hugging Face
  /// checkpoint, or any Fulcrum checkpoint): iteration 0, a fresh optimizer and schedule,
  /// no data checks; the model's shape must still agree (NOTE [finetune],
  /// core/training_manifest.h). Needs `load`.
  bool finetune = false;
  absl::Status Validate() const;
};

}  // namespace fulcrum
