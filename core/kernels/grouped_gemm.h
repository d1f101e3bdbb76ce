// The experts' GEMMs of an MoE layer as one batched GEMM instead of one GEMM per expert.
//
// NOTE [grouped expert GEMM]
// With every expert's rows padded to one capacity C, the E products x_e·W_eᵀ (+ b_e) are
// one at::baddbmm over [E, C, D] × [E, D, F]: one kernel launch (cuBLAS strided-batched
// GEMM on CUDA) instead of E, which is what keeps small experts from being launch-bound.
// On the CPU with one compute thread LibTorch runs the batch as one GEMM per expert with
// the same operands, so the result is bit-identical to the per-expert loop
// (tests/core/kernels/grouped_gemm_test.cc, run with OMP_NUM_THREADS=1 as the suite is);
// with more threads it splits the batch's work differently and the bits can differ (seen
// with 2 threads on LibTorch 2.11), one reason moe/expert_linear.h keeps the per-expert
// GEMMs on the CPU.
// RaggedExpertGemm is the drop-in for moe/'s loop over experts with different row counts:
// it pads, runs the batched GEMM and unpads, all differentiable, so gradients reach each
// expert's own weight and bias tensors. moe/expert_linear.h runs these GEMMs inside one
// autograd function that keeps Linear's deferred weight gradients (NOTE [grouped expert
// linear]); that is what the MoE layer calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fulcrum::kernels {

/// x [E, C, D], weight [E, F, D], bias [E, F] (may be undefined) → [E, C, F] with
/// out[e] = x[e]·weight[e]ᵀ + bias[e]. Differentiable.
at::Tensor GroupedExpertGemm(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias);

/// Expert e's rows of `rows` [Σ rows_per_expert, D] (expert by expert, as RaggedExpertGemm
/// takes them) in slot e of [E, C, D], C = the largest count, zero rows after them. Without
/// copying when every expert has C rows (a view: moe/'s padded capacity has no padding to
/// add). Differentiable.
at::Tensor PadByExpert(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert);

/// PadByExpert's inverse: `padded` [E, C, F] → each expert's first rows_per_expert[e] rows,
/// [Σ rows_per_expert, F]. Differentiable.
at::Tensor UnpadByExpert(const at::Tensor& padded, const std::vector<int64_t>& rows_per_expert);

/// Every expert's weight gradient grad_output[e]ᵀ·input[e] (grad_output [E, C, F], input
/// [E, C, D]) → [E, F, D] in one batched GEMM: the deferred W pass of a grouped expert
/// GEMM. Zero padding rows add nothing. With `fp32_accumulate` the result is fp32 whatever
/// the operands' dtype (bf16 operands accumulating in fp32, as LinearWeightGrad's).
at::Tensor GroupedExpertWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                                   bool fp32_accumulate);

/// Rows grouped by expert (`rows` [Σ rows_per_expert, D], expert e's rows contiguous and in
/// expert order, as moe/'s split_with_sizes takes them) times each expert's own weight
/// [F, D] and bias [F] (`biases` empty for none) → [Σ rows, F], row for row what the loop
/// `cat(LinearForward(rows_e, weights[e], biases[e]))` returns up to fp32 summation order
/// (padding changes the GEMM's row count, and so its blocking). Differentiable; an expert
/// with no rows gets a zero weight gradient. Its weight gradients are not deferred under
/// the B/W split (NOTE [B/W split]): it does not go through LinearForward.
at::Tensor RaggedExpertGemm(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                            const std::vector<at::Tensor>& weights,
                            const std::vector<at::Tensor>& biases);

}  // namespace fulcrum::kernels
