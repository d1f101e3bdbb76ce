#include "moe/expert_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>

#include "core/kernels/grouped_gemm.h"
#include "core/linear.h"

namespace fulcrum::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Inputs: rows, E weights, E biases (or none), then two non-tensor arguments (the counts
// and the path); the gradients come back in that order.
class ExpertLinearFunction : public torch::autograd::Function<ExpertLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, at::TensorList weights,
                            at::TensorList biases, std::vector<int64_t> counts, bool batched) {
    std::vector<at::Tensor> saved = {rows};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["batched"] = batched;
    ctx->saved_data["has_bias"] = !biases.empty();
    ctx->saved_data["bias_dtype"] =
        static_cast<int64_t>(biases.empty() ? weights[0].scalar_type() : biases[0].scalar_type());
    // NOTE [weight-gradient tags]: the tag of the layer whose forward this is.
    ctx->saved_data["tag"] = WeightGradStore::CurrentTag();
    const at::ScalarType dtype = rows.scalar_type();
    if (batched) {
      const at::Tensor bias =
          biases.empty() ? at::Tensor() : at::stack(biases).to(dtype);
      return kernels::UnpadByExpert(
          kernels::GroupedExpertGemm(kernels::PadByExpert(rows, counts),
                                     at::stack(weights).to(dtype), bias),
          counts);
    }
    // LinearForward's operations, expert by expert (NOTE [grouped expert linear]).
    const std::vector<at::Tensor> inputs = rows.split_with_sizes(counts);
    std::vector<at::Tensor> outputs;
    outputs.reserve(inputs.size());
    for (size_t e = 0; e < inputs.size(); ++e) {
      at::Tensor out = at::matmul(inputs[e], weights[e].to(dtype).t());
      if (!biases.empty()) out = out + biases[e].to(out.scalar_type());
      outputs.push_back(std::move(out));
    }
    return at::cat(outputs);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const std::vector<at::Tensor> weights(saved.begin() + 1, saved.end());
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const bool batched = ctx->saved_data["batched"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto bias_dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
    const size_t experts = weights.size();
    const at::Tensor grad_out = grads[0].contiguous();
    const at::ScalarType dtype = grad_out.scalar_type();

    variable_list result(1 + experts + (has_bias ? experts : 0) + 2);
    // B: the rows' gradient (a first trainable layer after a frozen prefix needs none) and
    // the biases' (Linear's bias gets its gradient in B too, from autograd).
    if (batched) {
      const at::Tensor grad_padded = kernels::PadByExpert(grad_out, counts);  // [E, C, F]
      if (ctx->needs_input_grad(0)) {
        result[0] = kernels::UnpadByExpert(
            at::bmm(grad_padded, at::stack(weights).to(dtype)), counts);
      }
      if (has_bias) {
        const at::Tensor bias_grads = grad_padded.sum(1).to(bias_dtype);  // [E, F]
        for (size_t e = 0; e < experts; ++e) result[1 + experts + e] = bias_grads[e];
      }
    } else {
      const std::vector<at::Tensor> grad_outs = grad_out.split_with_sizes(counts);
      if (ctx->needs_input_grad(0)) {
        std::vector<at::Tensor> grad_rows;
        for (size_t e = 0; e < experts; ++e) {
          grad_rows.push_back(at::matmul(grad_outs[e], weights[e].to(dtype)));
        }
        result[0] = at::cat(grad_rows);
      }
      if (has_bias) {
        // What autograd gives `out + bias.to(dtype)`: the sum over rows, then widened.
        for (size_t e = 0; e < experts; ++e) {
          result[1 + experts + e] =
              grad_outs[e].sum({0}, /*keepdim=*/true).view({-1}).to(bias_dtype);
        }
      }
    }

    // W: every trainable expert's dW_e = dy_eᵀ·x_e, in its master's dtype.
    std::vector<bool> trainable(experts);
    bool any = false;
    for (size_t e = 0; e < experts; ++e) {
      trainable[e] = weights[e].requires_grad();
      any = any || trainable[e];
    }
    if (!any) return result;  // all frozen: no W work
    auto weight_grads = [grad_out, rows, counts, weights, batched]() {
      std::vector<at::Tensor> dw(weights.size());
      const at::ScalarType master = weights[0].scalar_type();
      if (batched) {
        const bool widen = master == at::kFloat && rows.scalar_type() != at::kFloat;
        const at::Tensor all = kernels::GroupedExpertWeightGrad(
            kernels::PadByExpert(grad_out, counts), kernels::PadByExpert(rows, counts), widen);
        for (size_t e = 0; e < weights.size(); ++e) dw[e] = all[e].to(weights[e].scalar_type());
        return dw;
      }
      const std::vector<at::Tensor> grad_outs = grad_out.split_with_sizes(counts);
      const std::vector<at::Tensor> inputs = rows.split_with_sizes(counts);
      for (size_t e = 0; e < weights.size(); ++e) {
        dw[e] = LinearWeightGradient(grad_outs[e], inputs[e], weights[e].scalar_type());
      }
      return dw;
    };
    if (WeightGradStore* store = WeightGradStore::Active()) {
      // Deferred (NOTE [B/W split]): autograd receives no weight gradients; the closure
      // keeps the unpadded dy and x alive until the W action.
      store->Push(
          [weight_grads, weights, trainable]() {
            const std::vector<at::Tensor> dw = weight_grads();
            for (size_t e = 0; e < weights.size(); ++e) {
              if (trainable[e]) AccumulateWeightGradInto(weights[e], dw[e]);
            }
          },
          ctx->saved_data["tag"].toInt(), Bytes(grad_out) + Bytes(rows));
    } else {
      const std::vector<at::Tensor> dw = weight_grads();
      for (size_t e = 0; e < experts; ++e) {
        if (trainable[e]) result[1 + e] = dw[e];
      }
    }
    return result;
  }
};

}  // namespace

bool BatchesExperts(const at::Tensor& rows, ExpertGemmPath path) {
  switch (path) {
    case ExpertGemmPath::kBatched:
      return true;
    case ExpertGemmPath::kPerExpert:
      return false;
    case ExpertGemmPath::kAuto:
      break;
  }
  return rows.is_cuda();
}

at::Tensor ExpertLinear(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                        const std::vector<at::Tensor>& weights,
                        const std::vector<at::Tensor>& biases, ExpertGemmPath path) {
  TORCH_CHECK(!weights.empty() && weights.size() == rows_per_expert.size(), "ExpertLinear: ",
              rows_per_expert.size(), " row counts for ", weights.size(), " expert weights");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "ExpertLinear: ",
              biases.size(), " biases for ", weights.size(), " experts (give all or none)");
  TORCH_CHECK(rows.dim() == 2, "ExpertLinear: rows must be [rows, D], got ", rows.sizes());
  int64_t total = 0;
  for (size_t e = 0; e < weights.size(); ++e) {
    TORCH_CHECK(rows_per_expert[e] >= 0, "ExpertLinear: expert ", e, " has ",
                rows_per_expert[e], " rows");
    total += rows_per_expert[e];
    TORCH_CHECK(weights[e].dim() == 2 && weights[e].sizes() == weights[0].sizes() &&
                    weights[e].size(1) == rows.size(1) &&
                    weights[e].scalar_type() == weights[0].scalar_type(),
                "ExpertLinear: expert ", e, "'s weight is ", weights[e].sizes(), " ",
                weights[e].scalar_type(), "; every expert needs a [F, ", rows.size(1),
                "] weight of ", weights[0].scalar_type());
    if (biases.empty()) continue;
    TORCH_CHECK(biases[e].dim() == 1 && biases[e].size(0) == weights[e].size(0) &&
                    biases[e].scalar_type() == biases[0].scalar_type(),
                "ExpertLinear: expert ", e, "'s bias is ", biases[e].sizes(), " ",
                biases[e].scalar_type(), ", expected [", weights[e].size(0), "] ",
                biases[0].scalar_type(), " like the others");
  }
  TORCH_CHECK(total == rows.size(0), "ExpertLinear: row counts sum to ", total, " but rows has ",
              rows.size(0));
  return ExpertLinearFunction::apply(rows, at::TensorList(weights), at::TensorList(biases),
                                     rows_per_expert, BatchesExperts(rows, path));
}

}  // namespace fulcrum::moe
