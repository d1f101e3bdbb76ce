// Helpers shared by the router implementations (declared in moe/internal/router_common.h).
#include "moe/internal/router_common.h"

#include "core/random.h"
#include "moe/aux_losses.h"

namespace fulcrum::moe::internal {

at::Tensor LeafParameter(const at::Tensor& init) {
  at::Tensor value = init.to(at::kFloat).contiguous().detach().clone();
  value.set_requires_grad(true);
  return value;
}

at::Tensor NormalParameter(const RouterOptions& options, const std::string& local_name,
                           at::IntArrayRef shape, double std) {
  return LeafParameter(NormalInit(options.seed, options.init_scope + "." + local_name, shape, std));
}

LinearRouter::LinearRouter(const RouterOptions& options)
    : Router(options),
      weight_(NormalParameter(options, "router.weight", {options.num_experts, options.hidden_size},
                              options.init_std)) {}

std::vector<RouterParameter> LinearRouter::Parameters() {
  return {{"router.weight", &weight_, /*weight_decay=*/true}};
}

at::Tensor LinearRouter::Logits(const at::Tensor& hidden, const RouteContext& ctx) const {
  return at::linear(RouterInput(hidden, weight_.scalar_type(), options_, ctx), weight_);
}

at::Tensor RouterInput(const at::Tensor& hidden, at::ScalarType dtype, const RouterOptions& options,
                       const RouteContext& ctx) {
  at::Tensor x = hidden.to(dtype);
  if (!ctx.training || options.input_jitter_eps == 0.0) return x;
  at::Generator gen = MakeGenerator(options.seed, "moe_router_jitter",
                                    {ctx.layer, ctx.iteration, ctx.first_sample});
  const double eps = options.input_jitter_eps;
  // Drawn on the CPU, whose keyed generator makes it the same on every device.
  at::Tensor jitter = at::empty(x.sizes(), at::TensorOptions().dtype(x.scalar_type()))
                          .uniform_(1.0 - eps, 1.0 + eps, gen);
  return x * jitter.to(x.device());
}

at::Tensor KeyedStandardNormal(const RouterOptions& options, const char* site,
                               const RouteContext& ctx, int64_t rows, int64_t cols,
                               const at::TensorOptions& like) {
  at::Generator gen =
      MakeGenerator(options.seed, site, {ctx.layer, ctx.iteration, ctx.first_sample});
  at::Tensor noise =
      at::empty({rows, cols}, at::TensorOptions().dtype(like.dtype())).normal_(0.0, 1.0, gen);
  return noise.to(like.device());
}

at::Tensor ChooseExperts(const at::Tensor& selection, int64_t k, const RouteContext& ctx,
                         at::Tensor* own) {
  *own = std::get<1>(at::topk(selection, k, /*dim=*/1));
  const at::Tensor& fixed = ctx.fixed_experts;
  if (!fixed.defined()) return *own;
  TORCH_CHECK(fixed.dim() == 2 && fixed.size(0) == selection.size(0) && fixed.size(1) == k,
              "fixed experts of shape ", fixed.sizes(), " for ", selection.size(0),
              " tokens and k=", k);
  at::Tensor chosen = fixed.to(own->options());
  TORCH_CHECK(chosen.numel() == 0 || chosen.max().item<int64_t>() < selection.size(1),
              "a fixed expert is out of range for ", selection.size(1), " experts");
  at::Tensor is_fixed = chosen.select(1, 0).ge(0).unsqueeze(1);  // [T, 1]
  return at::where(is_fixed, chosen, *own);
}

at::Tensor TokenChoiceGates(const at::Tensor& chosen_scores) {
  if (chosen_scores.size(1) == 1) return chosen_scores;
  return chosen_scores / chosen_scores.sum(1, /*keepdim=*/true);
}

Routing TokenChoiceRouting(const at::Tensor& experts, const at::Tensor& gates, at::Tensor probs,
                           int64_t num_experts, at::Tensor own) {
  TORCH_INTERNAL_ASSERT(experts.dim() == 2 && experts.sizes() == gates.sizes());
  const int64_t num_tokens = experts.size(0);
  const int64_t k = experts.size(1);
  Routing routing;
  // Column-major flattening of [T, k] is GShard's order: choice 0 of tokens 0..T-1, then
  // choice 1 of tokens 0..T-1, ...
  routing.token = at::arange(num_tokens, experts.options()).repeat({k});
  routing.expert = experts.t().reshape({-1}).contiguous();
  routing.gate = gates.t().reshape({-1});
  routing.probs = std::move(probs);
  routing.expert_load = at::bincount(routing.expert, /*weights=*/{}, num_experts);
  routing.choice = std::move(own);
  return routing;
}

Routing SoftmaxTokenChoiceRouting(const at::Tensor& logits, int64_t k, const RouteContext& ctx,
                                  int64_t num_experts, SoftmaxGates gates) {
  at::Tensor probs = at::softmax(logits, 1);
  at::Tensor own;
  at::Tensor experts = ChooseExperts(probs, k, ctx, &own);
  at::Tensor chosen = probs.gather(1, experts);
  at::Tensor gate_values = gates == SoftmaxGates::kRenormalized
                               ? chosen / chosen.sum(1, /*keepdim=*/true)
                               : TokenChoiceGates(chosen);
  return TokenChoiceRouting(experts, gate_values, probs, num_experts, own);
}

void AddZLoss(const at::Tensor& logits, double coeff, Routing* routing) {
  if (coeff > 0.0) routing->aux_losses.emplace_back("z_loss", ZLoss(logits) * coeff);
}

void AddLoadBalancingLoss(int64_t k, double coeff, Routing* routing) {
  if (coeff > 0.0) {
    routing->aux_losses.emplace_back(
        "load_balancing_loss", LoadBalancingLoss(routing->probs, routing->expert_load, k) * coeff);
  }
}

}  // namespace fulcrum::moe::internal
