// The router registry: every built-in router is registered here, next to MakeRouter
// (moe/internal/router_common.h says why), plus the option checks and the Router base.
#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "moe/internal/router_common.h"

namespace fulcrum::moe {

FULCRUM_REGISTER(RouterFactory, topk,
                 "softmax over experts, top-k, gates renormalised for k > 1 (Megatron); "
                 "load-balancing loss",
                 internal::NewTopKRouter);
FULCRUM_REGISTER(RouterFactory, switch,
                 "Switch Transformer top-1 (Fedus et al. 2022); load-balancing loss; needs "
                 "--moe_router_topk=1",
                 internal::NewSwitchRouter);
FULCRUM_REGISTER(RouterFactory, mixtral,
                 "Hugging Face Mixtral: fp32 softmax over experts, top-k, gates always "
                 "renormalised; HF's load_balancing_loss_func (k x topk's)",
                 internal::NewMixtralRouter);
FULCRUM_REGISTER(RouterFactory, noisy_topk,
                 "noisy top-k gating (Shazeer et al. 2017); importance and load losses",
                 internal::NewNoisyTopKRouter);
FULCRUM_REGISTER(RouterFactory, expert_choice,
                 "expert choice (Zhou et al. 2022): each expert takes its top-C tokens",
                 internal::NewExpertChoiceRouter);
FULCRUM_REGISTER(RouterFactory, sinkhorn,
                 "balanced assignment by Sinkhorn iterations (S-BASE, Clark et al. 2022; "
                 "Megatron)",
                 internal::NewSinkhornRouter);
FULCRUM_REGISTER(RouterFactory, aux_free,
                 "auxiliary-loss-free balancing with a per-expert routing bias (DeepSeek-V3)",
                 internal::NewAuxFreeRouter);
FULCRUM_REGISTER(RouterFactory, cosine,
                 "cosine router with learnable temperature (X-MoE, Tutel); load-balancing loss",
                 internal::NewCosineRouter);

namespace {

bool IsFinite(double x) { return std::isfinite(x); }

absl::Status NonNegative(const char* flag, double value) {
  if (IsFinite(value) && value >= 0.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " must be a finite number >= 0, got ", value));
}

absl::Status Positive(const char* flag, double value) {
  if (IsFinite(value) && value > 0.0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " must be a finite number > 0, got ", value));
}

}  // namespace

absl::Status ValidateRouterOptions(const RouterOptions& o) {
  if (o.num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_experts must be >= 1, got ", o.num_experts));
  }
  if (o.topk < 1 || o.topk > o.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_router_topk must be in [1, ", o.num_experts, "] (--num_experts), got ", o.topk));
  }
  if (o.hidden_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hidden_size must be >= 1 for the MoE router, got ", o.hidden_size));
  }
  for (absl::Status s :
       {NonNegative("--moe_aux_loss_coeff", o.aux_loss_coeff),
        NonNegative("--moe_z_loss_coeff", o.z_loss_coeff),
        NonNegative("--moe_noise_epsilon", o.noise_epsilon),
        NonNegative("--moe_router_bias_update_rate", o.bias_update_rate),
        Positive("--moe_router_init_std", o.init_std),
        Positive("--moe_expert_choice_capacity_factor", o.expert_choice_capacity_factor),
        Positive("--moe_cosine_min_temperature", o.cosine_min_temperature)}) {
    if (!s.ok()) return s;
  }
  if (!(o.input_jitter_eps >= 0.0 && o.input_jitter_eps < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_input_jitter_eps must be in [0, 1), got ", o.input_jitter_eps));
  }
  if (o.sinkhorn_iterations < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_sinkhorn_iterations must be >= 1, got ", o.sinkhorn_iterations));
  }
  if (o.cosine_projection_dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_cosine_projection_dim must be >= 1, got ", o.cosine_projection_dim));
  }
  if (!(IsFinite(o.init_temperature) && o.init_temperature >= o.cosine_min_temperature)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_cosine_init_temperature must be finite and >= --moe_cosine_min_temperature (",
        o.cosine_min_temperature, "), got ", o.init_temperature));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Router>> MakeRouter(const std::string& name,
                                                   const RouterOptions& options) {
  const RouterRegistry::Entry* entry = RouterRegistry::Global().Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "--moe_router='", name, "' is not a known router; known routers: ", RouterNames()));
  }
  if (absl::Status s = ValidateRouterOptions(options); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<Router>> router = entry->value(options);
  if (router.ok()) {
    TORCH_INTERNAL_ASSERT(name == (*router)->name(), "router registered as ", name,
                          " calls itself ", (*router)->name());
  }
  return router;
}

std::string RouterNames() { return RouterRegistry::Global().Names(); }

std::string RouterHelp() {
  std::string out;
  for (const RouterRegistry::Entry* entry : RouterRegistry::Global().List()) {
    absl::StrAppend(&out, "  ", entry->name, "  ", entry->help, "\n");
  }
  return out;
}

// ---------------------------------------------------------------------------------------
void Router::CheckRouteArguments(const at::Tensor& hidden, int64_t k) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == options_.hidden_size, name(),
              " router: hidden must be [T, ", options_.hidden_size, "], got ", hidden.sizes());
  TORCH_CHECK(hidden.size(0) >= 1, name(), " router: no tokens to route");
  TORCH_CHECK(at::isFloatingType(hidden.scalar_type()), name(),
              " router: hidden must be floating point, got ", hidden.scalar_type());
  TORCH_CHECK(k >= 1 && k <= options_.num_experts, name(), " router: k must be in [1, ",
              options_.num_experts, "], got ", k);
}

absl::Status Router::LoadState(const NamedTensors& state) {
  NamedTensors own = State();
  std::set<std::string> known;
  for (const auto& [name, tensor] : own) known.insert(name);
  for (const auto& [name, tensor] : state) {
    if (known.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(this->name(), " router has no state tensor '", name, "'"));
    }
  }
  for (auto& [name, target] : own) {
    auto it = std::find_if(state.begin(), state.end(),
                           [&name = name](const auto& entry) { return entry.first == name; });
    if (it == state.end()) {
      return absl::NotFoundError(
          absl::StrCat(this->name(), " router state '", name, "' is missing"));
    }
    if (it->second.sizes() != target.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat(this->name(), " router state '", name,
                                                     "' has shape ", c10::str(it->second.sizes()),
                                                     ", expected ", c10::str(target.sizes())));
    }
  }
  // Only now that everything checked out: a failed load leaves the router untouched.
  at::NoGradGuard no_grad;
  for (auto& [name, target] : own) {
    for (const auto& [loaded_name, loaded] : state) {
      if (loaded_name == name) target.copy_(loaded);
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum::moe
