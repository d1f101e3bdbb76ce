// The cosine router (`cosine`).
#include <cmath>

#include "moe/internal/router_common.h"

namespace fulcrum::moe::internal {
namespace {

// Cosine routing of X-MoE (Chi et al. 2022, "On the Representation Collapse of Sparse
// Mixture of Experts", §3: routing in a low-dimensional hypersphere) in the form of Tutel's
// CosineTopKGate (Hwang et al. 2023):
//
//   logits = cos(P·x, eᵢ) / τ,   P: [d_r, D] projection, eᵢ: [d_r] expert embeddings,
//   1/τ = exp(min(θ, log(1/τ_min))),   θ = log(1/τ) the learnable parameter,
//
// then softmax, top-k and the token-choice gate convention (TokenChoiceGates). Projecting
// to d_r << D and normalising both sides is X-MoE's cure for the router collapsing the
// token representations onto the expert embeddings; the learnable temperature lets the
// router sharpen as it trains, and the clamp (Tutel: τ >= 0.01) stops the logit scale from
// running away: once clamped, θ gets no gradient. Learning log(1/τ) rather than τ keeps τ
// positive. Balancing: the load-balancing loss (as Tutel and X-MoE train it) and the
// optional z-loss. probs = softmax(logits).
class CosineRouter : public Router {
 public:
  explicit CosineRouter(const RouterOptions& options)
      : Router(options),
        projection_(NormalParameter(options, "router.projection.weight",
                                    {options.cosine_projection_dim, options.hidden_size},
                                    options.init_std)),
        expert_embeddings_(NormalParameter(options, "router.expert_embeddings",
                                           {options.num_experts, options.cosine_projection_dim},
                                           options.init_std)),
        log_inv_temperature_(
            LeafParameter(at::full({}, -std::log(options.init_temperature), at::kFloat))) {}

  const char* name() const override { return "cosine"; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    at::Tensor x = RouterInput(hidden, projection_.scalar_type(), options_, ctx);
    at::Tensor logits =
        at::linear(Normalize(at::linear(x, projection_)), Normalize(expert_embeddings_)) *
        LogitScale();
    Routing routing =
        SoftmaxTokenChoiceRouting(logits, k, ctx, num_experts(), SoftmaxGates::kTokenChoice);
    AddLoadBalancingLoss(k, options_.aux_loss_coeff, &routing);
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }

  std::vector<RouterParameter> Parameters() override {
    return {{"router.projection.weight", &projection_, /*weight_decay=*/true},
            {"router.expert_embeddings", &expert_embeddings_, /*weight_decay=*/true},
            {"router.log_inv_temperature", &log_inv_temperature_, /*weight_decay=*/false}};
  }

 private:
  // 1/τ, differentiable while τ is above the clamp.
  at::Tensor LogitScale() const {
    return at::exp(at::clamp_max(log_inv_temperature_, -std::log(options_.cosine_min_temperature)));
  }

  // Rows scaled to unit L2 norm; the floor (F.normalize's 1e-12) keeps an all-zero row
  // finite instead of NaN.
  static at::Tensor Normalize(const at::Tensor& rows) {
    return rows / rows.norm(2, /*dim=*/{1}, /*keepdim=*/true).clamp_min(1e-12);
  }

  at::Tensor projection_;           // [d_r, D]
  at::Tensor expert_embeddings_;    // [E, d_r]
  at::Tensor log_inv_temperature_;  // [] θ = log(1/τ)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Router>> NewCosineRouter(const RouterOptions& options) {
  return std::make_unique<CosineRouter>(options);
}

}  // namespace fulcrum::moe::internal
