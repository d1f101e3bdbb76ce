#include "moe/aux_losses.h"

#include <cmath>

namespace fulcrum::moe {
namespace {

void CheckLogits(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2, what, " must be [T, E], got shape ", t.sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), what, " must be floating point, got ",
              t.scalar_type());
}

}  // namespace

at::Tensor LoadBalancingLoss(const at::Tensor& probs, const at::Tensor& expert_load, int64_t k) {
  CheckLogits(probs, "LoadBalancingLoss: probs");
  const int64_t num_tokens = probs.size(0);
  const int64_t num_experts = probs.size(1);
  TORCH_CHECK(expert_load.dim() == 1 && expert_load.size(0) == num_experts,
              "LoadBalancingLoss: expert_load must be [", num_experts, "], got ",
              expert_load.sizes());
  TORCH_CHECK(k >= 1, "LoadBalancingLoss: k must be >= 1, got ", k);
  TORCH_CHECK(num_tokens >= 1, "LoadBalancingLoss: no tokens");
  // f is a count: no gradient, as in the paper (only P is differentiable).
  at::Tensor fraction = expert_load.to(probs.scalar_type()) / static_cast<double>(num_tokens * k);
  at::Tensor mean_prob = probs.mean(0);
  return (fraction * mean_prob).sum() * static_cast<double>(num_experts);
}

at::Tensor MixtralLoadBalancingLoss(const at::Tensor& probs, const at::Tensor& expert_load) {
  CheckLogits(probs, "MixtralLoadBalancingLoss: probs");
  const int64_t num_tokens = probs.size(0);
  const int64_t num_experts = probs.size(1);
  TORCH_CHECK(expert_load.dim() == 1 && expert_load.size(0) == num_experts,
              "MixtralLoadBalancingLoss: expert_load must be [", num_experts, "], got ",
              expert_load.sizes());
  TORCH_CHECK(num_tokens >= 1, "MixtralLoadBalancingLoss: no tokens");
  // HF: tokens_per_expert = histc(top-k indices) / T (no gradient), router_prob_per_expert
  // = mean of the softmax (the gradient), loss = E · Σ of their product.
  at::Tensor tokens_per_expert =
      expert_load.to(probs.scalar_type()) / static_cast<double>(num_tokens);
  return (tokens_per_expert * probs.mean(0)).sum() * static_cast<double>(num_experts);
}

at::Tensor ZLoss(const at::Tensor& logits) {
  CheckLogits(logits, "ZLoss: logits");
  TORCH_CHECK(logits.size(0) >= 1, "ZLoss: no tokens");
  return at::logsumexp(logits, 1).square().mean();
}

at::Tensor CvSquared(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1, "CvSquared: expects a 1-D tensor, got shape ", x.sizes());
  if (x.size(0) <= 1) return at::zeros({}, x.options());
  at::Tensor mean = x.mean();
  return x.var(/*unbiased=*/false) / (mean.square() + 1e-10);
}

at::Tensor Importance(const at::Tensor& expert, const at::Tensor& gate, int64_t num_experts) {
  TORCH_CHECK(expert.dim() == 1 && gate.dim() == 1 && expert.size(0) == gate.size(0),
              "Importance: expert and gate must be [N], got ", expert.sizes(), " and ",
              gate.sizes());
  return at::zeros({num_experts}, gate.options()).index_add(0, expert, gate);
}

at::Tensor NoisyTopKLoad(const at::Tensor& clean_logits, const at::Tensor& noisy_logits,
                         const at::Tensor& noise_stddev, int64_t k) {
  CheckLogits(clean_logits, "NoisyTopKLoad: clean_logits");
  TORCH_CHECK(
      noisy_logits.sizes() == clean_logits.sizes() && noise_stddev.sizes() == clean_logits.sizes(),
      "NoisyTopKLoad: clean_logits, noisy_logits and noise_stddev must have one shape, "
      "got ",
      clean_logits.sizes(), ", ", noisy_logits.sizes(), ", ", noise_stddev.sizes());
  const int64_t num_tokens = clean_logits.size(0);
  const int64_t num_experts = clean_logits.size(1);
  TORCH_CHECK(k >= 1 && k <= num_experts, "NoisyTopKLoad: k must be in [1, ", num_experts,
              "], got ", k);
  if (k == num_experts) {
    return at::full({num_experts}, static_cast<double>(num_tokens), clean_logits.options());
  }
  // The k-th and (k+1)-th largest noisy logits of each token are the only two values
  // kth_excluding can take (see the header).
  at::Tensor top = std::get<0>(at::topk(noisy_logits, k + 1, /*dim=*/1));  // [T, k+1]
  at::Tensor threshold_if_in = top.narrow(1, k, 1);                        // (k+1)-th
  at::Tensor threshold_if_out = top.narrow(1, k - 1, 1);                   // k-th
  // Strictly above the (k+1)-th largest means among the top k (ties have measure zero
  // under continuous noise).
  at::Tensor is_in = noisy_logits > threshold_if_in;
  at::Tensor z = at::where(is_in, clean_logits - threshold_if_in, clean_logits - threshold_if_out) /
                 noise_stddev;
  at::Tensor prob = 0.5 * at::erfc(-z * M_SQRT1_2);  // Φ(z), the standard normal CDF
  return prob.sum(0);
}

}  // namespace fulcrum::moe
