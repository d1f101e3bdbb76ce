// The MoE layer: replaces the dense MLP of every --moe_layer_freq-th transformer layer
// (core/feed_forward.h) by E experts behind a router: MLPs with the dense MLP's activation
// (MlpActivation in core/transformer_layer.h: GeLU, tanh GeLU under --openai_gelu, or
// fc2(silu(gate) * up) under --swiglu, as Mixtral's). With --moe_router=mixtral,
// --disable_bias_linear and a dropless --moe_capacity_factor=0 the layer computes what HF
// transformers' MixtralSparseMoeBlock does.
//
//   x [T, D] → router (moe/router.h) → capacity and slots (moe/capacity.h)
//     → Dispatch by indices into [E, C, D] (moe/dispatch.h)
//     → all-to-all over the expert-parallel group → [E/n, n·C, D] (moe/expert_parallel.h)
//     → each local expert: fc1, GeLU or SwiGLU, fc2 (tensor-parallel like the dense MLP)
//     → all-to-all back → Combine by indices → [T, D]
// With cached assignments (moe/assignment_cache.h) the router's choice of experts comes
// from the cache, and for a fully cached micro-batch (padded buffers, no batch-prioritized
// routing, no chunked overlap) everything up to the experts starts before the router runs.
//
// Parameters, as global names of layer i (Megatron-core's, with global expert ids, so a
// checkpoint loads under any expert-parallel size):
//   layers.i.mlp.router.weight (and the router's other parameters)
//   layers.i.mlp.experts.<e>.linear_fc1.weight [F, D]  (tensor-parallel rows; [2F, D]
//                                                      under --swiglu, gate and up rows
//                                                      interleaved: NOTE [SwiGLU rows])
//   layers.i.mlp.experts.<e>.linear_fc1.bias   [F]     (tensor-parallel; [2F] under --swiglu)
//   layers.i.mlp.experts.<e>.linear_fc2.weight [D, F]  (tensor-parallel columns)
//   layers.i.mlp.experts.<e>.linear_fc2.bias   [D]
// The biases exist only with ModelOptions::add_bias_linear (not under --disable_bias_linear).
// Expert parameters are Parameter::expert_parallel; a rank holds only its experts.
// Router state that is not trained (the aux_free bias) is a buffer of the layer's unit, as
// are the assignment cache's table and counters (layers.i.mlp.assignment_cache[_state]).
//
// NOTE [MoE auxiliary losses]
// The router's auxiliary losses (already scaled by their coefficients) join the training
// loss without passing through the pipeline: the layer's output carries them into the
// backward pass, where their gradient is ctx.loss_scale × T (T tokens of the micro-batch)
// — the weight that makes them the mean over the global batch's micro-batches, whatever
// the layout (Megatron's MoEAuxLossAutoScaler does the same). Their values are reported
// in the metrics file as the token-weighted mean over micro-batches, summed over layers.
//
// NOTE [MoE layout equivalence]
// Routing, capacity and drops are decided per micro-batch on the rank that holds it: the
// capacity of a fixed factor depends only on the micro-batch's T, and a dropless or capped
// capacity is the maximum over the expert-parallel group, which only pads (a token drops
// iff its slot is past its own micro-batch's cap). Noise is keyed by the global sample
// index. So under any ep (and tp, dp, pp) each token meets the same experts with the same
// gate as in one process, and only the floating-point summation order of the expert
// weight gradients changes.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/feed_forward.h"
#include "core/tensor_parallel.h"
#include "moe/router.h"
#include "parallel/communicator.h"

namespace fulcrum::moe {

/// Configuration of the MoE layers. Flags become these options in recipes/.
struct MoeOptions {
  /// --num_experts: 0 = no MoE layers. Must be divisible by the expert-parallel size.
  int64_t num_experts = 0;
  /// --moe_router_topk: k experts per token. Default: 2.
  int64_t topk = 2;
  /// --moe_router_topk_schedule "ITER:K[,ITER:K...]": from optimizer step ITER on, route
  /// with K experts per token (Tutel's top-any: k may change between steps; capacity
  /// follows). Empty: always `topk`.
  std::map<int64_t, int64_t> topk_schedule;
  /// --moe_ffn_hidden_size: hidden width of each expert; 0 = the model's ffn_hidden_size.
  int64_t ffn_hidden_size = 0;
  /// --moe_layer_freq: layer i is an MoE layer when i % freq == 0 (Megatron's integer
  /// form). Default: 1 (every layer). Ignored when `layer_pattern` is set.
  int64_t layer_freq = 1;
  /// --moe_layer_freq=[1,1,0,0,...] (Megatron's list form): one entry per layer, true for
  /// an MoE layer — e.g. heavy layers on one side of a pipeline. Empty: use `layer_freq`.
  std::vector<bool> layer_pattern;
  /// --moe_router: a name in the router registry (moe/router.h). Default: topk.
  std::string router = "topk";
  /// Router settings; num_experts, topk, hidden_size and seed are filled from above and
  /// from the model.
  RouterOptions router_options;
  /// --moe_capacity_factor: Tutel's sign convention, GShard's rounding (moe/capacity.h).
  /// Default: 1.
  double capacity_factor = 1.0;
  /// --moe_batch_prioritized_routing: confident tokens claim slots first. Default: false.
  bool batch_prioritized = false;
  /// --moe_per_expert_capacity: each expert's buffer holds only the rows it keeps,
  /// min(its load, C), instead of every expert padded to C; the same tokens are kept or
  /// dropped. With expert parallelism the exchange then sends row counts first and
  /// variable-size buffers (NOTE [ragged expert exchange]; always the flat all-to-all).
  /// Default: false.
  bool per_expert_capacity = false;
  /// --moe_a2a_overlap_degree: > 1 exchanges and computes in this many chunks so the
  /// all-to-all overlaps expert compute (NOTE [all-to-all overlap]); no effect at ep = 1.
  /// Default: 1 (off).
  int a2a_overlap_degree = 1;
  /// --moe_hierarchical_a2a_node_size: > 1 selects the two-level all-to-all with this many
  /// ranks per node (NOTE [hierarchical all-to-all]); 0 = flat. Default: 0.
  int hierarchical_node_size = 0;
  /// --moe_assignment_cache_threshold: > 0 turns on DynaMoE's sample-assignment caching
  /// (NOTE [assignment caching] in moe/assignment_cache.h): an epoch whose predecessor
  /// changed the experts of fewer than this fraction of the tokens met again routes by the
  /// cached assignments, and for fully cached micro-batches the exchange starts before the
  /// router runs (conditions in the NOTE). Needs a token-
  /// choice router and no top-k schedule. Default: 0 (off). In [0, 1].
  double assignment_cache_threshold = 0.0;
  /// Tokens of the training split, the positions the cache remembers (the recipe fills it
  /// from the data). Must be > 0 when the cache is on.
  int64_t assignment_cache_positions = 0;

  /// k for optimizer step `iteration` (topk_schedule, else topk).
  int64_t TopKAt(int64_t iteration) const {
    auto it = topk_schedule.upper_bound(iteration);
    return it == topk_schedule.begin() ? topk : std::prev(it)->second;
  }

  /// Whether global layer `layer` is an MoE layer.
  bool IsMoeLayer(int64_t layer) const {
    if (num_experts <= 0) return false;
    if (!layer_pattern.empty()) {
      return layer >= 0 && layer < static_cast<int64_t>(layer_pattern.size()) && layer_pattern[layer];
    }
    return layer_freq > 0 && layer % layer_freq == 0;
  }
  /// --moe_layer_freq as given: "2", or "[1,1,0,0]".
  std::string LayerFreqText() const;
};

/// Parses --moe_layer_freq: an integer ≥ 1 ("2": every second layer) or Megatron's list
/// form "[1,1,1,1,0,0,0,0]" (one 0/1 per layer). InvalidArgument naming the flag.
absl::Status ParseMoeLayerFreq(const std::string& text, MoeOptions* options);

/// The groups an MoE layer communicates over; each may be null for one rank. They must
/// outlive the layers.
struct MoeGroups {
  parallel::Communicator* expert = nullptr;  // ep: shares out the experts (all-to-all).
  parallel::Communicator* data = nullptr;    // dp: sums the step's expert loads.
  TensorParallelGroup* tensor = nullptr;     // tp: shards each expert like the dense MLP.
};

/// The settings that decide the MoE layers' parameters, as (flag, value) for checkpoints
/// (TrainerConfig::feed_forward_shape); empty when num_experts is 0.
std::vector<std::pair<std::string, std::string>> MoeShape(const MoeOptions& options,
                                                          const ModelOptions& model);

/// Checks `options` against the model and the layout; messages name the flag. Needs no
/// data: assignment_cache_positions is checked by MakeMoeFactory.
absl::Status ValidateMoeOptions(const MoeOptions& options, const ModelOptions& model,
                                int expert_parallel_size, int tensor_parallel_size);

/// The factory that gives GptModel its MoE layers (null block for dense layers). Builds the
/// expert-parallel exchange now: collective over `groups.expert`. Validates first.
absl::StatusOr<FeedForwardFactory> MakeMoeFactory(const MoeOptions& options,
                                                  const ModelOptions& model,
                                                  const MoeGroups& groups);

}  // namespace fulcrum::moe
