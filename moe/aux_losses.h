// Auxiliary losses of MoE routers, unscaled (routers multiply by their coefficient). All
// are differentiable where their paper needs a gradient; all are functions of tensors only,
// so they can be tested against closed forms and finite differences on their own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fulcrum::moe {

/// Switch Transformer load-balancing loss (Fedus et al. 2022, §2.2, eq. 4–6), generalised
/// to k choices as Megatron does: E · Σᵢ fᵢ·Pᵢ with fᵢ = expert_load[i] / (T·k), the
/// fraction of all assignments that went to expert i (not differentiable), and Pᵢ the mean
/// over tokens of probs[:, i] (carries the gradient). 1 at perfect balance.
/// probs [T, E] float; expert_load [E] integer; k >= 1.
at::Tensor LoadBalancingLoss(const at::Tensor& probs, const at::Tensor& expert_load, int64_t k);

/// Hugging Face transformers' `load_balancing_loss_func` (modeling_mixtral, Mixtral's
/// `aux_loss`) for one MoE layer: E · Σᵢ (expert_load[i] / T) · Pᵢ, Pᵢ the mean over tokens
/// of probs[:, i]. Its fᵢ divides the top-k assignment count by T, not T·k, so it is exactly
/// k · LoadBalancingLoss (1 at perfect balance for k = 1, k for k > 1).
///
/// NOTE [Mixtral aux loss across layers]
/// HF computes one loss for the whole model: it concatenates every layer's router logits
/// (sums the counts and probabilities over layers, divides by L·T) and takes E·Σᵢ f̄ᵢ·P̄ᵢ of
/// those cross-layer means. Fulcrum's MoE layers each add their own loss (NOTE [MoE auxiliary
/// losses] in moe/moe_layer.h), i.e. Σ_l E·Σᵢ f_l,i·P_l,i. For a model with one MoE layer the
/// two are the same number; with L > 1 layers ours is not HF's: HF's is a product of means
/// over layers (≈ 1/L of our sum when the layers' loads agree, and different from it — by
/// the layers' covariance of f and P — when they do not). Compare HF and Fulcrum with one
/// MoE layer, or with --moe_aux_loss_coeff = 0.
/// probs [T, E] float; expert_load [E] integer (the top-k counts).
at::Tensor MixtralLoadBalancingLoss(const at::Tensor& probs, const at::Tensor& expert_load);

/// ST-MoE router z-loss (Zoph et al. 2022, §3.1, eq. 5): mean over tokens of
/// logsumexp(logits[t, :])². Penalises large logits, which make the router's softmax
/// round-off sensitive. logits [T, E] float.
at::Tensor ZLoss(const at::Tensor& logits);

/// Squared coefficient of variation Var(x) / (Mean(x)² + 1e-10) of a 1-D tensor, with the
/// population variance as in Shazeer's reference implementation (tensor2tensor
/// `cv_squared`); 0 for a single element.
at::Tensor CvSquared(const at::Tensor& x);

/// Importance(X) of Shazeer et al. 2017, §4, eq. 6: Σ over tokens of the gate values each
/// expert received, [E]. `expert` [N] int64, `gate` [N] float (a Routing's columns).
at::Tensor Importance(const at::Tensor& expert, const at::Tensor& gate, int64_t num_experts);

/// Smooth Load(X) of Shazeer et al. 2017, Appendix A, eq. 8–10: [E] with
///   Load(X)ᵢ = Σₓ P(x, i),
///   P(x, i) = Φ(((x·W_g)ᵢ − kth_excluding(H(x), k, i)) / Softplus((x·W_noise)ᵢ)),
/// the probability that expert i stays in the top k if only its own noise were redrawn.
/// kth_excluding(H, k, i) is the k-th largest entry of H without entry i: the (k+1)-th
/// largest of H when i is in H's top k, the k-th largest otherwise. Differentiable w.r.t.
/// all three inputs (the thresholds included, as in the reference implementation).
/// clean_logits = x·W_g, noisy_logits = H(x), noise_stddev = Softplus(x·W_noise) (+ ε):
/// all [T, E]. For k >= E every expert is always chosen: the load is T, constant.
at::Tensor NoisyTopKLoad(const at::Tensor& clean_logits, const at::Tensor& noisy_logits,
                         const at::Tensor& noise_stddev, int64_t k);

}  // namespace fulcrum::moe
