// Token-choice routers over a softmax of linear logits: `topk`, `switch`, `mixtral`,
// `noisy_topk`.
#include <tuple>

#include "absl/strings/str_cat.h"
#include "moe/aux_losses.h"
#include "moe/internal/router_common.h"

namespace fulcrum::moe::internal {
namespace {

// Softmax top-k (`topk`), Switch top-1 (`switch`) and Hugging Face's Mixtral (`mixtral`).
//
//   logits = x·Wᵀ,  probs = softmax(logits),  experts = top-k of probs,
//   gates  = the top-k probs renormalised to sum 1 when k > 1 (Megatron's default, Mixtral,
//            GShard §2.2 for k = 2); for k = 1 the probability itself (Switch Transformer
//            §2.1: p_i(x) scales the expert output, which is what makes the router
//            differentiable — renormalised it would be the constant 1).
//
// Balancing: the Switch Transformer loss (Fedus et al. 2022, §2.2) α·E·Σᵢ fᵢ·Pᵢ, where for
// k > 1 fᵢ counts all k choices (Megatron's aux_loss), and the optional z-loss.
// `switch` is the k = 1 case under its paper's name; it refuses k != 1.
//
// `mixtral` is Hugging Face transformers' MixtralSparseMoeBlock (MixtralTopKRouter, v4 and
// v5 alike): softmax over all E, top-k, and the k weights renormalised to sum 1 for every
// k — for k > 1 these are exactly `topk`'s gates, for k = 1 the gate is 1 where `topk` keeps
// p. HF computes the logits in the model's dtype and the softmax in fp32; here both are in
// the router's fp32 (NOTE [router precision]), so the two agree exactly for fp32 models and
// differ by the logits' rounding for bf16 ones. Its balancing loss is HF's load_balancing_loss_func for one layer,
// k times `topk`'s (MixtralLoadBalancingLoss; NOTE [Mixtral aux loss across layers] for
// models with several MoE layers), so --moe_aux_loss_coeff = router_aux_loss_coef gives
// HF's `router_aux_loss_coef * aux_loss`. HF adds that term only with output_router_logits
// (default false); its router_jitter_noise also jitters the experts' input, which
// --moe_input_jitter_eps does not (Mixtral checkpoints set 0).
enum class TopKFlavor { kMegatron, kSwitch, kMixtral };

class TopKRouter : public LinearRouter {
 public:
  TopKRouter(const RouterOptions& options, const char* name, TopKFlavor flavor)
      : LinearRouter(options), name_(name), flavor_(flavor) {}

  const char* name() const override { return name_; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    TORCH_CHECK(flavor_ != TopKFlavor::kSwitch || k == 1, name_,
                " router routes each token to one expert, got k=", k);
    at::Tensor logits = Logits(hidden, ctx);  // [T, E]
    Routing routing = SoftmaxTokenChoiceRouting(
        logits, k, ctx, num_experts(),
        flavor_ == TopKFlavor::kMixtral ? SoftmaxGates::kRenormalized : SoftmaxGates::kTokenChoice);
    if (flavor_ == TopKFlavor::kMixtral) {
      if (options_.aux_loss_coeff > 0.0) {
        routing.aux_losses.emplace_back(
            "load_balancing_loss",
            MixtralLoadBalancingLoss(routing.probs, routing.expert_load) * options_.aux_loss_coeff);
      }
    } else {
      AddLoadBalancingLoss(k, options_.aux_loss_coeff, &routing);
    }
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }


 private:
  const char* name_;
  TopKFlavor flavor_;
};

// Noisy top-k gating (`noisy_topk`), Shazeer et al. 2017, "Outrageously Large Neural
// Networks", §2.1 (eq. 3–5), §4 (eq. 6–7) and Appendix A (eq. 8–11):
//
//   H(x)ᵢ = (x·W_g)ᵢ + StandardNormal()·Softplus((x·W_noise)ᵢ)   (noise in training only)
//   G(x)  = Softmax(KeepTopK(H(x), k))
//
// so the gates are softmax over the k kept logits: for k = 1 the gate is 1 and the router
// learns through the balancing losses alone (the paper's reason for k > 1). The noise is
// drawn from (seed, "moe_router_noise", layer, iteration, first_sample), and its scale is
// Softplus(x·W_noise) + noise_epsilon as in the reference implementation (tensor2tensor),
// so it never divides by 0 in the load estimator.
//
// Losses, both scaled by aux_loss_coeff (the reference implementation's single loss_coef):
//   importance_loss = CV(Importance(X))², Importance(X) = Σₓ G(x)              (§4)
//   load_loss       = CV(Load(X))², Load the smooth estimator of NoisyTopKLoad (App. A)
// Outside training (no noise) the load is the plain assignment count, as in the reference.
//
// probs = softmax(H(x)) over all experts; the gates equal its top k renormalised.
// W_g and W_noise start at zero as in Appendix A ("no signal and some random noise"), so
// the first steps route uniformly at random; the z-loss, if on, applies to H(x), the
// logits the softmax sees.
class NoisyTopKRouter : public Router {
 public:
  explicit NoisyTopKRouter(const RouterOptions& options)
      : Router(options),
        gate_weight_(LeafParameter(at::zeros({options.num_experts, options.hidden_size}))),
        noise_weight_(LeafParameter(at::zeros({options.num_experts, options.hidden_size}))) {}

  const char* name() const override { return "noisy_topk"; }

  Routing Route(const at::Tensor& hidden, int64_t k, const RouteContext& ctx) override {
    CheckRouteArguments(hidden, k);
    at::Tensor x = RouterInput(hidden, gate_weight_.scalar_type(), options_, ctx);
    const int64_t num_tokens = x.size(0);
    at::Tensor clean = at::linear(x, gate_weight_);  // [T, E] x·W_g
    at::Tensor logits = clean;                       // H(x)
    at::Tensor noise_stddev;
    if (ctx.training) {
      noise_stddev = at::softplus(at::linear(x, noise_weight_)) + options_.noise_epsilon;
      logits = clean + KeyedStandardNormal(options_, "moe_router_noise", ctx, num_tokens,
                                           num_experts(), clean.options()) *
                           noise_stddev;
    }
    at::Tensor own;
    at::Tensor experts = ChooseExperts(logits, k, ctx, &own);
    Routing routing = TokenChoiceRouting(experts, at::softmax(logits.gather(1, experts), 1),
                                         at::softmax(logits, 1), num_experts(), own);
    if (options_.aux_loss_coeff > 0.0) {
      at::Tensor importance = Importance(routing.expert, routing.gate, num_experts());
      at::Tensor load = ctx.training ? NoisyTopKLoad(clean, logits, noise_stddev, k)
                                     : routing.expert_load.to(clean.scalar_type());
      routing.aux_losses.emplace_back("importance_loss",
                                      CvSquared(importance) * options_.aux_loss_coeff);
      routing.aux_losses.emplace_back("load_loss", CvSquared(load) * options_.aux_loss_coeff);
    }
    AddZLoss(logits, options_.z_loss_coeff, &routing);
    return routing;
  }

  std::vector<RouterParameter> Parameters() override {
    return {{"router.weight", &gate_weight_, /*weight_decay=*/true},
            {"router.noise_weight", &noise_weight_, /*weight_decay=*/true}};
  }

 private:
  at::Tensor gate_weight_;   // [E, D] W_gᵀ
  at::Tensor noise_weight_;  // [E, D] W_noiseᵀ
};

}  // namespace

absl::StatusOr<std::unique_ptr<Router>> NewTopKRouter(const RouterOptions& options) {
  return std::make_unique<TopKRouter>(options, "topk", TopKFlavor::kMegatron);
}

absl::StatusOr<std::unique_ptr<Router>> NewMixtralRouter(const RouterOptions& options) {
  return std::make_unique<TopKRouter>(options, "mixtral", TopKFlavor::kMixtral);
}

absl::StatusOr<std::unique_ptr<Router>> NewSwitchRouter(const RouterOptions& options) {
  if (options.topk != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_router=switch routes each token to one expert: --moe_router_topk must be 1, "
        "got ",
        options.topk));
  }
  return std::make_unique<TopKRouter>(options, "switch", TopKFlavor::kSwitch);
}

absl::StatusOr<std::unique_ptr<Router>> NewNoisyTopKRouter(const RouterOptions& options) {
  return std::make_unique<NoisyTopKRouter>(options);
}

}  // namespace fulcrum::moe::internal
