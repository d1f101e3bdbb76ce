// The experts' GEMMs of an MoE layer as one batched GEMM instead of one GEMM per expert.
//
// NOTE [grouped expert GEMM]
// With every expert's rows padded to one capacity C, the E products x_e·W_eᵀ (+ b_e) are
// one at::baddbmm over [E, C, D] × [E, D, F]: one kernel launch (cuBLAS strided-batched
// GEMM on CUDA) instead of E, which is what keeps small experts from being launch-bound.
// On the CPU LibTorch runs the batch as one GEMM per expert with the same operands, so the
// result is bit-identical to the per-expert loop (tests/core/kernels/grouped_gemm_test.cc).
// RaggedExpertGemm is the drop-in for moe/'s loop over experts with different row counts:
// it pads, runs the batched GEMM and unpads, all differentiable, so gradients reach each
// expert's own weight and bias tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fulcrum::kernels {

/// x [E, C, D], weight [E, F, D], bias [E, F] (may be undefined) → [E, C, F] with
/// out[e] = x[e]·weight[e]ᵀ + bias[e]. Differentiable.
at::Tensor GroupedExpertGemm(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias);

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
