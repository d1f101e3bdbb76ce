#include "core/kernels/attention.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

namespace fulcrum::kernels {
namespace {

// MaskedSoftmax's node (its comment in the header says why one node).
class MaskedSoftmaxFunction : public torch::autograd::Function<MaskedSoftmaxFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& scores,
                            const at::Tensor& mask) {
    at::Tensor probs =
        at::softmax(scores.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    ctx->save_for_backward({probs});
    return probs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor probs = ctx->get_saved_variables()[0];
    return {at::_softmax_backward_data(grads[0], probs, -1, probs.scalar_type()), at::Tensor()};
  }
};

at::Tensor ExpandGroups(const at::Tensor& kv, int64_t per_group) {
  return per_group == 1 ? kv : kv.repeat_interleave(per_group, 1);
}

}  // namespace

at::Tensor MaskedSoftmax(const at::Tensor& scores, const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "MaskedSoftmax: the mask must be bool, got ",
              mask.scalar_type());
  return MaskedSoftmaxFunction::apply(scores, mask);
}

at::Tensor AttentionCore(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const AttentionOptions& options) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "AttentionCore: q, k, v must be [batch, heads, seq, head_dim], got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  k.size(3) == q.size(3),
              "AttentionCore: k and v must be [", q.size(0), ", groups, ", q.size(2), ", ",
              q.size(3), "], got ", k.sizes(), " and ", v.sizes());
  const int64_t heads = q.size(1);
  const int64_t groups = k.size(1);
  TORCH_CHECK(groups > 0 && heads % groups == 0, "AttentionCore: ", groups,
              " key/value heads do not divide ", heads, " query heads");
  TORCH_CHECK(options.dropout_p >= 0.0 && options.dropout_p < 1.0,
              "AttentionCore: dropout_p must be in [0, 1), got ", options.dropout_p);
  TORCH_CHECK(options.dropout_p == 0.0 || options.drop_head,
              "AttentionCore: dropout_p ", options.dropout_p,
              " needs drop_head (masks from Fulcrum's generators; NOTE [attention core contract])");
  const int64_t per_group = heads / groups;
  const int64_t d = q.size(3);

  if (options.dropout_p == 0.0) {
    const std::optional<double> scale =
        options.scale == 0.0 ? std::nullopt : std::optional<double>(options.scale);
    if (q.is_cuda() && per_group > 1) {
      return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                              options.causal, scale, /*enable_gqa=*/true);
    }
    return at::scaled_dot_product_attention(q, ExpandGroups(k, per_group),
                                            ExpandGroups(v, per_group), /*attn_mask=*/{},
                                            /*dropout_p=*/0.0, options.causal, scale);
  }

  // The whole probability matrix: the scale on q (b·heads·s·d elements) rather than on the
  // scores (b·heads·s²), and the mask inside the softmax's node.
  const double scale = options.scale == 0.0 ? 1.0 / std::sqrt(double(d)) : options.scale;
  const int64_t s = q.size(2);
  at::Tensor scores = at::matmul(q * scale, ExpandGroups(k, per_group).transpose(-2, -1));
  at::Tensor probs;
  if (options.causal) {
    const at::Tensor future =
        at::ones({s, s}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(1);
    probs = MaskedSoftmax(scores, future);
  } else {
    probs = at::softmax(scores, -1);
  }
  std::vector<at::Tensor> per_head;
  per_head.reserve(heads);
  for (int64_t i = 0; i < heads; ++i) per_head.push_back(options.drop_head(probs.select(1, i), i));
  return at::matmul(at::stack(per_head, 1), ExpandGroups(v, per_group));
}

}  // namespace fulcrum::kernels
