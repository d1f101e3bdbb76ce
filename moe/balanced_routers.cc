// Routers that balance the experts by construction rather than (only) by a loss:
// `expert_choice`, `sinkhorn`, `aux_free`.
#include <tuple>

#include "moe/capacity.h"
#include "moe/internal/router_common.h"

namespace fulcrum::moe::internal {
namespace {

// Expert choice (`expert_choice`), Zhou et al. 2022, "Mixture-of-Experts with Expert Choice
// Routing", §3.2, eq. 1:
//
//   S = Softmax(X·W_g) over experts,  G, I = TopK(Sᵀ, C) per expert,
//   C = c·k·T/E (here rounded up and at most T; c = expert_choice_capacity_factor),
//
// so every expert processes exactly C tokens (perfect balance, no balancing loss) and a
// token may get any number of experts, zero included. The gates are the scores S. The
// list is expert-major, each expert's tokens by descending score (NOTE [assignment
// order]); with capacity >= C, AssignSlots drops nothing. probs = S. The same rule applies
// outside training, so a token's experts depend on the other tokens of its batch (the
// paper's known limitation for autoregressive inference).
class ExpertChoiceRouter : public LinearRouter {
 public:
  explicit ExpertChoiceRouter(const RouterOptions& options) : LinearRouter(options) {}

  const char* name() const override { return "expert_choice"; }
  bool token_choice() const override { return false; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    TORCH_CHECK(!ctx.fixed_experts.defined(),
                "expert_choice routing has no per-token choice to fix (cached assignments)");
    at::Tensor logits = Logits(hidden, ctx);
    const int64_t num_tokens = logits.size(0);
    const int64_t num_experts = this->num_experts();
    const int64_t capacity =
        std::min(num_tokens,
                 CeilCapacity(options_.expert_choice_capacity_factor, k, num_tokens, num_experts));
    at::Tensor probs = at::softmax(logits, 1);
    auto [gates, tokens] = at::topk(probs.t(), capacity, /*dim=*/1);  // [E, C]
    Routing routing;
    routing.token = tokens.reshape({-1}).contiguous();
    routing.expert = at::arange(num_experts, tokens.options()).repeat_interleave(capacity);
    routing.gate = gates.reshape({-1});
    routing.probs = probs;
    routing.expert_load = at::full({num_experts}, capacity, tokens.options());
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }
};

// Sinkhorn scaling of exp(logits) towards the transport polytope where every token has mass
// 1/T and every expert 1/E, as in Megatron's `sinkhorn` (tolerance 1e-4 on the mean change
// of the expert scaling, ε = 1e-8 in the divisions). Returns d1·exp(logits)·d0. Each row is
// first shifted by its maximum: a per-row factor is absorbed by d0, so the result is the
// same, and exp cannot overflow.
at::Tensor Sinkhorn(const at::Tensor& logits, int max_iterations) {
  constexpr double kTolerance = 1e-4;
  constexpr double kEps = 1e-8;
  at::NoGradGuard no_grad;
  const int64_t num_tokens = logits.size(0);
  const int64_t num_experts = logits.size(1);
  at::Tensor cost = at::exp(logits - std::get<0>(logits.max(1, /*keepdim=*/true)));
  at::Tensor d0 = at::ones({num_tokens}, cost.options());
  at::Tensor d1 = at::ones({num_experts}, cost.options());
  for (int i = 0; i < max_iterations; ++i) {
    d0 = 1.0 / (num_tokens * ((cost * d1).sum(1) + kEps));
    at::Tensor next_d1 = 1.0 / (num_experts * ((cost * d0.unsqueeze(1)).sum(0) + kEps));
    const double change = (next_d1 - d1).abs().mean().item<double>();
    d1 = next_d1;
    if (change < kTolerance) break;
  }
  return d1 * cost * d0.unsqueeze(1);
}

// Balanced assignment by Sinkhorn (`sinkhorn`): S-BASE of Clark et al. 2022, "Unified
// Scaling Laws for Routed Language Models" (BASE layers' balanced linear assignment,
// approximated by Sinkhorn iterations), as implemented by Megatron's sinkhorn router.
//
// In training the experts are the top k of the Sinkhorn-balanced matrix, which only
// decides the choice (no gradient); the gates come from the original logits, Megatron's
// convention: sigmoid(logit) for k = 1 (as S-BASE), the softmax probability for k > 1,
// neither renormalised. Outside training the choice is plain top-k of those gate values,
// so inference does not depend on which other tokens share the batch.
// probs = softmax(logits). No balancing loss (balance comes from the assignment); z-loss
// optional.
class SinkhornRouter : public LinearRouter {
 public:
  explicit SinkhornRouter(const RouterOptions& options) : LinearRouter(options) {}

  const char* name() const override { return "sinkhorn"; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    at::Tensor logits = Logits(hidden, ctx);
    at::Tensor probs = at::softmax(logits, 1);
    at::Tensor scores = k == 1 ? at::sigmoid(logits) : probs;
    // Training chooses on the Sinkhorn-balanced assignment, evaluation on the scores.
    at::Tensor own;
    at::Tensor experts = ChooseExperts(
        ctx.training ? Sinkhorn(logits.detach(), options_.sinkhorn_iterations) : scores, k, ctx,
        &own);
    Routing routing =
        TokenChoiceRouting(experts, scores.gather(1, experts), probs, num_experts(), own);
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }
};

// Auxiliary-loss-free balancing (`aux_free`): DeepSeek-V3 technical report §2.1.2 (eq. 16)
// and Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
// (Algorithm 1):
//
//   s = sigmoid(x·Wᵀ)                           affinities (DeepSeek-V3 eq. 15)
//   experts = top-k of s + b                    b only decides the choice
//   gates   = the chosen s, renormalised to sum 1 for k > 1 (eq. 13; k = 1: s itself,
//             see TokenChoiceGates)
//   after each optimizer step: bᵢ += γ·sign(mean load − loadᵢ)
//
// b is not a parameter: it never gets a gradient (it enters only through topk indices)
// and is checkpointed as state "router.expert_bias". The loads must be the step's global
// loads (see Router::AfterOptimizerStep). probs = s / Σ s per token, the normalised
// affinities of DeepSeek-V3's sequence-wise balance loss. No balancing loss; z-loss optional.
class AuxFreeRouter : public LinearRouter {
 public:
  explicit AuxFreeRouter(const RouterOptions& options)
      : LinearRouter(options),
        expert_bias_(at::zeros({options.num_experts}, at::kFloat)) {}

  const char* name() const override { return "aux_free"; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    at::Tensor logits = Logits(hidden, ctx);
    at::Tensor scores = at::sigmoid(logits);
    at::Tensor biased = scores.detach() + expert_bias_.to(scores.options());
    at::Tensor own;
    at::Tensor experts = ChooseExperts(biased, k, ctx, &own);
    Routing routing = TokenChoiceRouting(experts, TokenChoiceGates(scores.gather(1, experts)),
                                         scores / scores.sum(1, /*keepdim=*/true), num_experts(),
                                         own);
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }

  NamedTensors State() override { return {{"router.expert_bias", expert_bias_}}; }

  void AfterOptimizerStep(const at::Tensor& global_expert_load) override {
    TORCH_CHECK(global_expert_load.dim() == 1 && global_expert_load.size(0) == num_experts(),
                "aux_free router: the expert load must be [", num_experts(), "], got ",
                global_expert_load.sizes());
    at::NoGradGuard no_grad;
    at::Tensor load = global_expert_load.to(at::kDouble);
    at::Tensor step = at::sign(load.mean() - load) * options_.bias_update_rate;
    expert_bias_.add_(step.to(expert_bias_.options()));
  }

 private:
  at::Tensor expert_bias_;  // [E] b, fp32, no grad
};

}  // namespace

absl::StatusOr<std::unique_ptr<Router>> NewExpertChoiceRouter(const RouterOptions& options) {
  return std::make_unique<ExpertChoiceRouter>(options);
}

absl::StatusOr<std::unique_ptr<Router>> NewSinkhornRouter(const RouterOptions& options) {
  return std::make_unique<SinkhornRouter>(options);
}

absl::StatusOr<std::unique_ptr<Router>> NewAuxFreeRouter(const RouterOptions& options) {
  return std::make_unique<AuxFreeRouter>(options);
}

}  // namespace fulcrum::moe::internal
