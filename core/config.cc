#include "core/config.h"

#include "absl/strings/str_cat.h"

namespace fulcrum {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::Status ParsePositionEmbedding(const std::string& text, PositionEmbedding* out) {
  if (text == "learned" || text == "learned_absolute") {
    *out = PositionEmbedding::kLearned;
  } else if (text == "rope" || text == "rotary") {
    *out = PositionEmbedding::kRotary;
  } else {
    return Invalid(absl::StrCat("--position_embedding_type='", text,
                                "' is unknown; expected learned_absolute or rope"));
  }
  return absl::OkStatus();
}

const char* PositionEmbeddingName(PositionEmbedding p) {
  return p == PositionEmbedding::kLearned ? "learned_absolute" : "rope";
}

absl::Status ParseParamsDtype(const std::string& text, DeviceSpec* spec) {
  if (text == "fp32" || text == "float32") {
    spec->master_dtype = spec->compute_dtype = at::kFloat;
  } else if (text == "fp64" || text == "float64") {
    spec->master_dtype = spec->compute_dtype = at::kDouble;
  } else {
    return Invalid(absl::StrCat("--params_dtype='", text, "' is unknown; expected fp32 or fp64",
                                text == "bf16" || text == "bfloat16"
                                    ? " (bf16 compute over fp32 masters is --bf16)"
                                    : ""));
  }
  return absl::OkStatus();
}

absl::Status ParseLrDecayStyle(const std::string& text, LrDecayStyle* out) {
  if (text == "constant") {
    *out = LrDecayStyle::kConstant;
  } else if (text == "linear") {
    *out = LrDecayStyle::kLinear;
  } else if (text == "cosine") {
    *out = LrDecayStyle::kCosine;
  } else {
    return Invalid(absl::StrCat("--lr_decay_style='", text,
                                "' is unknown; expected constant, linear or cosine"));
  }
  return absl::OkStatus();
}

absl::Status ParseNormalization(const std::string& text, Normalization* out) {
  if (text == "LayerNorm") {
    *out = Normalization::kLayerNorm;
  } else if (text == "RMSNorm") {
    *out = Normalization::kRMSNorm;
  } else {
    return Invalid(absl::StrCat("--normalization='", text, "' is unknown; use LayerNorm or RMSNorm"));
  }
  return absl::OkStatus();
}

const char* NormalizationName(Normalization n) {
  return n == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm";
}

const char* LrDecayStyleName(LrDecayStyle s) {
  switch (s) {
    case LrDecayStyle::kConstant: return "constant";
    case LrDecayStyle::kLinear: return "linear";
    case LrDecayStyle::kCosine: return "cosine";
  }
  return "?";
}

absl::Status ModelOptions::Validate() const {
  if (num_layers < 1) return Invalid(absl::StrCat("--num_layers=", num_layers, " must be ≥ 1"));
  if (hidden_size < 1) return Invalid(absl::StrCat("--hidden_size=", hidden_size, " must be ≥ 1"));
  if (num_attention_heads < 1) {
    return Invalid(absl::StrCat("--num_attention_heads=", num_attention_heads, " must be ≥ 1"));
  }
  if (hidden_size % num_attention_heads != 0) {
    return Invalid(absl::StrCat("--hidden_size=", hidden_size,
                                " is not divisible by --num_attention_heads=",
                                num_attention_heads));
  }
  if (num_query_groups < 0 || num_attention_heads % query_groups() != 0) {
    return Invalid(absl::StrCat("--num_query_groups=", num_query_groups,
                                " must divide --num_attention_heads=", num_attention_heads));
  }
  if (position_embedding == PositionEmbedding::kRotary && head_dim() % 2 != 0) {
    return Invalid(absl::StrCat("rotary positions need an even head dimension; hidden_size/heads = ",
                                head_dim()));
  }
  if (ffn_hidden_size < 1) {
    return Invalid(absl::StrCat("--ffn_hidden_size=", ffn_hidden_size, " must be ≥ 1"));
  }
  if (vocab_size < 1) return Invalid(absl::StrCat("vocab size ", vocab_size, " must be ≥ 1"));
  if (seq_length < 1) return Invalid(absl::StrCat("--seq_length=", seq_length, " must be ≥ 1"));
  if (max_position_embeddings < 0) {
    return Invalid(absl::StrCat("--max_position_embeddings=", max_position_embeddings,
                                " must be ≥ 0 (0: --seq_length)"));
  }
  if (max_position_embeddings > 0 && position_embedding != PositionEmbedding::kLearned) {
    return Invalid(absl::StrCat("--max_position_embeddings=", max_position_embeddings,
                                " sizes the learned position table; rotary positions have "
                                "none (leave it 0)"));
  }
  if (seq_length > position_rows()) {
    return Invalid(absl::StrCat("--seq_length=", seq_length, " exceeds --max_position_embeddings=",
                                max_position_embeddings,
                                ", the learned positions there are (raise it, or shorten the "
                                "sequence)"));
  }
  if (!(init_method_std > 0)) {
    return Invalid(absl::StrCat("--init_method_std=", init_method_std, " must be > 0"));
  }
  if (!(layernorm_epsilon > 0)) {
    return Invalid(absl::StrCat("--norm_epsilon=", layernorm_epsilon, " must be > 0"));
  }
  if (!(hidden_dropout >= 0 && hidden_dropout < 1)) {
    return Invalid(absl::StrCat("--hidden_dropout=", hidden_dropout, " must be in [0, 1)"));
  }
  if (!(attention_dropout >= 0 && attention_dropout < 1)) {
    return Invalid(absl::StrCat("--attention_dropout=", attention_dropout, " must be in [0, 1)"));
  }
  return device_spec.Validate();
}

absl::Status OptimizerOptions::Validate() const {
  if (!(lr > 0)) return Invalid(absl::StrCat("--lr=", lr, " must be > 0"));
  if (!(min_lr >= 0 && min_lr <= lr)) {
    return Invalid(absl::StrCat("--min_lr=", min_lr, " must be in [0, --lr=", lr, "]"));
  }
  if (!(weight_decay >= 0)) {
    return Invalid(absl::StrCat("--weight_decay=", weight_decay, " must be ≥ 0"));
  }
  if (!(adam_beta1 >= 0 && adam_beta1 < 1)) {
    return Invalid(absl::StrCat("--adam_beta1=", adam_beta1, " must be in [0, 1)"));
  }
  if (!(adam_beta2 >= 0 && adam_beta2 < 1)) {
    return Invalid(absl::StrCat("--adam_beta2=", adam_beta2, " must be in [0, 1)"));
  }
  if (!(adam_eps > 0)) return Invalid(absl::StrCat("--adam_eps=", adam_eps, " must be > 0"));
  if (ddp_bucket_size < 0) {
    return Invalid(absl::StrCat("--ddp_bucket_size=", ddp_bucket_size,
                                " must be ≥ 0 (0: the default, 25 MiB of fp32)"));
  }
  if (!(clip_grad >= 0)) {
    return Invalid(absl::StrCat("--clip_grad=", clip_grad, " must be ≥ 0 (0 disables)"));
  }
  return absl::OkStatus();
}

absl::Status LrScheduleOptions::Validate() const {
  if (!(lr > 0)) return Invalid(absl::StrCat("--lr=", lr, " must be > 0"));
  if (!(min_lr >= 0 && min_lr <= lr)) {
    return Invalid(absl::StrCat("--min_lr=", min_lr, " must be in [0, --lr=", lr, "]"));
  }
  if (warmup_iters < 0) {
    return Invalid(absl::StrCat("--lr_warmup_iters=", warmup_iters, " must be ≥ 0"));
  }
  if (decay_iters < 0) {
    return Invalid(absl::StrCat("--lr_decay_iters=", decay_iters, " must be ≥ 0"));
  }
  if (decay_iters > 0 && warmup_iters > decay_iters) {
    return Invalid(absl::StrCat("--lr_warmup_iters=", warmup_iters,
                                " exceeds --lr_decay_iters=", decay_iters));
  }
  return absl::OkStatus();
}

absl::Status TrainOptions::Validate() const {
  if (micro_batch_size < 1) {
    return Invalid(absl::StrCat("--micro_batch_size=", micro_batch_size, " must be ≥ 1"));
  }
  if (global_batch_size < 1) {
    return Invalid(absl::StrCat("--global_batch_size=", global_batch_size, " must be ≥ 1"));
  }
  if (global_batch_size % micro_batch_size != 0) {
    return Invalid(absl::StrCat("--global_batch_size=", global_batch_size,
                                " is not a multiple of --micro_batch_size=", micro_batch_size));
  }
  if (train_iters < 1) {
    return Invalid(absl::StrCat("--train_iters=", train_iters, " must be ≥ 1"));
  }
  if (exit_interval < 0) {
    return Invalid(absl::StrCat("--exit_interval=", exit_interval, " must be ≥ 0"));
  }
  if (log_interval < 1) {
    return Invalid(absl::StrCat("--log_interval=", log_interval, " must be ≥ 1"));
  }
  if (eval_interval < 0) {
    return Invalid(absl::StrCat("--eval_interval=", eval_interval, " must be ≥ 0"));
  }
  if (eval_interval > 0 && eval_iters < 1) {
    return Invalid(absl::StrCat("--eval_iters=", eval_iters, " must be ≥ 1 when evaluating"));
  }
  if (save_interval < 0) {
    return Invalid(absl::StrCat("--save_interval=", save_interval, " must be ≥ 0"));
  }
  if (save_keep_last < 0) {
    return Invalid(absl::StrCat("--save_keep_last=", save_keep_last, " must be ≥ 0"));
  }
  if (save_keep_last > 0 && save.empty()) {
    return Invalid(absl::StrCat("--save_keep_last=", save_keep_last, " needs --save=DIR"));
  }
  if (async_save && save.empty()) {
    return Invalid("--async_save needs --save=DIR: it writes the checkpoints of --save in the "
                   "background");
  }
  if (save_interval > 0 && save.empty()) {
    return Invalid(absl::StrCat("--save_interval=", save_interval, " needs --save=DIR"));
  }
  if (finetune && load.empty()) {
    return Invalid("--finetune needs --load=DIR: the checkpoint whose weights to start from");
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
