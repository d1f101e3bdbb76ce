#include "core/aux_loss.h"

#include <torch/csrc/autograd/custom_function.h>

namespace fulcrum {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on `output`; in the backward also gives `aux` the gradient `scale`.
class AuxLossScaler : public torch::autograd::Function<AuxLossScaler> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& output, const at::Tensor& aux,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["aux_dtype"] = static_cast<int64_t>(aux.scalar_type());
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["aux_dtype"].toInt());
    return {grads[0], at::scalar_tensor(scale, at::TensorOptions().dtype(dtype)), at::Tensor()};
  }
};

}  // namespace

at::Tensor WithAuxLoss(const at::Tensor& output, const at::Tensor& aux, double scale) {
  if (!aux.defined() || !aux.requires_grad() || !(scale > 0)) return output;
  return AuxLossScaler::apply(output, aux, scale);
}

}  // namespace fulcrum
