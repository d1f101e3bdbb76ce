// Pieces shared by the router implementations (moe/*_router*.cc) and the factories that
// moe/router.cc registers. Not part of the module's public surface.
//
// The factories live beside their routers but are registered in router.cc: a static
// library's object file is linked only when something references it, and MakeRouter in
// router.cc is what callers reference, so registrations placed anywhere else would be
// silently dropped.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe/router.h"

namespace fulcrum::moe::internal {

// ---- Factories (options already passed ValidateRouterOptions). -------------------------
absl::StatusOr<std::unique_ptr<Router>> NewTopKRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewSwitchRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewMixtralRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewNoisyTopKRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewExpertChoiceRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewSinkhornRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewAuxFreeRouter(const RouterOptions& options);
absl::StatusOr<std::unique_ptr<Router>> NewCosineRouter(const RouterOptions& options);

// ---- Parameters. -------------------------------------------------------------------------

/// A trainable fp32 leaf drawn from N(0, std²) keyed by (seed, init_scope + "." + local_name)
/// (NOTE [layout-independent randomness]).
at::Tensor NormalParameter(const RouterOptions& options, const std::string& local_name,
                           at::IntArrayRef shape, double std);

/// A trainable fp32 leaf holding `init`.
at::Tensor LeafParameter(const at::Tensor& init);

// ---- The linear router. ------------------------------------------------------------------

/// The shape most routers share: logits = x·Wᵀ from one trainable weight W [E, D]
/// ("router.weight", drawn like NormalParameter with init_std, weight-decayed). Subclasses
/// decide what the logits route.
class LinearRouter : public Router {
 public:
  explicit LinearRouter(const RouterOptions& options);

  std::vector<RouterParameter> Parameters() override;

 protected:
  /// x·Wᵀ [T, E], x = RouterInput(hidden) in W's dtype.
  at::Tensor Logits(const at::Tensor& hidden, const RouteContext& ctx) const;

 private:
  at::Tensor weight_;  // [E, D] W
};

// ---- Forward pieces. ---------------------------------------------------------------------

/// `hidden` in `dtype` (NOTE [router precision]), multiplied in training by keyed jitter
/// uniform in [1-eps, 1+eps] when options.input_jitter_eps > 0.
at::Tensor RouterInput(const at::Tensor& hidden, at::ScalarType dtype, const RouterOptions& options,
                       const RouteContext& ctx);

/// [rows, cols] standard normal noise keyed by (seed, site, layer, iteration, first_sample),
/// in the dtype and on the device of `like`. Drawn on the CPU, so it is the same on every
/// device (NOTE [layout-independent randomness]).
at::Tensor KeyedStandardNormal(const RouterOptions& options, const char* site,
                               const RouteContext& ctx, int64_t rows, int64_t cols,
                               const at::TensorOptions& like);

/// The experts [T, k] a token-choice router routes to: the top-k of `selection` [T, E]
/// (best first), except the rows that ctx.fixed_experts fixes (entries >= 0), which take
/// those. Writes the top-k itself, the router's own preference, to `*own`.
at::Tensor ChooseExperts(const at::Tensor& selection, int64_t k, const RouteContext& ctx,
                         at::Tensor* own);

/// The token-choice gate convention shared by `topk`, `switch`, `noisy_topk`, `aux_free`
/// and `cosine`: the chosen scores renormalised to sum 1 per token when k > 1 (GShard,
/// Mixtral, Megatron); for k = 1 the score itself, because a renormalised single gate is
/// the constant 1 and would cut the router off from the task gradient (Switch §2.1).
at::Tensor TokenChoiceGates(const at::Tensor& chosen_scores);

/// Flattens per-token choices `experts` [T, k] (best first) and `gates` [T, k] into a
/// Routing in GShard order (NOTE [assignment order]) and counts the expert loads; `own` is
/// the router's own top-k (Routing::choice; ChooseExperts' output).
Routing TokenChoiceRouting(const at::Tensor& experts, const at::Tensor& gates, at::Tensor probs,
                           int64_t num_experts, at::Tensor own);

/// How a softmax token-choice router turns its chosen probabilities into gates.
enum class SoftmaxGates {
  kTokenChoice,   // TokenChoiceGates: renormalised when k > 1, the probability when k = 1.
  kRenormalized,  // Renormalised to sum 1 for every k (Hugging Face's Mixtral).
};

/// The routing shared by the softmax token-choice routers (`topk`, `switch`, `mixtral`,
/// `cosine`), which differ only in their logits [T, E] and their losses: probs =
/// softmax(logits), the experts ChooseExperts picks from them, gated by `gates`. Adds no
/// auxiliary loss.
Routing SoftmaxTokenChoiceRouting(const at::Tensor& logits, int64_t k, const RouteContext& ctx,
                                  int64_t num_experts, SoftmaxGates gates);

/// Appends "z_loss" = coeff · ZLoss(logits) when coeff > 0.
void AddZLoss(const at::Tensor& logits, double coeff, Routing* routing);

/// Appends "load_balancing_loss" = coeff · LoadBalancingLoss(probs, load, k) when coeff > 0.
void AddLoadBalancingLoss(int64_t k, double coeff, Routing* routing);

}  // namespace fulcrum::moe::internal
