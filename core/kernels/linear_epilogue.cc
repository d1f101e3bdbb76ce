#include "core/kernels/linear_epilogue.h"

#include <ATen/ATen.h>

#if FULCRUM_CUDA
#include "core/kernels/internal/cublaslt_gemm.h"
#endif

namespace fulcrum::kernels {
namespace {

const char* GeluApproximation(bool tanh_approx) { return tanh_approx ? "tanh" : "none"; }

// The leading dimensions of x [..., f] folded into one: [N, f].
at::Tensor Rows(const at::Tensor& x) { return x.reshape({-1, x.size(-1)}); }

#if FULCRUM_CUDA
// The fused forms are only worth trying on CUDA, and cuBLASLt's GeLU is the tanh one.
bool TryFused(const at::Tensor& x, bool tanh_approx) { return x.is_cuda() && tanh_approx; }
#endif

}  // namespace

LinearGeluOutput LinearBiasGeluForward(const at::Tensor& input, const at::Tensor& weight,
                                       const at::Tensor& bias, bool tanh_approx) {
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 2 && input.size(-1) == weight.size(1),
              "LinearBiasGeluForward: input [..., ", weight.dim() == 2 ? weight.size(1) : -1,
              "] expected for weight ", weight.sizes(), ", got input ", input.sizes());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
              "LinearBiasGeluForward: bias must be [", weight.size(0), "], got ", bias.sizes());
#if FULCRUM_CUDA
  if (TryFused(input, tanh_approx)) {
    std::vector<int64_t> shape = input.sizes().vec();
    shape.back() = weight.size(0);
    internal::LtGemmArgs args;
    args.pass = internal::GemmPass::kForward;
    args.activation = internal::Activation::kGeluTanh;
    args.a = Rows(input).contiguous();
    args.b = weight.contiguous();
    args.out = at::empty({args.a.size(0), weight.size(0)}, input.options());
    args.aux = at::empty_like(args.out);
    args.bias = bias.defined() ? bias.contiguous() : at::Tensor();
    if (internal::LtGemm(args)) return {args.out.view(shape), args.aux.view(shape)};
  }
#endif
  at::Tensor pre = at::matmul(input, weight.t());
  if (bias.defined()) pre = pre + bias;
  return {at::gelu(pre, GeluApproximation(tanh_approx)), pre};
}

GeluInputGrad LinearGeluInputGrad(const at::Tensor& grad_output, const at::Tensor& weight,
                                  const at::Tensor& pre_activation, bool tanh_approx,
                                  bool want_bias_grad) {
  TORCH_CHECK(weight.dim() == 2 && grad_output.size(-1) == weight.size(0) &&
                  pre_activation.size(-1) == weight.size(1),
              "LinearGeluInputGrad: grad_output [..., ", weight.size(0),
              "] and pre_activation [..., ", weight.size(1), "] expected for weight ",
              weight.sizes(), ", got ", grad_output.sizes(), " and ", pre_activation.sizes());
  TORCH_CHECK(grad_output.numel() / grad_output.size(-1) ==
                  pre_activation.numel() / pre_activation.size(-1),
              "LinearGeluInputGrad: grad_output ", grad_output.sizes(), " and pre_activation ",
              pre_activation.sizes(), " have different numbers of rows");
#if FULCRUM_CUDA
  if (TryFused(grad_output, tanh_approx)) {
    internal::LtGemmArgs args;
    args.pass = internal::GemmPass::kInputGrad;
    args.activation = internal::Activation::kGeluTanh;
    args.a = Rows(grad_output).contiguous();
    args.b = weight.contiguous();
    args.aux = Rows(pre_activation).contiguous();
    args.out = at::empty_like(args.aux);
    if (want_bias_grad) args.bias = at::empty({weight.size(1)}, args.out.options());
    if (internal::LtGemm(args)) return {args.out.view(pre_activation.sizes()), args.bias};
  }
#endif
  const at::Tensor grad_h = at::matmul(grad_output, weight);
  GeluInputGrad result;
  result.grad_pre_activation =
      at::gelu_backward(grad_h, pre_activation, GeluApproximation(tanh_approx));
  if (want_bias_grad) result.grad_bias = Rows(result.grad_pre_activation).sum(0);
  return result;
}

WeightGrad LinearWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                            bool want_bias_grad, bool fp32_accumulate) {
  TORCH_CHECK(grad_output.dim() >= 1 && input.dim() >= 1 &&
                  grad_output.numel() / grad_output.size(-1) == input.numel() / input.size(-1),
              "LinearWeightGrad: grad_output ", grad_output.sizes(), " and input ", input.sizes(),
              " must have the same leading dimensions");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "LinearWeightGrad: grad_output is ",
              grad_output.scalar_type(), " but input is ", input.scalar_type());
  const int64_t out_features = grad_output.size(-1);
  const int64_t in_features = input.size(-1);
  const at::ScalarType result_type = fp32_accumulate ? at::kFloat : input.scalar_type();
#if FULCRUM_CUDA
  if (grad_output.is_cuda()) {
    internal::LtGemmArgs args;
    args.pass = internal::GemmPass::kWeightGrad;
    args.a = Rows(grad_output).contiguous();
    args.b = Rows(input).contiguous();
    args.out = at::empty({out_features, in_features}, input.options().dtype(result_type));
    if (want_bias_grad) args.bias = at::empty({out_features}, args.out.options());
    if (internal::LtGemm(args)) return {args.out, args.bias};
  }
#endif
  // core/linear.cc's weight-gradient GEMM, operand for operand (NOTE [B/W split]).
  at::Tensor dy = grad_output.reshape({-1, out_features});
  at::Tensor x = input.reshape({-1, in_features});
  if (fp32_accumulate) {
    dy = dy.to(at::kFloat);
    x = x.to(at::kFloat);
  }
  WeightGrad result;
  result.grad_weight = at::matmul(dy.t(), x);
  if (want_bias_grad) result.grad_bias = dy.sum(0);
  return result;
}

void AccumulateWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                          at::Tensor& main_grad) {
  TORCH_CHECK(main_grad.dim() == 2 && main_grad.size(0) == grad_output.size(-1) &&
                  main_grad.size(1) == input.size(-1),
              "AccumulateWeightGrad: main_grad must be [", grad_output.size(-1), ", ",
              input.size(-1), "], got ", main_grad.sizes());
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat || main_grad.scalar_type() == input.scalar_type(),
              "AccumulateWeightGrad: main_grad is ", main_grad.scalar_type(), "; fp32 or ",
              input.scalar_type(), " (the operands') expected");
#if FULCRUM_CUDA
  if (grad_output.is_cuda() && main_grad.is_contiguous()) {
    internal::LtGemmArgs args;
    args.pass = internal::GemmPass::kWeightGrad;
    args.a = Rows(grad_output).contiguous();
    args.b = Rows(input).contiguous();
    args.out = main_grad;
    args.accumulate = true;
    if (internal::LtGemm(args)) return;
  }
#endif
  const bool fp32 = main_grad.scalar_type() == at::kFloat && input.scalar_type() != at::kFloat;
  main_grad.add_(LinearWeightGrad(grad_output, input, /*want_bias_grad=*/false, fp32).grad_weight);
}

}  // namespace fulcrum::kernels
