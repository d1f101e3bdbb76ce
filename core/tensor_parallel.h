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
// heads. Replicated parameters receive identical gradients on every rank of the group —
// except, under --sequence_parallel, those used on sequence shards (NOTE [sequence
// parallelism] below), whose gradients are summed over the group at the step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

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

  // The sequence-parallel mappings (NOTE [sequence parallelism]): x is [s/size, ...], this
  // rank's rows of a [s, ...] tensor; every rank holds the same number of rows.
  /// Megatron's g-bar under sequence parallelism: all-gather along dimension 0 forward,
  /// reduce-scatter (sum) of the gradient backward. The input of a column-parallel linear,
  /// whose gradient is a partial sum on every rank.
  virtual at::Tensor GatherSequence(const at::Tensor& x) = 0;
  /// Reduce-scatter (sum) along dimension 0 forward, all-gather of the gradient backward.
  /// The partial output of a row-parallel linear.
  virtual at::Tensor ReduceScatterSequence(const at::Tensor& x) = 0;
  /// All-gather along dimension 0 forward, this rank's rows of the gradient backward: for a
  /// consumer whose gradient arrives whole and equal on every rank.
  virtual at::Tensor GatherSequenceWhole(const at::Tensor& x) = 0;
  /// This rank's rows forward, all-gather of the gradient backward: a tensor equal on every
  /// rank back onto its sequence shards.
  virtual at::Tensor ScatterSequence(const at::Tensor& x) = 0;

  /// In place, outside autograd: sum / max over the group.
  virtual void AllReduceSum(at::Tensor& t) = 0;
  virtual void AllReduceMax(at::Tensor& t) = 0;
  /// Outside autograd: every rank's `t` concatenated along `dim`, in rank order.
  virtual at::Tensor AllGather(const at::Tensor& t, int64_t dim) = 0;
};

// NOTE [sequence parallelism]
// --sequence_parallel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
// Transformer Models", §4.2.2): between the tensor-parallel regions — the norms, the
// dropouts, the residual adds, the embedding's sum and the head's norm — each rank of the
// group holds only its s/tp rows of the [s, b, h] residual stream, so those activations
// shrink by tp. A region is entered by an all-gather along the sequence (instead of f's
// copy) and left by a reduce-scatter (instead of g's all-reduce): the bytes on the wire
// are those of the all-reduce it replaces. The policy lives in TensorParallelRegions; the
// model code asks it at each region's edge, so the layers do not spell it out twice.
//
// What changes besides the activations' shapes:
//  * Replicated parameters used on the shards (the norms, the row-parallel biases, the
//    learned position embeddings) receive on each rank the gradient of its rows only:
//    ShardingSpec::sequence_parallel marks them, and ParallelContext::
//    AllReduceModelParallelGradients sums them over the group before any other reduction.
//  * Dropout masks stay a function of the whole tensor (NOTE [layout-independent
//    randomness]): a rank draws the [s, ...] mask and keeps its rows, so any layout drops
//    the same elements as one process (the price: every rank draws the whole mask).
//  * A feed-forward block (core/feed_forward.h: MoE) sees the whole sequence as before:
//    GatherSequenceWhole before, ScatterSequence after. Its internals are unchanged.
//  * Pipeline stages exchange the [s/tp, b, h] shards.
// Plugins that read or edit hidden states themselves declare Plugin::
// SupportsSequenceParallel(); the others are refused by name.

/// Where activations enter and leave tensor-parallel regions: Megatron's f and g, or with
/// sequence parallelism their sequence-sharded forms (NOTE [sequence parallelism]). With a
/// null group every edge is the identity.
class TensorParallelRegions {
 public:
  TensorParallelRegions() = default;
  /// `sequence_parallel` takes effect only with a group of more than one rank.
  TensorParallelRegions(TensorParallelGroup* tp, bool sequence_parallel)
      : tp_(tp), sequence_parallel_(sequence_parallel && tp != nullptr && tp->size() > 1) {}

  bool sequence_parallel() const { return sequence_parallel_; }
  /// The input of a column-parallel linear: f, or the sequence gathered.
  at::Tensor EnterColumnParallel(const at::Tensor& x) const;
  /// The partial output of a row-parallel linear: g, or reduce-scattered over the sequence.
  at::Tensor LeaveRowParallel(const at::Tensor& partial) const;
  /// The whole sequence for a block that computes on it replicated (its gradient arrives
  /// whole on every rank); `x` itself without sequence parallelism.
  at::Tensor WholeSequence(const at::Tensor& x) const;
  /// This rank's rows of a replicated [s, ...] tensor; `x` itself without sequence
  /// parallelism.
  at::Tensor OwnSequence(const at::Tensor& x) const;
  /// The rows of a [s, ...] tensor this rank holds between regions: [begin, begin + length).
  /// InvalidArgument-style TORCH_CHECK when s is not a multiple of the group's size.
  std::pair<int64_t, int64_t> SequenceRows(int64_t s) const;
  /// The length of the whole sequence whose shard has `local` rows.
  int64_t WholeSequenceLength(int64_t local) const {
    return sequence_parallel_ ? local * tp_->size() : local;
  }

 private:
  TensorParallelGroup* tp_ = nullptr;
  bool sequence_parallel_ = false;
};

/// The slice of `full` along `dim` that rank `rank` of `size` keeps: a contiguous copy with
/// storage of its own (never a view of `full`), or `full` itself when size is 1 or dim < 0.
at::Tensor ShardOf(const at::Tensor& full, int64_t dim, int rank, int size);

/// Cross-entropy of vocab-parallel logits [..., V/size] (this rank's columns start at
/// vocab_start) against global targets [...]: per-token losses [...], with the full
/// softmax never gathered. With a null group it is the ordinary cross-entropy.
at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_start, TensorParallelGroup* group);

}  // namespace fulcrum
