// Sparse linear layer y = x·Wᵀ + b for a pruned weight W [out, in] (a mask; pruned entries
// exactly zero) that computes only the nonzeros: the forward and the input gradient as
// sparse × dense products (SpMM, CSR and CSC), the weight gradient as a sampled dense ×
// dense product at the nonzeros (SDDMM) — DynMo's sparse path (Sputnik SpMM + SDDMM, Gale et
// al., SC 2020) on the CPU, in fp32 or fp64 (bf16 activations computed in fp32: NOTE
// [sparse mixed precision] at SparseLinearForward).
//
// NOTE [token tiles]
// Every kernel works on activations in a tiled, transposed layout: x [T, in] becomes
// [ceil(T/t), in, t] with t = 256 bytes of tokens (64 floats, 32 doubles), zero-padded. One
// tile of one feature is a contiguous 256-byte row, so the SpMM inner step is an axpy of 8
// vector registers (a register-blocked accumulator per output row) and one token tile of
// all features (in·256 bytes: 128 KiB to 512 KiB here) stays in L2 while every output row
// reads it. The SDDMM reads the same tiles of x and of the output gradient, so the backward
// transposes the output gradient once for both products and the forward keeps its tiled x
// for the weight gradient instead of x itself (same bytes, plus the padding).
//
// NOTE [sparse threads]
// This project is compiled without -fopenmp, so at::parallel_for (OpenMP backend in
// Debian's LibTorch) runs serially in our translation units. The kernels split their rows
// (or token tiles) into chunks taken from a shared counter by the calling thread and by up
// to at::get_num_threads() − 1 workers of a small pool of our own, which sleep between
// jobs; the caller waits only for chunks a worker has started. Measured alternatives on
// the development machine: LibTorch's inter-op pool (at::launch) has one thread there (a
// second helper never comes); entering LibTorch's OpenMP team directly (libgomp's
// GOMP_parallel) scaled better right after an ATen op, whose OpenMP workers are still
// spinning, but right after an OpenBLAS GEMM (whose workers spin too) its barrier spin
// turned 2-3 ms products into 8-20 ms ones, noise a load balancer must not see. Each
// output element is computed by one thread in a fixed order, so results do not depend on
// the thread count (bit for bit).
//
// NOTE [sparse crossover]
// fulcrum_bench_sparse on the development machine (AMD EPYC Zen 4 VM, 2 cores, AVX-512;
// LibTorch 1.13 on OpenBLAS 0.3.21), T = 1024 tokens, the four products of a gpt_20m layer
// (qkv 1536x512, proj 512x512, fc1 2048x512, fc2 512x2048), fp32, magnitude-pruned random
// weights; the layer's F+B+W, sparse / dense (1 thread; 2 threads, noisier, in brackets):
//   sparsity  0.50  0.55  0.60  0.65  0.70  0.75  0.80  0.90  0.95
//   ratio     1.16  1.05  0.95  0.85  0.73  0.63  0.51  0.29  0.18
//            (0.98  1.39  0.99  0.90  0.79  0.75  0.48  0.32  0.25)
// Per shape the break-even lies between 55% and 60% sparsity (fc2 last: 0.98 at 60%), and
// small shapes (32x32 to 256x256) break even no later. kSparseCrossoverDensity takes 65%
// sparsity (ratios 0.82-0.88 per shape at 1 thread), a margin for noise and other
// machines. LibTorch's own CSR product (to_sparse_csr + addmm) is no alternative here: its
// forward alone takes 10-16x the dense forward at 90% sparsity and 44-75x at 50%.
//
// Thread safety: a SparseWeight is immutable except for RefreshValues; reading it from
// several threads at once (forward, backward, deferred weight gradients) is safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fulcrum {

/// The nonzero structure of a pruned weight W [out, in] (rows = out), in CSR and in CSC,
/// with W's values at the nonzeros in both orders. The structure is fixed at construction;
/// RefreshValues re-reads the values (after an optimizer step).
class SparseWeight {
 public:
  /// `weight` [out, in], float or double, CPU; `mask` of the same shape, bool or numeric
  /// (nonzero = kept). The values are read from `weight` at the kept entries; entries of
  /// `weight` outside the mask are ignored.
  SparseWeight(const at::Tensor& weight, const at::Tensor& mask);

  /// Re-reads the values at the fixed structure from `weight` (same shape and dtype as at
  /// construction): O(nnz). Call after every change of the dense weight (optimizer step,
  /// checkpoint load) and before the next forward; the forward and the input gradient use
  /// these values, not `weight`'s.
  void RefreshValues(const at::Tensor& weight);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t nnz() const { return static_cast<int64_t>(csr_col_.size()); }
  /// nnz / (rows · cols); 0 for an empty shape.
  double density() const;
  at::ScalarType dtype() const { return csr_values_.scalar_type(); }

  /// CSR: row o's nonzeros are [csr_row_ptr[o], csr_row_ptr[o + 1]), columns ascending.
  const std::vector<int64_t>& csr_row_ptr() const { return csr_row_ptr_; }
  const std::vector<int32_t>& csr_col() const { return csr_col_; }
  /// [nnz], CSR order.
  const at::Tensor& csr_values() const { return csr_values_; }
  /// CSC: column j's nonzeros are [csc_col_ptr[j], csc_col_ptr[j + 1]), rows ascending.
  const std::vector<int64_t>& csc_col_ptr() const { return csc_col_ptr_; }
  const std::vector<int32_t>& csc_row() const { return csc_row_; }
  /// [nnz], CSC order.
  const at::Tensor& csc_values() const { return csc_values_; }
  /// o·cols + j of each CSR nonzero (the gather that reads the values; the scatter that
  /// writes a dense gradient).
  const std::vector<int64_t>& csr_flat_index() const { return csr_flat_; }

  /// The dense [out, in] matrix with `csr_values` ([nnz], CSR order) at the nonzeros and
  /// zeros elsewhere.
  at::Tensor ScatterToDense(const at::Tensor& csr_values) const;
  /// dense[nonzero k] += csr_values[k] for a dense [out, in] tensor; the other entries are
  /// not touched: O(nnz).
  void AccumulateInto(at::Tensor& dense, const at::Tensor& csr_values) const;

 private:
  int64_t rows_ = 0;
  int64_t cols_ = 0;
  std::vector<int64_t> csr_row_ptr_;
  std::vector<int32_t> csr_col_;
  std::vector<int64_t> csr_flat_;
  std::vector<int64_t> csc_col_ptr_;
  std::vector<int32_t> csc_row_;
  std::vector<int64_t> csc_to_csr_;  // CSC position p holds CSR nonzero csc_to_csr_[p].
  at::Tensor csr_values_;
  at::Tensor csc_values_;
};

/// y = x·Wᵀ (+ bias) for x [..., in] → [..., out], W the SparseWeight's values; `bias`
/// [out] may be undefined. No autograd (see SparseLinearForward).
at::Tensor SparseLinearOutput(const at::Tensor& x, const SparseWeight& w, const at::Tensor& bias);
/// grad_x = grad_y·W for grad_y [..., out] → [..., in]. No autograd.
at::Tensor SparseLinearInputGrad(const at::Tensor& grad_y, const SparseWeight& w);
/// The weight gradient at the nonzeros (SDDMM): [nnz] in CSR order, value k =
/// Σ_t grad_y[t, o_k] · x[t, j_k] over all leading dimensions. ScatterToDense makes the
/// dense (masked) gradient of it. No autograd.
at::Tensor SparseLinearWeightGrad(const at::Tensor& grad_y, const at::Tensor& x,
                                  const SparseWeight& w);

/// y = x·Wᵀ + b as an autograd function, for x [..., in]; `weight` is the dense parameter
/// [out, in] that `w` mirrors (its gradient goes there), `bias` [out] may be undefined.
/// The forward and the input gradient use `w`'s values; the weight gradient is the dense
/// Linear's masked by w's structure (zero at pruned entries), accumulated into
/// weight.grad() and honouring the B/W split exactly as LinearForward does (core/linear.h
/// NOTE [B/W split], NOTE [weight-gradient tags]): with a WeightGradStore active, the
/// backward computes grad_x and grad_bias only and queues the SDDMM with the forward's tag;
/// the queued closure holds the tiled x and output gradient (its `bytes`). Deferred and
/// fused weight gradients are equal bit for bit. A frozen weight (requires_grad false) gets
/// no weight-gradient work.
at::Tensor SparseLinearForward(const at::Tensor& x, std::shared_ptr<const SparseWeight> w,
                               const at::Tensor& weight, const at::Tensor& bias);

/// The density (kept fraction) below which SparseLinearForward beats the dense Linear in
/// F+B+W with a margin, measured for the gpt_20m shapes at T = 1024 on 1 and 2 threads
/// (NOTE [sparse crossover]): 0.35, i.e. 65% sparsity. Above it use the dense LinearForward
/// on the masked weight (and mask its gradient).
inline constexpr double kSparseCrossoverDensity = 0.35;

/// Whether the sparse path is expected to beat the dense GEMM for W [out, in] at `density`
/// (NOTE [sparse crossover]; measured from 32x32 to 2048x512, where the crossover did not
/// depend on the shape beyond noise).
bool SparseIsFaster(int64_t out, int64_t in, double density);

}  // namespace fulcrum
