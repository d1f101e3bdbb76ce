// One cuBLASLt matmul with a fused epilogue, for core/kernels only (compiled in the CUDA
// build: FULCRUM_CUDA). Callers describe the GEMM in row-major tensors; this file owns the
// column-major translation, the descriptors and the one table that picks the epilogue
// (NOTE [fused epilogues] in core/kernels/linear_epilogue.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace fulcrum::kernels::internal {

/// Which GEMM of a linear layer this is; with the activation and whether a bias (or its
/// gradient) rides along, it selects the cuBLASLt epilogue.
enum class GemmPass {
  kForward,     ///< out = act(a·bᵀ + bias), aux = a·bᵀ + bias when act is GeLU
  kInputGrad,   ///< out = (a·b) ⊙ gelu'(aux), bias = Σ rows of out
  kWeightGrad,  ///< out (+)= aᵀ·b, bias = Σ rows of a
};

enum class Activation { kNone, kGeluTanh };

/// Arguments, row-major: the pass decides which products of `a` and `b` it forms (see
/// GemmPass). `out` is preallocated with its final dtype (it may be fp32 with bf16 `a`/`b`);
/// `bias` is an input for kForward and an output (`out`'s dtype) for the gradient passes;
/// `aux` is the pre-activation, written by kForward and read by kInputGrad.
struct LtGemmArgs {
  GemmPass pass = GemmPass::kForward;
  Activation activation = Activation::kNone;
  at::Tensor a;
  at::Tensor b;
  at::Tensor out;
  at::Tensor bias;
  at::Tensor aux;
  bool accumulate = false;  ///< out += result (beta = 1) instead of out = result
};

/// Runs the GEMM on the current CUDA stream with LibTorch's cuBLASLt handle and workspace.
/// Returns false, having done nothing, where cuBLASLt cannot run it (a dtype, a layout or
/// an alignment it refuses, no algorithm for the epilogue): the caller then runs its plain
/// LibTorch path. cuBLASLt errors after an algorithm was chosen throw (file, line, status).
bool LtGemm(const LtGemmArgs& args);

}  // namespace fulcrum::kernels::internal
