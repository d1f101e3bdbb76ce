// The attention core: softmax(q·kᵀ·scale, causal) · v over [batch, heads, seq, head_dim],
// the part of a transformer layer's attention between the projections.
//
// NOTE [attention core contract]
// It is the computation core/transformer_layer.cc's SoftmaxAttention does today (NOTE
// [dense causal attention] there), so the layer can call this instead:
//  - q [b, heads, s, d]; k, v [b, groups, s, d] with groups dividing heads: each key/value
//    head serves heads/groups consecutive query heads (the layer's ExpandGroups order).
//  - Without dropout: at::scaled_dot_product_attention (flash or memory-efficient on CUDA;
//    on the CPU the same call the layer makes today, so the result is bit-identical). On
//    CUDA grouped k/v go to SDPA as they are (enable_gqa), with no expanded copy; on the
//    CPU they are expanded first, as the layer does.
//  - With dropout: SDPA's own dropout draws from the device generator, so a head would drop
//    different entries on different ranks. The caller passes `drop_head`, which returns
//    the dropped probabilities of one head ([b, s, s], its mask from Fulcrum's generators);
//    the core then forms the whole probability matrix, exactly as the layer's dropout path.
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

/// softmax(q·kᵀ·scale (+ causal mask)) · v → [b, heads, s, d]. Differentiable.
at::Tensor AttentionCore(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const AttentionOptions& options = {});

}  // namespace fulcrum::kernels
