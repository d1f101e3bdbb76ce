// The built-in recipes. Sizes are chosen for what each is for: `tiny` shows a falling loss
// in about half a minute on two CPU cores, `tiny_moe` is `tiny` with MoE layers, `llama_tiny`
// is `tiny` shaped as a Llama; `gpt_20m` is a ~20M-parameter GPT for benchmarks and longer
// CPU runs; `llama2_7b` and `llama3_8b` are published models' shapes for GPU users.
#include "recipes/recipes.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace fulcrum {

namespace {

Recipe Tiny() {
  return Recipe{{{"num_layers", "4"},
                 {"hidden_size", "128"},
                 {"num_attention_heads", "4"},
                 {"seq_length", "128"},
                 {"micro_batch_size", "8"},
                 {"global_batch_size", "16"},
                 {"train_iters", "300"},
                 {"lr", "3e-3"},
                 {"min_lr", "3e-4"},
                 {"lr_warmup_iters", "20"},
                 {"lr_decay_style", "cosine"},
                 {"weight_decay", "0.01"},
                 {"clip_grad", "1.0"},
                 {"log_interval", "20"},
                 {"eval_interval", "100"},
                 {"eval_iters", "4"}}};
}

// `base` with each flag of `changes` set: a value replaced in place, a new flag appended.
Recipe With(Recipe base, const std::vector<std::pair<std::string, std::string>>& changes) {
  for (const auto& [name, value] : changes) {
    auto same = [&name = name](const auto& flag) { return flag.first == name; };
    auto it = std::find_if(base.flags.begin(), base.flags.end(), same);
    if (it != base.flags.end()) {
      it->second = value;
    } else {
      base.flags.emplace_back(name, value);
    }
  }
  return base;
}

}  // namespace

FULCRUM_REGISTER(Recipe, tiny,
                 "4-layer, 128-wide GPT on the embedded corpus; trains in about half a minute on 2 cores",
                 Tiny());

// The Llama architecture (Touvron et al. 2023) at tiny's size: RMSNorm, SwiGLU with Llama's
// 8/3 width rounded up to a multiple of 32, rotary positions, grouped-query attention
// (2 key/value heads for 4 query heads), no linear biases, an untied output layer.
Recipe LlamaTiny() {
  return With(Tiny(), {{"normalization", "RMSNorm"},
                       {"swiglu", "true"},
                       {"ffn_hidden_size", "352"},
                       {"position_embedding_type", "rope"},
                       {"group_query_attention", "true"},
                       {"num_query_groups", "2"},
                       {"disable_bias_linear", "true"},
                       {"untie_embeddings_and_output_weights", "true"},
                       {"norm_epsilon", "1e-5"}});
}

// A published model's shape (no weights: import them with `fulcrum_ckpt import-hf`), with
// the pre-training hyper-parameters its paper reports; the vocabulary comes from the data
// or the imported checkpoint. These need GPUs.
Recipe LlamaShape(int64_t layers, int64_t hidden, int64_t heads, int64_t groups, int64_t ffn,
                  int64_t seq, const char* rotary_base) {
  return Recipe{{{"num_layers", std::to_string(layers)},
                 {"hidden_size", std::to_string(hidden)},
                 {"num_attention_heads", std::to_string(heads)},
                 {"group_query_attention", groups == heads ? "false" : "true"},
                 {"num_query_groups", std::to_string(groups == heads ? 1 : groups)},
                 {"ffn_hidden_size", std::to_string(ffn)},
                 {"seq_length", std::to_string(seq)},
                 {"normalization", "RMSNorm"},
                 {"norm_epsilon", "1e-5"},
                 {"swiglu", "true"},
                 {"disable_bias_linear", "true"},
                 {"position_embedding_type", "rope"},
                 {"rotary_base", rotary_base},
                 {"untie_embeddings_and_output_weights", "true"},
                 {"micro_batch_size", "1"},
                 {"global_batch_size", "1024"},
                 {"lr", "3e-4"},
                 {"min_lr", "3e-5"},
                 {"lr_warmup_iters", "2000"},
                 {"lr_decay_style", "cosine"},
                 {"weight_decay", "0.1"},
                 {"adam_beta2", "0.95"},
                 {"adam_eps", "1e-5"},
                 {"clip_grad", "1.0"},
                 {"log_interval", "10"}}};
}

// Fewer iterations and a lower learning rate than tiny: at 3e-3 the MoE loss spikes. The
// experts are as wide as the dense MLP (Mixtral's shape), so top-2 routing costs an MoE
// layer about twice a dense MLP's compute: MoE layers are the heavy ones a pipeline must
// balance (--moe_layer_freq=[1,1,1,1,0,0,0,0] puts them all on the first stages).
FULCRUM_REGISTER(Recipe, tiny_moe,
                 "tiny with 8 top-2 experts (as wide as the MLP) in every other layer; about a "
                 "minute on 2 cores",
                 With(Tiny(), {{"num_experts", "8"},
                               {"moe_router_topk", "2"},
                               {"moe_ffn_hidden_size", "512"},
                               {"moe_layer_freq", "2"},
                               {"moe_router", "topk"},
                               {"moe_capacity_factor", "1.25"},
                               {"moe_aux_loss_coeff", "1e-2"},
                               {"moe_z_loss_coeff", "1e-3"},
                               {"train_iters", "200"},
                               {"lr", "2e-3"},
                               {"min_lr", "2e-4"}}));

FULCRUM_REGISTER(Recipe, llama_tiny,
                 "tiny as a Llama: RMSNorm, SwiGLU, rope, 2 key/value heads, no biases, untied "
                 "head; about half a minute on 2 cores",
                 LlamaTiny());

FULCRUM_REGISTER(Recipe, llama2_7b,
                 "Llama 2 7B's shape (32 layers, 4096 wide, 32 heads, seq 4096); GPUs",
                 LlamaShape(32, 4096, 32, 32, 11008, 4096, "10000"));

FULCRUM_REGISTER(Recipe, llama3_8b,
                 "Llama 3 8B's shape (32 layers, 4096 wide, 8 key/value heads, seq 8192); GPUs",
                 LlamaShape(32, 4096, 32, 8, 14336, 8192, "500000"));

// Mixtral (Jiang et al. 2024) at llama_tiny's size: every layer's MLP is 4 SwiGLU experts,
// each as wide as llama_tiny's MLP, behind Mixtral's router (top-2 of a softmax over all
// experts, renormalised), dropless.
FULCRUM_REGISTER(Recipe, mixtral_tiny,
                 "llama_tiny with 4 top-2 SwiGLU experts in every layer (Mixtral's router, "
                 "dropless); about a minute on 2 cores",
                 With(LlamaTiny(), {{"num_experts", "4"},
                                    {"moe_router_topk", "2"},
                                    {"moe_ffn_hidden_size", "352"},
                                    {"moe_layer_freq", "1"},
                                    {"moe_router", "mixtral"},
                                    {"moe_capacity_factor", "0"},
                                    {"moe_aux_loss_coeff", "1e-2"},
                                    {"train_iters", "200"},
                                    {"lr", "2e-3"},
                                    {"min_lr", "2e-4"}}));

FULCRUM_REGISTER(Recipe, mixtral_8x7b,
                 "Mixtral 8x7B's shape (32 layers, 4096 wide, 8 key/value heads, 8 top-2 "
                 "experts of 14336); GPUs",
                 With(LlamaShape(32, 4096, 32, 8, 14336, 4096, "1000000"),
                      {{"num_experts", "8"},
                       {"moe_router_topk", "2"},
                       {"moe_ffn_hidden_size", "14336"},
                       {"moe_layer_freq", "1"},
                       {"moe_router", "mixtral"},
                       {"moe_capacity_factor", "0"},
                       {"moe_aux_loss_coeff", "1e-2"}}));

FULCRUM_REGISTER(Recipe, gpt_20m,
                 "6-layer, 512-wide GPT (~20M parameters with a small vocabulary)",
                 (Recipe{{{"num_layers", "6"},
                          {"hidden_size", "512"},
                          {"num_attention_heads", "8"},
                          {"seq_length", "256"},
                          {"micro_batch_size", "4"},
                          {"global_batch_size", "16"},
                          {"train_iters", "2000"},
                          {"lr", "6e-4"},
                          {"min_lr", "6e-5"},
                          {"lr_warmup_iters", "100"},
                          {"lr_decay_style", "cosine"},
                          {"weight_decay", "0.1"},
                          {"clip_grad", "1.0"},
                          {"log_interval", "10"},
                          {"eval_interval", "200"},
                          {"eval_iters", "8"}}}));

}  // namespace fulcrum
