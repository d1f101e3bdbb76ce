// Tensor parallelism over a Communicator: the autograd mappings of Megatron-LM (Shoeybi et
// al. 2019, §3) — copy (f), reduce (g), gather, and the
// sequence-parallel gather / reduce-scatter (NOTE [sequence parallelism]) — behind core's TensorParallelGroup
// interface. The sharded layers themselves (column-parallel linear_qkv/linear_fc1,
// row-parallel linear_proj/linear_fc2, vocab-parallel embedding, output layer and
// cross-entropy) are the model code in core/transformer_layer.cc and
// core/tensor_parallel.cc, which call these mappings; see NOTE [tensor-parallel sharding].
//
// Not thread-safe: the forward and backward (CPU autograd runs backward on the calling
// thread) use the communicator from the training thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include "core/tensor_parallel.h"
#include "parallel/communicator.h"

namespace fulcrum::parallel {

class CommTensorParallelGroup final : public TensorParallelGroup {
 public:
  /// `comm` is the tensor-parallel communicator; it must outlive this object.
  explicit CommTensorParallelGroup(Communicator* comm) : comm_(comm) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  at::Tensor CopyToRegion(const at::Tensor& x) override;
  at::Tensor ReduceFromRegion(const at::Tensor& x) override;
  at::Tensor GatherFromRegion(const at::Tensor& x) override;
  at::Tensor GatherSequence(const at::Tensor& x) override;
  at::Tensor ReduceScatterSequence(const at::Tensor& x) override;
  at::Tensor GatherSequenceWhole(const at::Tensor& x) override;
  at::Tensor ScatterSequence(const at::Tensor& x) override;
  void AllReduceSum(at::Tensor& t) override;
  void AllReduceMax(at::Tensor& t) override;
  at::Tensor AllGather(const at::Tensor& t, int64_t dim) override;

  Communicator* communicator() const { return comm_; }

 private:
  Communicator* comm_;
};

}  // namespace fulcrum::parallel
