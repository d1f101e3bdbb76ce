// cuBLASLt GEMMs with fused epilogues (CUDA build only; see internal/cublaslt_gemm.h).
#include "core/kernels/internal/cublaslt_gemm.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

#include <cstdint>
#include <memory>

namespace fulcrum::kernels::internal {
namespace {

// Every cuBLASLt call goes through this: a failure names the call and cuBLASLt's own
// description of the status (TORCH_CHECK adds file and line).
#define FULCRUM_CUBLASLT_CHECK(expr)                                                  \
  do {                                                                                \
    const cublasStatus_t fulcrum_status = (expr);                                     \
    TORCH_CHECK(fulcrum_status == CUBLAS_STATUS_SUCCESS, "cuBLASLt call ", #expr,     \
                " failed: ", cublasLtGetStatusString(fulcrum_status), " (status ",    \
                static_cast<int>(fulcrum_status), ")");                               \
  } while (0)

// NOTE [epilogue table]
// The one place that maps (pass, activation, bias) to a cuBLASLt epilogue. kNone for an
// activation in a gradient pass means a plain GEMM; a gradient pass "with bias" writes the
// bias gradient. Combinations absent here have no fused form and return false.
bool ChooseEpilogue(GemmPass pass, Activation activation, bool bias, cublasLtEpilogue_t* out) {
  const bool gelu = activation == Activation::kGeluTanh;
  switch (pass) {
    case GemmPass::kForward:
      *out = gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                  : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
      return true;
    case GemmPass::kInputGrad:
      if (!gelu) {
        if (bias) return false;  // a bias gradient without an activation is BGRADA's: not used
        *out = CUBLASLT_EPILOGUE_DEFAULT;
        return true;
      }
      *out = bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
      return true;
    case GemmPass::kWeightGrad:
      if (gelu) return false;
      *out = bias ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT;
      return true;
  }
  return false;
}

bool CudaType(at::ScalarType type, cudaDataType_t* out) {
  switch (type) {
    case at::kFloat: *out = CUDA_R_32F; return true;
    case at::kBFloat16: *out = CUDA_R_16BF; return true;
    case at::kHalf: *out = CUDA_R_16F; return true;
    default: return false;
  }
}

// cuBLASLt wants 16-byte aligned operands for its fast kernels; views into the middle of
// a buffer may not be, and those take the plain path.
bool Usable(const at::Tensor& t) {
  return !t.defined() || (t.is_cuda() && t.is_contiguous() &&
                          reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

// A column-major rows×cols matrix with leading dimension ld.
Layout MakeLayout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  FULCRUM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  return Layout(layout);
}

template <typename T>
void SetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
                  const T& value) {
  FULCRUM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

}  // namespace

bool LtGemm(const LtGemmArgs& args) {
  const at::Tensor& a = args.a;
  const at::Tensor& b = args.b;
  const at::Tensor& out = args.out;
  if (a.dim() != 2 || b.dim() != 2 || out.dim() != 2 || a.scalar_type() != b.scalar_type()) {
    return false;
  }
  if (!Usable(a) || !Usable(b) || !Usable(out) || !Usable(args.bias) || !Usable(args.aux)) {
    return false;
  }
  cudaDataType_t ab_type, out_type;
  if (!CudaType(a.scalar_type(), &ab_type) || !CudaType(out.scalar_type(), &out_type)) return false;
  // Mixed operand/result dtypes only as bf16/fp16 operands into an fp32 result.
  if (out.scalar_type() != a.scalar_type() && out.scalar_type() != at::kFloat) return false;
  const bool has_bias = args.bias.defined();
  if (has_bias && args.bias.scalar_type() != out.scalar_type()) return false;
  cublasLtEpilogue_t epilogue;
  if (!ChooseEpilogue(args.pass, args.activation, has_bias, &epilogue)) return false;

  // Row-major R [r, c] is column-major Rᵀ [c, r] with ld c. Each pass is written as the
  // column-major product D[m, n] = op(A)[m, k]·op(B)[k, n] that equals its row-major
  // result transposed.
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  at::Tensor lt_a, lt_b;
  switch (args.pass) {
    case GemmPass::kForward:  // out [N, M] = a [N, K]·b [M, K]ᵀ
      lt_a = b, trans_a = true, lt_b = a;
      m = b.size(0), n = a.size(0), k = a.size(1);
      if (b.size(1) != k) return false;
      break;
    case GemmPass::kInputGrad:  // out [N, M] = a [N, K]·b [K, M]
      lt_a = b, lt_b = a;
      m = b.size(1), n = a.size(0), k = a.size(1);
      if (b.size(0) != k) return false;
      break;
    case GemmPass::kWeightGrad:  // out [M, K] = a [N, M]ᵀ·b [N, K]; bias Σ over N of a
      lt_a = b, lt_b = a, trans_b = true;
      m = b.size(1), n = a.size(1), k = a.size(0);
      if (b.size(0) != k) return false;
      break;
  }
  if (out.size(0) != n || out.size(1) != m) return false;
  const bool uses_aux = epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
                        epilogue == CUBLASLT_EPILOGUE_GELU_AUX ||
                        epilogue == CUBLASLT_EPILOGUE_DGELU ||
                        epilogue == CUBLASLT_EPILOGUE_DGELU_BGRAD;
  if (uses_aux) {
    // The aux matrix shares D's shape; cuBLASLt wants its leading dimension a multiple of 8.
    if (!args.aux.defined() || args.aux.sizes() != out.sizes() ||
        args.aux.scalar_type() != out.scalar_type() || m % 8 != 0) {
      return false;
    }
  }

  const bool fp32_operands = a.scalar_type() == at::kFloat;
  const cublasComputeType_t compute =
      fp32_operands && at::globalContext().allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                             : CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t raw_desc = nullptr;
  FULCRUM_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&raw_desc, compute, CUDA_R_32F));
  MatmulDesc desc(raw_desc);
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (has_bias) {
    const void* bias_ptr = args.bias.data_ptr();
    SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, out_type);
  }
  if (uses_aux) {
    const void* aux_ptr = args.aux.data_ptr();
    SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux_ptr);
    SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, m);
    SetAttribute(raw_desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, out_type);
  }

  // Stored (untransposed) shapes of A and B in column-major terms.
  Layout layout_a = MakeLayout(ab_type, trans_a ? k : m, trans_a ? m : k, lt_a.size(1));
  Layout layout_b = MakeLayout(ab_type, trans_b ? n : k, trans_b ? k : n, lt_b.size(1));
  Layout layout_d = MakeLayout(out_type, m, n, m);

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  cublasLtMatmulPreference_t raw_preference = nullptr;
  FULCRUM_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&raw_preference));
  Preference preference(raw_preference);
  FULCRUM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(
      raw_preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size,
      sizeof(workspace_size)));
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, raw_desc, layout_a.get(), layout_b.get(), layout_d.get(), layout_d.get(),
      raw_preference, 1, &heuristic, &found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return false;

  const float alpha = 1.0f;
  const float beta = args.accumulate ? 1.0f : 0.0f;
  FULCRUM_CUBLASLT_CHECK(cublasLtMatmul(
      handle, raw_desc, &alpha, lt_a.data_ptr(), layout_a.get(), lt_b.data_ptr(), layout_b.get(),
      &beta, out.data_ptr(), layout_d.get(), out.data_ptr(), layout_d.get(), &heuristic.algo,
      workspace, workspace_size, at::cuda::getCurrentCUDAStream()));
  return true;
}

}  // namespace fulcrum::kernels::internal
