// The torch-free half of Hugging Face checkpoint import/export (hf_checkpoint.h): a
// transformers config.json read into one normalised description of the model, checked
// against what Fulcrum can represent, and written back; and the same description derived
// from a Fulcrum checkpoint's model configuration (ConfigToJson's "model" object and the
// "feed_forward" shape, core/trainer.cc).
//
// NOTE [HF architectures] Three transformers architectures map onto Fulcrum models:
//   GPT2LMHeadModel    LayerNorm, learned positions, GeLU (gelu → plain, gelu_new →
//                      --openai_gelu), biases everywhere, tied embeddings, heads == groups
//   LlamaForCausalLM   RMSNorm, rope, SwiGLU, no biases, grouped-query attention
//   MixtralForCausalLM Llama's attention with an MoE of SwiGLU experts in every layer,
//                      routed by softmax top-k renormalised (Fulcrum's `mixtral` router;
//                      `topk` computes the same for k > 1 and exports too)
// Anything else is refused naming the config field (or the Fulcrum flag, on export) that
// has no counterpart: nothing is converted approximately. The tensor layouts are in
// /work/notes/hf-spec.md and hf_checkpoint.cc.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace fulcrum::ckpt {

enum class HfArchitecture { kGpt2, kLlama, kMixtral };

/// "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM".
const char* HfArchitectureName(HfArchitecture a);

/// One model in terms both sides can express.
struct HfModelConfig {
  HfArchitecture architecture = HfArchitecture::kGpt2;
  int64_t num_layers = 0;
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;   // Key/value heads; == num_attention_heads for GPT-2.
  int64_t ffn_hidden_size = 0;    // Dense MLP width; Mixtral: each expert's width.
  int64_t vocab_size = 0;
  int64_t max_positions = 0;      // GPT-2 n_positions; Llama max_position_embeddings.
  bool tie_embeddings = true;
  double norm_epsilon = 1e-5;
  double rotary_base = 10000.0;   // Llama/Mixtral only.
  bool openai_gelu = false;       // GPT-2 only: gelu_new (tanh approximation).
  double init_std = 0.02;
  double hidden_dropout = 0.0;
  double attention_dropout = 0.0;
  int64_t num_experts = 0;        // Mixtral only.
  int64_t experts_per_token = 0;  // Mixtral only.
  double router_aux_loss_coef = 0.0;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

/// Reads transformers' config.json `config` (`source` names it in errors). Unsupported
/// architectures, model types and settings are InvalidArgument naming the field and what
/// Fulcrum supports (NOTE [HF architectures]).
absl::StatusOr<HfModelConfig> ParseHfConfig(const nlohmann::json& config,
                                            const std::string& source);

/// config.json for `m`, loadable by transformers' from_pretrained; `dtype` is the torch
/// dtype name of the weights ("float32", "bfloat16", ...).
nlohmann::json HfConfigJson(const HfModelConfig& m, const std::string& dtype);

/// ConfigToJson's "model" object for `m` (core/trainer.cc), including the fields of
/// grouped-query attention, RMSNorm and SwiGLU; seq_length is max_positions, and so is
/// max_position_embeddings for GPT-2's learned table (0 for rotary positions).
nlohmann::json FulcrumModelJson(const HfModelConfig& m);
/// The "feed_forward" shape (moe::MoeShape) of `m`: empty for dense models.
nlohmann::json FulcrumFeedForwardJson(const HfModelConfig& m);
/// fulcrum_train flags that build `m` (informational, for the manifest and the tool's
/// output), e.g. {"--num_layers=2", "--normalization=RMSNorm", "--swiglu", ...}.
std::vector<std::string> FulcrumFlags(const HfModelConfig& m);

/// The HF description of a Fulcrum checkpoint's model (`model`: ConfigToJson's "model";
/// `feed_forward`: the manifest config's "feed_forward", null or {} for dense). A model no
/// HF architecture expresses is InvalidArgument naming the Fulcrum flag that is the
/// reason. `experts_per_token` is the MoE top-k (0: not known; an MoE model then needs it
/// from `imported_config`, the checkpoint's "imported_from"."config", when present).
absl::StatusOr<HfModelConfig> HfConfigFromFulcrum(const nlohmann::json& model,
                                                  const nlohmann::json& feed_forward,
                                                  int64_t experts_per_token,
                                                  const nlohmann::json& imported_config);

}  // namespace fulcrum::ckpt
