// The built-in recipes. Sizes are chosen for what each is for: `tiny` shows a falling loss
// in about half a minute on two CPU cores, `tiny_moe` is `tiny` with MoE layers; `gpt_20m` is a ~20M-parameter GPT for benchmarks and
// longer CPU runs.
#include "recipes/recipes.h"

#include <algorithm>

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
