#include "core/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

namespace fulcrum {
namespace {

// Megatron's vocab-parallel cross-entropy (Shoeybi et al. 2019, §3): per-token statistics
// (max logit, Σexp, the target's logit) are reduced over the group, so only [tokens]-sized
// tensors cross the wire; the softmax itself stays sharded for the backward.
class VocabParallelCrossEntropyFunction
    : public torch::autograd::Function<VocabParallelCrossEntropyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t vocab_start,
                            TensorParallelGroup* group) {
    const int64_t local_vocab = logits.size(-1);
    // At least fp32 (half logits are widened); fp64 stays fp64.
    at::Tensor flat =
        logits.reshape({-1, local_vocab}).to(at::promote_types(logits.scalar_type(), at::kFloat));
    at::Tensor flat_targets = targets.reshape({-1});

    at::Tensor max = std::get<0>(flat.max(-1));
    group->AllReduceMax(max);
    at::Tensor shifted = flat - max.unsqueeze(1);

    at::Tensor in_range = (flat_targets >= vocab_start).logical_and_(
        flat_targets < vocab_start + local_vocab);
    at::Tensor local_index = (flat_targets - vocab_start).masked_fill_(in_range.logical_not(), 0);
    at::Tensor target_logit =
        shifted.gather(1, local_index.unsqueeze(1)).squeeze(1).masked_fill_(in_range.logical_not(), 0.0);
    group->AllReduceSum(target_logit);

    at::Tensor exp = shifted.exp();
    at::Tensor sum_exp = exp.sum(-1);
    group->AllReduceSum(sum_exp);
    at::Tensor loss = sum_exp.log() - target_logit;

    at::Tensor softmax = exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, in_range, local_index});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.view(targets.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    // The softmax [tokens, V/size] is this function's own (NOTE [cross-entropy backward in
    // place]): it becomes the gradient.
    at::Tensor grad = saved[0];
    const at::Tensor& in_range = saved[1];
    const at::Tensor& local_index = saved[2];
    // d loss / d logit = softmax − one_hot(target) on the rank that holds the target.
    grad.scatter_add_(1, local_index.unsqueeze(1), in_range.to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(grads[0].reshape({-1, 1}));
    return {grad.view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// NOTE [cross-entropy backward in place]
// The cross-entropy of one rank's logits [tokens, V] as one autograd node instead of
// LibTorch's log_softmax + nll_loss pair. The forward is the same vectorised log_softmax and
// a gather; it saves the log-probabilities, which nothing else holds, so the backward turns
// them into the gradient in place — exp, subtract 1 at the targets, scale each row by its
// token's incoming gradient — two passes over [tokens, V]. LibTorch's pair zero-fills a
// fresh [tokens, V] buffer for nll_loss's gradient and makes another for log_softmax's
// (31 MiB each at gpt_8k; docs/PERF.md). A second backward through the same graph
// (retain_graph) fails on the saved tensor's version check instead of computing garbage.
class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets) {
    const int64_t vocab = logits.size(-1);
    at::Tensor flat_targets = targets.reshape({-1, 1});
    TORCH_CHECK(flat_targets.numel() == 0 ||
                    (flat_targets.min().item<int64_t>() >= 0 &&
                     flat_targets.max().item<int64_t>() < vocab),
                "cross-entropy: a target is outside the vocabulary [0, ", vocab, ")");
    at::Tensor log_probs = at::log_softmax(logits.reshape({-1, vocab}), 1);
    at::Tensor loss = log_probs.gather(1, flat_targets).squeeze(1).neg();
    ctx->save_for_backward({log_probs, flat_targets});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.view(targets.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].exp_();  // softmax, in place
    const at::Tensor& flat_targets = saved[1];
    grad.scatter_add_(1, flat_targets,
                      at::full({flat_targets.size(0), 1}, -1.0, grad.options()));
    grad.mul_(grads[0].reshape({-1, 1}));
    return {grad.view(ctx->saved_data["shape"].toIntVector()), at::Tensor()};
  }
};

}  // namespace

at::Tensor TensorParallelRegions::EnterColumnParallel(const at::Tensor& x) const {
  if (tp_ == nullptr) return x;
  return sequence_parallel_ ? tp_->GatherSequence(x) : tp_->CopyToRegion(x);
}

at::Tensor TensorParallelRegions::LeaveRowParallel(const at::Tensor& partial) const {
  if (tp_ == nullptr) return partial;
  return sequence_parallel_ ? tp_->ReduceScatterSequence(partial) : tp_->ReduceFromRegion(partial);
}

at::Tensor TensorParallelRegions::WholeSequence(const at::Tensor& x) const {
  return sequence_parallel_ ? tp_->GatherSequenceWhole(x) : x;
}

at::Tensor TensorParallelRegions::OwnSequence(const at::Tensor& x) const {
  return sequence_parallel_ ? tp_->ScatterSequence(x) : x;
}

std::pair<int64_t, int64_t> TensorParallelRegions::SequenceRows(int64_t s) const {
  if (!sequence_parallel_) return {0, s};
  TORCH_CHECK(s % tp_->size() == 0, "--sequence_parallel: a sequence of ", s,
              " tokens does not split over ", tp_->size(), " tensor-parallel ranks");
  const int64_t rows = s / tp_->size();
  return {tp_->rank() * rows, rows};
}

at::Tensor ShardOf(const at::Tensor& full, int64_t dim, int rank, int size) {
  if (size == 1 || dim < 0) return full;
  TORCH_CHECK(full.size(dim) % size == 0, "cannot shard dimension ", dim, " of size ",
              full.size(dim), " over ", size, " ranks");
  const int64_t chunk = full.size(dim) / size;
  // A copy in every case: a slice along dimension 0 is already contiguous, and contiguous()
  // would hand back a view holding the whole tensor's storage.
  return full.narrow(dim, rank * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

at::Tensor VocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_start, TensorParallelGroup* group) {
  if (group == nullptr || group->size() == 1) {
    // The loss computes in at least fp32 (bf16 logits are widened, as the vocab-parallel
    // path does): the softmax over the vocabulary is where bf16 would lose the most.
    return CrossEntropyFunction::apply(
        logits.to(at::promote_types(logits.scalar_type(), at::kFloat)), targets);
  }
  return VocabParallelCrossEntropyFunction::apply(logits, targets, vocab_start, group);
}

}  // namespace fulcrum
