// The three GEMMs of a linear layer followed by GeLU, each with its elementwise neighbour
// fused in where the device can do it:
//   forward        y = gelu(x·Wᵀ + b), keeping the pre-activation for the backward;
//   input gradient dpre = (dy·W₂) ⊙ gelu'(pre) (the next layer's input-gradient GEMM fused
//                  with this layer's GeLU backward), optionally with db = Σ dpre;
//   weight grad    dW = dyᵀ·x and db = Σ dy in one GEMM — the deferred W pass of the B/W
//                  split (NOTE [B/W split] in core/linear.h).
//
// NOTE [fused epilogues]
// On CUDA the GEMMs are cuBLASLt calls with the epilogues GELU_AUX_BIAS, DGELU(_BGRAD) and
// BGRADB, chosen by one table (core/kernels/internal/cublaslt_gemm.h). LibTorch has no
// entry point for them: at::_addmm_activation fuses bias+GeLU but returns no
// pre-activation (so the backward would recompute the GEMM), and at::cuda::blas::
// gemm_and_bias has no aux output and no gradient epilogues. cuBLASLt's GeLU is the tanh
// approximation, so only `tanh_approx` GeLU is fused; the exact GeLU runs as the GEMM then
// at::gelu on every device. Anywhere the fused call cannot run (CPU, a dtype or alignment
// cuBLASLt refuses, no algorithm) the plain LibTorch computation below runs instead; it is
// the reference the CUDA tests compare with.
//
// These are tensor functions, not autograd ops: call them from an autograd Function's
// forward/backward (they run under whatever grad mode the caller has).
#pragma once

#include <ATen/core/Tensor.h>

namespace fulcrum::kernels {

struct LinearGeluOutput {
  at::Tensor output;          ///< gelu(pre_activation), [..., out]
  at::Tensor pre_activation;  ///< x·Wᵀ + b, [..., out] (what the GeLU backward needs)
};

/// y = gelu(x·Wᵀ + b) for x [..., in], W [out, in], b [out] (may be undefined). GeLU is the
/// tanh approximation when `tanh_approx` (Megatron's --openai_gelu), the exact erf form
/// otherwise. CPU: at::matmul, + b, at::gelu — the ops the model runs today.
LinearGeluOutput LinearBiasGeluForward(const at::Tensor& input, const at::Tensor& weight,
                                       const at::Tensor& bias, bool tanh_approx);

struct GeluInputGrad {
  at::Tensor grad_pre_activation;  ///< (dy·W) ⊙ gelu'(pre), shaped like `pre_activation`
  at::Tensor grad_bias;            ///< Σ over rows of grad_pre_activation; undefined unless asked
};

/// The input-gradient GEMM of the layer after a GeLU, fused with the GeLU's backward:
/// for grad_output [..., out] of y = h·Wᵀ (W [out, in], h = gelu(pre_activation), pre
/// [..., in]) returns d pre = (grad_output·W) ⊙ gelu'(pre), and with `want_bias_grad` the
/// bias gradient of the layer that produced `pre` (Σ over all leading dimensions).
GeluInputGrad LinearGeluInputGrad(const at::Tensor& grad_output, const at::Tensor& weight,
                                  const at::Tensor& pre_activation, bool tanh_approx,
                                  bool want_bias_grad);

struct WeightGrad {
  at::Tensor grad_weight;  ///< [out, in]
  at::Tensor grad_bias;    ///< [out]; undefined unless asked
};

/// The deferred W pass: dW = grad_outputᵀ·x over all leading dimensions (grad_output
/// [..., out], input [..., in]) and, with `want_bias_grad`, db = Σ grad_output, in one GEMM
/// on CUDA (BGRADB). With `fp32_accumulate` the GEMM accumulates in and returns fp32
/// whatever the inputs' dtype (bf16 operands, fp32 result: what mixed precision's
/// main_grad needs); otherwise the result has the inputs' dtype. For fp32 inputs the CPU
/// result is bit-identical to core/linear.cc's weight-gradient GEMM.
WeightGrad LinearWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                            bool want_bias_grad, bool fp32_accumulate);

/// main_grad += grad_outputᵀ·x (grad_output [..., out], input [..., in], main_grad
/// [out, in]): the deferred W pass accumulating straight into mixed precision's fp32
/// main_grad (on CUDA the GEMM's C matrix, beta = 1: no [out, in] temporary). main_grad
/// must be fp32 or the operands' dtype. CPU: main_grad.add_(the product in main_grad's
/// dtype), what core/linear.cc's AccumulateInto does with it.
void AccumulateWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                          at::Tensor& main_grad);

}  // namespace fulcrum::kernels
