// GptModel: the units a process holds, in global order — the embedding (first stage),
// a contiguous range of transformer layers [begin, end), and the head (last stage). A
// single process holds all of them. The pipeline engine gives each stage its range and
// changes it at run time; nothing here depends on where a range starts (invariant 1).
//
// Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "core/config.h"
#include "core/transformer_layer.h"
#include "core/unit.h"

namespace fulcrum {

/// Which part of the model a process holds.
struct StageSpec {
  int64_t layer_begin = 0;   // First global layer index held.
  int64_t layer_end = -1;    // One past the last; -1 = num_layers.
  bool has_embedding = true;
  bool has_head = true;
};

/// Loss of one micro-batch: the sum of token cross-entropies (an autograd scalar) and the
/// number of tokens it covers. The trainer divides by the global batch's token count.
struct LossSum {
  at::Tensor sum;
  int64_t tokens = 0;
};

class GptModel {
 public:
  /// `tp` (may be null: one rank) must outlive the model.
  explicit GptModel(const ModelOptions& options, const StageSpec& stage = StageSpec(),
                    TensorParallelGroup* tp = nullptr);

  const ModelOptions& options() const { return options_; }

  /// Every unit held, in global order: embedding, layers ascending, head.
  std::vector<Unit*> Units() const;

  Embedding* embedding() const { return embedding_.get(); }
  Head* head() const { return head_.get(); }
  const std::map<int64_t, std::unique_ptr<TransformerLayer>>& layers() const { return layers_; }

  /// Total parameter scalars held by this rank (a tied output weight counts once).
  int64_t NumParameterElements() const;
  /// Parameter scalars of the whole model (shards counted at full size).
  int64_t NumModelParameterElements() const;
  TensorParallelGroup* tensor_parallel() const { return tp_; }

  /// Whole-model forward of a micro-batch. `tokens` is [b, s+1]: inputs are the first s
  /// columns, labels the last s. Needs the embedding, every layer and the head.
  LossSum ForwardLoss(const at::Tensor& tokens, const ForwardContext& ctx) const;

  /// Runs the held layers in order on hidden [s, b, h].
  at::Tensor ForwardLayers(at::Tensor hidden, const ForwardContext& ctx) const;

  /// Sum of cross-entropy of head logits against labels [b, s].
  LossSum HeadLoss(const at::Tensor& hidden, const at::Tensor& labels) const;

  void ZeroGrad();

 private:
  ModelOptions options_;
  TensorParallelGroup* tp_;
  std::unique_ptr<Embedding> embedding_;
  std::map<int64_t, std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<Head> head_;
};

}  // namespace fulcrum
