// The experts' projections of an MoE layer as one grouped linear: y_e = x_e·W_eᵀ + b_e for
// every local expert at once, with Linear's split backward (NOTE [B/W split] in
// core/linear.h).
//
// NOTE [grouped expert linear]
// The MoE layer used to run LinearForward once per expert: E GEMMs per projection, each
// with its deferred weight gradient. ExpertLinear is one autograd function over all the
// experts' rows (expert e's rows after expert e−1's, as moe/'s split_with_sizes takes
// them) that keeps what LinearForward guarantees:
//   - B pass: the rows' gradient (and each bias's, a cheap reduction, as Linear's bias
//     gets in B through autograd) now;
//   - W pass: every expert's dW_e = dy_eᵀ·x_e. Without an active WeightGradStore it is
//     returned to autograd; with one, it is one queued closure per ExpertLinear, labelled
//     with the tag current at the forward (NOTE [weight-gradient tags]) and holding the
//     unpadded dy and x, that accumulates into each expert's own .grad when the W action
//     runs — bit-identical to the fused backward (same operands, same GEMMs).
//   - mixed precision as Linear's: the masters are cast to the rows' dtype where used and
//     the weight gradient comes back in the master's dtype, accumulated in fp32 under bf16
//     (core/linear.h's LinearWeightGradient, kernels::GroupedExpertWeightGrad).
//   - an expert with no rows gets a zero weight (and bias) gradient, defined, as the
//     per-expert loop gave it (its GEMMs over 0 rows); the optimizer and the step's expert
//     loads see the same thing as before.
// Two ways to compute it, chosen by the rows' device (ExpertGemmPath::kAuto):
//   - batched (CUDA): the rows padded to the largest expert's count C ([E, C, D]), one
//     baddbmm for the forward, one bmm for dX and one for all the dW_e
//     (kernels::GroupedExpertGemm, NOTE [grouped expert GEMM]): 3 launches per projection
//     instead of 3E. MoE's padded capacity gives every expert C rows, so there is no
//     padding to add (the padding helpers return views); with --moe_per_expert_capacity the
//     padded copies are transient: E·C·D for x and E·C·F for y in the forward, the same for
//     dy and dX in B, and again for dy and x while the W closure runs — the store keeps
//     only the unpadded dy and x, as the loop's closures did.
//   - per expert (CPU): one GEMM per expert on exactly the loop's operands. LibTorch's CPU
//     bmm is a GEMM per batch entry anyway, so batching saves little there, while the
//     padded batch changes the GEMMs' row counts (and with them the blocking and the
//     summation order), and with several threads even the unpadded batch is not bit-exact
//     to the loop (NOTE [grouped expert GEMM]). The per-expert path keeps CPU runs
//     bit-identical to the loop: fulcrum_train's losses and gradient norms over 4 steps
//     of tiny_moe (fp32, bf16, --swiglu, --moe_per_expert_capacity, zbh1 over 2 stages)
//     are unchanged to the last bit, and the MoE bit-exact tests hold unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fulcrum::moe {

enum class ExpertGemmPath {
  kAuto,       // kBatched on CUDA, kPerExpert elsewhere.
  kPerExpert,  // one GEMM per expert (the per-expert loop's operands, bit for bit)
  kBatched,    // the padded batch: one batched GEMM per pass
};

/// Whether `path` batches for rows on `rows`' device (kAuto: on CUDA).
bool BatchesExperts(const at::Tensor& rows, ExpertGemmPath path = ExpertGemmPath::kAuto);

/// `rows` [Σ rows_per_expert, D] (expert e's rows contiguous, in expert order) times each
/// expert's weight [F, D] plus its bias [F] (`biases` empty for none) → [Σ rows, F], row
/// for row `cat(LinearForward(rows_e, weights[e], biases[e]))`, with Linear's deferred
/// weight gradients (NOTE [grouped expert linear]).
at::Tensor ExpertLinear(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                        const std::vector<at::Tensor>& weights,
                        const std::vector<at::Tensor>& biases,
                        ExpertGemmPath path = ExpertGemmPath::kAuto);

}  // namespace fulcrum::moe
