// Tensor-parallel hooks of the model (Megatron-LM, Shoeybi et al. 2019, §3).
//
// core/ holds the math of sharded layers — which slice of each full weight a rank keeps and
// where activations enter and leave a parallel region — and calls the communication through
// this narrow interface. parallel/ implements it over a Communicator (parallel/
// tensor_parallel.h). A null TensorParallelGroup* means one rank: every hook is the identity
// and the model runs exactly the single-process code.
//
// NOTE [tensor-parallel sharding]
// Weights are initialised full from the seed and then sliced (NOTE [layout-independent
// randomness]), so any tp starts from the weights of tp=1. Per parameter, `tp_shard_dim`
// (core/unit.h) records the dimension split over the group, or -1 when replicated:
//   column-parallel linear  (linear_qkv, linear_fc1, vocab-parallel output)  weight dim 0, bias dim 0
//   row-parallel linear     (linear_proj, linear_fc2)                         weight dim 1, bias replicated
//   vocab-parallel embedding                                                   weight dim 0
//   norms, position embeddings                                                 replicated
// linear_qkv's rows are ordered (head, {q,k,v}, head_dim), so a contiguous slice holds whole
// heads. Replicated parameters receive identical gradients on every rank of the group.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fulcrum {

class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// Megatron's f: identity forward, all-reduce (sum) of the gradient backward. Applied to
  /// the input of a column-parallel linear.
  virtual at::Tensor CopyToRegion(const at::Tensor& x) = 0;
  /// Megatron's g: all-reduce (sum) forward, identity backward. Applied to the partial
  /// output of a row-parallel linear.
  virtual at::Tensor ReduceFromRegion(const at::Tensor& x) = 0;
  /// All-gather along the last dimension forward; backward keeps this rank's slice.
  virtual at::Tensor GatherFromRegion(const at::Tensor& x) = 0;

  /// In place, outside autograd: sum / max over the group.
  virtual void AllReduceSum(at::Tensor& t) = 0;
  virtual void AllReduceMax(at::Tensor& t) = 0;
  /// Outside autograd: every rank's `t` concatenated along `dim`, in rank order.
  virtual at::Tensor AllGather(const at::Tensor& t, int64_t dim) = 0;
};

/// The slice of `full` along `dim` that rank `rank` of `size` keeps (contiguous copy).
at::Tensor ShardOf(const at::Tensor& full, int64_t dim, int rank, int size);

/// Cross-entropy of vocab-parallel logits [..., V/size] (this rank's columns start at
/// vocab_start) against global targets [...]: per-token losses [...], with the full
/// softmax never gathered. With a null group it is the ordinary cross-entropy.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_start, TensorParallelGroup* group);

}  // namespace fulcrum
