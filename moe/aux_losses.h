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
