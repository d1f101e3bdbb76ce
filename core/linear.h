// Linear projection y = x·Wᵀ + b as a custom autograd function that can split its backward
// into the input gradient (B) and the weight gradient (W), the split zero-bubble pipeline
// schedules need (Qi et al., ICLR 2024, §2).
//
// NOTE [B/W split]
// While a WeightGradStore is active on the calling thread, the backward of Linear computes
// only grad_input and grad_bias (cheap) and queues a closure that computes grad_weight =
// grad_outputᵀ·x and accumulates it into weight.grad(). Running the queued closures later
// (the W action) gives gradients bit-identical to the fused backward: the same GEMM on the
// same operands, accumulated in the same order. Without an active store the backward is
// the ordinary fused one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace fulcrum {

/// Holds deferred weight-gradient computations (one store per micro-batch's backward).
/// Not thread-safe; activation is per thread.
class WeightGradStore {
 public:
  WeightGradStore() = default;
  WeightGradStore(const WeightGradStore&) = delete;
  WeightGradStore& operator=(const WeightGradStore&) = delete;

  /// The store active on this thread, or nullptr.
  static WeightGradStore* Active();

  /// Activates `store` on this thread for the scope's lifetime (restores the previous one).
  class Scope {
   public:
    explicit Scope(WeightGradStore* store);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WeightGradStore* previous_;
  };

  void Push(std::function<void()> task) { tasks_.push_back(std::move(task)); }
  /// Runs and clears every queued weight-gradient computation, in queue order.
  void Flush();
  size_t size() const { return tasks_.size(); }
  bool empty() const { return tasks_.empty(); }

 private:
  std::vector<std::function<void()>> tasks_;
};

/// y = x·Wᵀ + b for x [..., in], W [out, in], b [out] (may be undefined).
at::Tensor LinearForward(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& bias);

}  // namespace fulcrum
