// The attention core: softmax(q·kᵀ·scale, causal) · v over [batch, heads, seq, head_dim],
// the part of a transformer layer's attention between the projections, and the masked
// softmax it and the Mixture-of-Depths path (TransformerLayer::ResidualAt) share.
//
// NOTE [attention core contract]
// The dense layer's attention (TransformerLayer::SoftmaxAttention) is this function:
//  - q [b, heads, s, d]; k, v [b, groups, s, d] with groups dividing heads: each key/value
//    head serves heads/groups consecutive query heads (the layer's ExpandGroups order, NOTE
//    [QKV rows]). The layer hands k, v over grouped, as its QKV projection made them.
//  - Without dropout: at::scaled_dot_product_attention with is_causal. LibTorch 2.11 runs it,
//    on the CPU as on CUDA, as a flash-attention kernel that walks the keys in blocks with
//    an online softmax, skips the blocks above the diagonal and never forms the s×s score
//    matrix (its backward recomputes the scores block by block). On CUDA grouped k/v go to
//    SDPA as they are (enable_gqa), with no expanded copy; on the CPU they are expanded
//    first (repeat_interleave), the call the layer made before it used this core, so CPU
//    results are bit-identical to it. tests/core/causal_attention_test.cc holds the layer
//    to the plain masked softmax at 1e-12 in fp64.
//  - With dropout: SDPA's own dropout draws from the device generator, so a head would drop
//    different entries on different tensor-parallel ranks. The caller passes `drop_head`,
//    which returns the dropped probabilities of one head ([b, s, s], its mask from
//    Fulcrum's generators, keyed by the global head); the core then forms the whole
//    probability matrix (MaskedSoftmax below), so a head drops the same entries on
//    whichever rank holds it.
//  MoD's ResidualAt keeps its own chunked loop (NOTE [causal query chunks] in
//  core/transformer_layer.cc): its queries are a subset of the positions. It shares
//  MaskedSoftmax.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace fulcrum::kernels {

struct AttentionOptions {
  /// Mask the keys after each query. Default: true (the GPT layer's).
  bool causal = true;
  /// Probability of dropping an attention weight; 0 disables dropout. Default: 0.
  double dropout_p = 0.0;
  /// Multiplies q·kᵀ; 0 means 1/√head_dim. Default: 0.
  double scale = 0.0;
  /// Required when dropout_p > 0: (probabilities of local head i [b, s, s], i) → the
  /// dropped and rescaled probabilities.
  std::function<at::Tensor(const at::Tensor&, int64_t)> drop_head;
};

/// softmax(q·kᵀ·scale (+ causal mask)) · v → [b, heads, s, d]. Differentiable. NOTE
/// [attention core contract].
at::Tensor AttentionCore(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const AttentionOptions& options = {});

/// Softmax over the last dimension of `scores` with the entries where `mask` (bool,
/// broadcastable to scores) is true excluded: their probabilities are exactly 0. Every row
/// must keep at least one entry (a fully masked row is NaN). One autograd node instead of
/// masked_fill + softmax: softmax's own backward, p ⊙ (g − Σ g·p), is already 0 at the
/// masked entries, so the masked_fill's backward (a full pass over the scores) is skipped;
/// the mask gets no gradient. Values and gradients equal masked_fill(−∞) + softmax's.
at::Tensor MaskedSoftmax(const at::Tensor& scores, const at::Tensor& mask);

}  // namespace fulcrum::kernels
