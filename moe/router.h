// MoE routers: which experts each token goes to, with what combine weight, and the
// auxiliary losses that keep the experts balanced. A router is found by name
// (`--moe_router=`) in a registry; `MakeRouter` validates its options and builds it.
//
// A router's output is a flat assignment list (`Routing`), never one-hot T×E×C tensors:
// capacity (moe/capacity.h) and index-based dispatch/combine consume it as it is.
//
// NOTE [assignment order]
// The order of `Routing`'s list is the order in which assignments claim expert slots when
// capacity is limited (AssignSlots in moe/capacity.h). Token-choice routers emit GShard's
// order (Lepikhin et al. 2020, §2.2 and Algorithm 1): every token's first choice in token
// order, then every token's second choice, and so on, so that a second choice is dropped
// before any first choice. Expert-choice routing emits expert-major order (each expert's
// tokens by descending score). PrioritizeByConfidence reorders for batch-prioritized routing.
//
// NOTE [router precision]
// Routers compute in the dtype of their parameters (fp32 as built), whatever the dtype of
// the hidden states: the softmax over experts is exponentiation-sensitive and the choice of
// experts must not flip with bf16 rounding (Switch Transformer §2.4, "selective precision").
// Tests convert the parameters to double for finite differences.
//
// Not thread-safe: a router belongs to one MoE layer on one stage.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/registry.h"

namespace fulcrum::moe {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Configuration of a router. Flags become these options in recipes/ (never read here).
struct RouterOptions {
  /// --num_experts. Default: 8. At least 1.
  int64_t num_experts = 8;
  /// --moe_router_topk: experts per token (k). Default: 2. In [1, num_experts]; `switch`
  /// needs 1. Route() takes k per call, so top-any schedules may change it step to step;
  /// this is the value validated at construction.
  int64_t topk = 2;
  /// --hidden_size: width D of the router input. Must be > 0.
  int64_t hidden_size = 0;
  /// --moe_aux_loss_coeff: scale of the balancing losses (Switch/GShard load balancing for
  /// `topk`, `switch`, `cosine`; Hugging Face's for `mixtral`, HF's router_aux_loss_coef;
  /// importance and load for `noisy_topk`). Default: 1e-2.
  /// Must be >= 0; 0 turns them off.
  double aux_loss_coeff = 1e-2;
  /// --moe_z_loss_coeff: ST-MoE router z-loss scale (Zoph et al. 2022, §3.1). Default: 0
  /// (off). Must be >= 0. Every router here is logit-based and honours it.
  double z_loss_coeff = 0.0;
  /// --moe_input_jitter_eps: in training, the router input is multiplied by noise uniform
  /// in [1-eps, 1+eps] (Switch Transformer's router jitter; Megatron's flag of the same
  /// name). Default: 0 (off). In [0, 1).
  double input_jitter_eps = 0.0;
  /// --moe_router_init_std: standard deviation of the normal initialisation of router
  /// weights. Default: 0.02 (Megatron's init_method_std). Must be > 0.
  double init_std = 0.02;
  /// --moe_noise_epsilon (`noisy_topk`): floor added to Softplus(x·W_noise) so the noise
  /// scale, which divides in the load estimator, never reaches 0. Default: 1e-2, as in
  /// Shazeer's reference implementation (tensor2tensor `noisy_top_k_gating`). Must be >= 0.
  double noise_epsilon = 1e-2;
  /// --moe_router_bias_update_rate (`aux_free`): γ of DeepSeek-V3 §2.1.2. Default: 1e-3.
  /// Must be >= 0.
  double bias_update_rate = 1e-3;
  /// --moe_sinkhorn_iterations (`sinkhorn`): most Sinkhorn iterations; they stop earlier
  /// once the column scaling changes by less than 1e-4 on average (Megatron's tolerance).
  /// Default: 50. At least 1.
  int sinkhorn_iterations = 50;
  /// --moe_expert_choice_capacity_factor (`expert_choice`): c of Zhou et al. 2022; each
  /// expert takes C = min(T, ceil(c·k·T/E)) tokens. Default: 1. Must be > 0.
  double expert_choice_capacity_factor = 1.0;
  /// --moe_cosine_projection_dim (`cosine`): dimension tokens are projected to before the
  /// cosine similarity. Default: 16 (X-MoE's routing dimension). At least 1.
  int64_t cosine_projection_dim = 16;
  /// --moe_cosine_init_temperature (`cosine`): initial τ. Default: 0.5 (Tutel's init_t).
  /// Must be >= cosine_min_temperature.
  double init_temperature = 0.5;
  /// --moe_cosine_min_temperature (`cosine`): τ is clamped from below here, i.e. the logit
  /// scale 1/τ from above. Default: 0.01 (Tutel's clamp). Must be > 0.
  double cosine_min_temperature = 0.01;
  /// Seed of every random draw (NOTE [layout-independent randomness] in core/random.h).
  uint64_t seed = 1234;
  /// Prefix of the keys that initialise parameters: a parameter with local name
  /// "router.weight" is drawn from MakeGenerator(seed, init_scope + ".router.weight"). The
  /// MoE layer sets it to its own global prefix (e.g. "layers.3.mlp"), so the key is the
  /// parameter's global name, as for every other parameter.
  std::string init_scope = "moe";
};

/// What a routing call needs besides its input. The counters key the training noise of
/// `noisy_topk` and the input jitter (NOTE [layout-independent randomness]).
struct RouteContext {
  bool training = true;      // Noise and jitter on; `sinkhorn` balances (eval: plain top-k).
  int64_t iteration = 0;     // Optimizer step being computed.
  int64_t first_sample = 0;  // Global index of the micro-batch's first sample.
  int64_t layer = 0;         // Global index of the transformer layer.
  /// [T, k] int64 or undefined. Where a row's entries are >= 0, a token-choice router
  /// routes that token to these experts instead of its own top-k, and computes the gates
  /// and losses by its usual rule for them (DynaMoE's cached assignments, NOTE [assignment
  /// caching] in moe/assignment_cache.h); rows of −1 take the router's own choice. Routers that
  /// are not token_choice() refuse it.
  at::Tensor fixed_experts;
};

/// The routing of T tokens as a flat list of N assignments, in the order they claim
/// expert slots (NOTE [assignment order]).
struct Routing {
  at::Tensor token;        ///< [N] int64: which token (row of the router input).
  at::Tensor expert;       ///< [N] int64: to which expert.
  at::Tensor gate;         ///< [N] combine weight; differentiable w.r.t. the router's
                           ///< parameters and input.
  at::Tensor probs;        ///< [T, E] the router's probabilities over experts (for metrics
                           ///< and balancing losses; each router documents its own).
  at::Tensor expert_load;  ///< [E] int64: assignments per expert before capacity.
  /// [T, k] int64: the experts the router itself prefers for each token, best first,
  /// whatever RouteContext::fixed_experts imposed. Token-choice routers only.
  at::Tensor choice;
  /// (name, scalar) already multiplied by its coefficient; the caller adds them to the
  /// training loss and reports them. Only losses with a coefficient > 0 appear. Names:
  /// "load_balancing_loss", "importance_loss", "load_loss", "z_loss".
  NamedTensors aux_losses;

  /// N, the number of assignments.
  int64_t size() const { return token.defined() ? token.size(0) : 0; }
};

/// One trainable tensor of a router.
///
/// `value` points at the router's own handle, which its Route() reads. The MoE layer
/// registers the parameter into its Unit and rebinds the handle to the tensor the unit
/// stores: `*p.value = AddParameter(prefix + p.name, *p.value, p.weight_decay)`. That is
/// why this is a pointer rather than the (name, tensor) pair of the first sketch:
/// Unit::AddParameter makes its own leaf, and the router must then compute with that
/// leaf for gradients and optimizer steps to reach it (NOTE [parameter identity]).
struct RouterParameter {
  std::string name;   // Local name, e.g. "router.weight".
  at::Tensor* value;  // fp32 leaf that requires grad; owned by the router.
  bool weight_decay;  // False for scalars such as the cosine router's temperature.
};

class Router {
 public:
  explicit Router(RouterOptions options) : options_(std::move(options)) {}
  virtual ~Router() = default;
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  /// The registered name (`--moe_router=`).
  virtual const char* name() const = 0;

  const RouterOptions& options() const { return options_; }
  int64_t num_experts() const { return options_.num_experts; }

  /// Whether each token picks its k experts (true for every router here except
  /// `expert_choice`). Only these honour RouteContext::fixed_experts and fill
  /// Routing::choice.
  virtual bool token_choice() const { return true; }

  /// Routes `hidden` [T, D] (T >= 1 tokens of one micro-batch) with `k` experts per token
  /// for this call (1 <= k <= E; for `expert_choice` k is the average, C = c·k·T/E).
  virtual Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) = 0;

  /// Trainable parameters; see RouterParameter for how the MoE layer registers them.
  virtual std::vector<RouterParameter> Parameters() = 0;

  /// State that is checkpointed but not trained (the `aux_free` expert bias), by local name.
  /// The tensors are the router's own: writing into them changes the router.
  virtual NamedTensors State() { return {}; }

  /// Restores State() from `state` (local names, the same shapes), copying in place.
  /// Every state tensor must be present; names the router does not have are an error.
  absl::Status LoadState(const NamedTensors& state);

  /// Called once per optimizer step, after the step, with the step's expert loads: [E]
  /// assignments per expert summed over every micro-batch of the step AND over every rank
  /// that routed other tokens through this layer (the data-parallel replicas, expert-
  /// parallel ranks included). The caller does that all-reduce, so that every replica
  /// applies the identical update (invariant 3 of DESIGN.md).
  virtual void AfterOptimizerStep(const at::Tensor& global_expert_load) {}

 protected:
  /// TORCH_CHECKs the shared preconditions of Route().
  void CheckRouteArguments(const at::Tensor& hidden, int64_t k) const;

  RouterOptions options_;
};

/// Builds a router from validated options; registered under its `--moe_router` name.
using RouterFactory = std::function<absl::StatusOr<std::unique_ptr<Router>>(const RouterOptions&)>;
using RouterRegistry = Registry<RouterFactory>;

/// Checks the options every router shares (number of experts, k, coefficients, ...); the
/// messages name the flag. MakeRouter calls it; recipes may call it early.
absl::Status ValidateRouterOptions(const RouterOptions& options);

/// The router registered as `name`, built from `options`. InvalidArgument naming the flag
/// for bad options; NotFound listing the known routers for an unknown name.
absl::StatusOr<std::unique_ptr<Router>> MakeRouter(const std::string& name,
                                                   const RouterOptions& options);

/// "aux_free, cosine, ..." (for error messages).
std::string RouterNames();

/// One line per router, "  name  help", for --help.
std::string RouterHelp();

}  // namespace fulcrum::moe
