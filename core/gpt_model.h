// GptModel: the units a process holds, in global order — the embedding (first stage),
// a contiguous range of transformer layers [begin, end), and the head (last stage). A
// single process holds all of them. The pipeline engine gives each stage its range and
// changes it at run time; nothing here depends on where a range starts (invariant 1).
//
// NOTE [layer migration]
// A stage's range changes by whole layers: TakeLayer takes a layer out of the stage, its
// MigrationTensors() (values, gradients, Adam moments, step, block state — invariant 2)
// travel to the layer's new stage, any distance away, which builds a shell with
// NewLayerShell, restores it with LoadMigrationTensors and InsertLayer()s it. While a plan
// is carried out a stage's layers may have gaps (or none at all); once every move of the
// plan is done they form the plan's contiguous range again (CheckRange). The arithmetic of
// training never sees where a layer runs: its initial values, dropout masks and optimizer
// update depend only on its global identity and state, so moving layers leaves every loss
// bit-identical (invariant 3).
//
// NOTE [model chunks]
// With virtual pipeline stages (interleaved 1F1B, ZB-V; pipeline/schedule.h) a rank holds v
// model chunks, each a contiguous range of layers, not adjacent to each other (chunk c of
// rank r is one virtual stage of the p·v in model order). One GptModel holds them all: its
// layers map is the union, with gaps between the chunks; ForwardLayers(hidden, ctx, begin,
// end) runs one chunk's layers. Units(), checkpoints, the optimizer and the gradient
// reduction see the held layers and never ask where a chunk starts, so they need nothing
// new. The chunk ranges are the placement's (set at construction, and by set_chunk_ranges
// when layers move); layer_begin()/layer_end() stay the span of all held layers.
//
// Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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
  /// With virtual pipeline stages (NOTE [model chunks]): the layer range of each chunk this
  /// rank holds, in chunk order; the single range above is then ignored. Empty: one chunk,
  /// [layer_begin, layer_end).
  std::vector<std::pair<int64_t, int64_t>> chunk_ranges = {};
};

/// Stage `stage` of `stages` in the even split of `num_layers` layers: contiguous ranges,
/// the first num_layers % stages stages one layer longer; the embedding on the first stage,
/// the head on the last.
StageSpec EvenStage(int64_t num_layers, int stages, int stage);

/// NOTE [model chunks]: what `stage` holds when the model is cut into the virtual stages
/// `virtual_ranges` (one layer range per virtual stage, in model order) and virtual stage k
/// is chunk owners[k].second of stage owners[k].first: its chunks' ranges in chunk order,
/// the embedding with virtual stage 0, the head with the last. One chunk gives the plain
/// single-range spec.
StageSpec StageOfChunks(const std::vector<std::pair<int64_t, int64_t>>& virtual_ranges,
                        const std::vector<std::pair<int, int>>& owners, int stage);

class GptModel;

/// NOTE [model chunks]: every pipeline stage's chunk ranges, [stage][chunk] in stage order,
/// each stage's in chunk order, for `num_chunks` chunks per stage (a stage holding fewer
/// gives [0, 0) for the rest). `stack` stacks every stage's int64 row (its chunks' begin
/// and end, [2·num_chunks]) into [stages, 2·num_chunks]: ParallelContext::StackOverPipeline
/// or an all-gather over the pipeline group (collective over that group). The one gather of
/// the placement, for the checkpoint's layer placement and the pipeline's virtual stages.
std::vector<std::vector<std::pair<int64_t, int64_t>>> GatherChunkRanges(
    const GptModel& stage, int num_chunks,
    const std::function<at::Tensor(const at::Tensor& row)>& stack);

/// Loss of one micro-batch: the sum of token cross-entropies (an autograd scalar) and the
/// number of tokens it covers. The trainer divides by the global batch's token count.
struct LossSum {
  at::Tensor sum;
  int64_t tokens = 0;
};

class GptModel {
 public:
  /// `tp` (may be null: one rank) must outlive the model. `customizer` (may be null) builds
  /// the replaceable parts of every layer and edits it (core/plugin.h: the run's plugins);
  /// it is kept for the layer shells of migrations.
  explicit GptModel(const ModelOptions& options, const StageSpec& stage = StageSpec(),
                    TensorParallelGroup* tp = nullptr,
                    std::shared_ptr<LayerCustomizer> customizer = nullptr);
  /// The same with a customizer that only replaces MLPs (core/feed_forward.h).
  GptModel(const ModelOptions& options, const StageSpec& stage, TensorParallelGroup* tp,
           FeedForwardFactory feed_forward);

  const ModelOptions& options() const { return options_; }

  /// Every unit held, in global order: embedding, layers ascending, head.
  std::vector<Unit*> Units() const;

  Embedding* embedding() const { return embedding_.get(); }
  Head* head() const { return head_.get(); }
  const std::map<int64_t, std::unique_ptr<TransformerLayer>>& layers() const { return layers_; }

  /// The global layer range [layer_begin, layer_end) this stage holds: from its first to
  /// one past its last layer (contiguous outside a plan in progress; empty when it holds
  /// none, then both are where its range began).
  int64_t layer_begin() const { return layer_begin_; }
  int64_t layer_end() const { return layer_end_; }

  /// Takes layer `index`, wherever it is in the range, out of this stage (NOTE [layer
  /// migration]). NotFound when the stage does not hold it.
  absl::StatusOr<std::unique_ptr<TransformerLayer>> TakeLayer(int64_t index);
  /// Puts `layer` into this stage. AlreadyExists when the stage holds that layer.
  absl::Status InsertLayer(std::unique_ptr<TransformerLayer> layer);
  /// OK when the stage holds exactly the layers [begin, end); FailedPrecondition saying
  /// what it holds otherwise.
  absl::Status CheckRange(int64_t begin, int64_t end) const;
  /// NOTE [model chunks]: the number of chunks this rank holds (1 without virtual stages),
  /// and chunk `chunk`'s layer range [begin, end) in the placement.
  int num_chunks() const {
    return chunk_ranges_.empty() ? 1 : static_cast<int>(chunk_ranges_.size());
  }
  std::pair<int64_t, int64_t> chunk_range(int chunk) const;
  /// The chunk whose range holds global layer `layer`, or -1 when none does.
  int chunk_of(int64_t layer) const {
    for (int c = 0; c < num_chunks(); ++c) {
      const auto [begin, end] = chunk_range(c);
      if (layer >= begin && layer < end) return c;
    }
    return -1;
  }
  /// Sets every chunk's range (layer moves between chunks); the ranges must be ascending
  /// within each chunk and not overlap. InvalidArgument otherwise. Does not move layers:
  /// CheckChunkRanges says whether the held layers match.
  absl::Status set_chunk_ranges(std::vector<std::pair<int64_t, int64_t>> ranges);
  /// OK when the stage holds exactly the layers of its chunk ranges; FailedPrecondition
  /// saying what it holds otherwise. With one chunk, CheckRange of its range.
  absl::Status CheckChunkRanges() const;
  /// An uninitialised layer `index` to receive migrated state.
  std::unique_ptr<TransformerLayer> NewLayerShell(int64_t index) const;

  /// Total parameter scalars held by this rank (a tied output weight counts once).
  int64_t NumParameterElements() const;
  TensorParallelGroup* tensor_parallel() const { return tp_; }
  /// The rows of the [seq_length, b, h] residual stream this rank holds between layers and
  /// between pipeline stages: seq_length, or its 1/tp under sequence parallelism (NOTE
  /// [sequence parallelism] in core/tensor_parallel.h).
  int64_t local_sequence_length() const;

  /// NOTE [frozen prefix]
  /// When the embedding lookup and layers [0, k) are frozen (a plugin froze them, front to
  /// back), no gradient needs to flow into them: the embedding runs without autograd, the
  /// frozen layers then build no graph (their parameters and input need no gradient), and
  /// a stage whose layers all lie in the prefix runs no backward at all — it neither waits
  /// for nor sends a gradient. The input-side gradient of tied word embeddings stops too
  /// (they still learn as the output weight). Every rank must set the same k.
  void set_frozen_prefix(int64_t k) { frozen_prefix_ = k; }
  int64_t frozen_prefix() const { return frozen_prefix_; }
  /// Whether this stage's input needs a gradient: a trainable layer comes before it.
  bool input_needs_grad() const { return layer_begin_ > frozen_prefix_; }
  /// Whether this stage's output needs a gradient: it or a stage before it trains a layer,
  /// or it holds the head.
  bool output_needs_grad() const { return layer_end_ > frozen_prefix_ || head_ != nullptr; }
  /// The same for chunk `chunk` (NOTE [model chunks]): its input needs a gradient when a
  /// trainable layer comes before it; its output when it or a chunk before it (in model
  /// order) trains a layer, or it ends the model on the rank with the head.
  bool input_needs_grad(int chunk) const { return chunk_range(chunk).first > frozen_prefix_; }
  bool output_needs_grad(int chunk) const {
    const int64_t end = chunk_range(chunk).second;
    return end > frozen_prefix_ || (head_ != nullptr && end == options_.num_layers);
  }
  /// The embedding of input tokens [b, s] (the first stage; NOTE [frozen prefix]).
  at::Tensor Embed(const at::Tensor& tokens, const ForwardContext& ctx) const;

  /// Whole-model forward of a micro-batch. `tokens` is [b, s+1]: inputs are the first s
  /// columns, labels the last s. Needs the embedding, every layer and the head.
  LossSum ForwardLoss(const at::Tensor& tokens, const ForwardContext& ctx) const;
  /// Whether a layer of this stage reads ForwardContext::token_positions (asked per
  /// micro-batch: layers move between stages).
  bool needs_token_positions() const;

  /// Whether the layers read ForwardContext::labels, and whether they set the carried token
  /// state (NOTE [carried token state]); fixed for the run (the customizer's answer).
  bool needs_labels() const { return customizer_ != nullptr && customizer_->NeedsLabels(); }
  bool carries_token_state() const {
    return customizer_ != nullptr && customizer_->CarriesTokenState();
  }
  /// The token state before any layer set it (LayerCustomizer::InitialTokenState).
  double initial_token_state() const {
    return customizer_ != nullptr ? customizer_->InitialTokenState() : 0.0;
  }

  /// Runs the held layers in order on hidden [s, b, h] (this rank's local_sequence_length()
  /// rows under sequence parallelism). They must be contiguous.
  at::Tensor ForwardLayers(at::Tensor hidden, const ForwardContext& ctx) const;
  /// One layer's forward, `position` its place in its chunk (0: the chunk's first layer):
  /// recomputed in the backward when options().recompute_layers covers that place (NOTE
  /// [activation recomputation] in core/transformer_layer.h). Every layer loop calls it.
  /// Deferred weight gradients it queues carry the layer's index as their tag (NOTE
  /// [weight-gradient tags] in core/linear.h).
  at::Tensor ForwardLayer(const TransformerLayer& layer, int64_t position, const at::Tensor& hidden,
                          const ForwardContext& ctx) const;
  /// Runs the held layers of [begin, end) in order (one chunk: NOTE [model chunks]); they
  /// must be all of [begin, end).
  at::Tensor ForwardLayers(at::Tensor hidden, const ForwardContext& ctx, int64_t begin,
                           int64_t end) const;

  /// Reports the units of one chunk — its layers in [begin, end), the head with
  /// `with_head`, the embedding with `with_embedding` — to `report` as their gradients
  /// become final for the iteration (NOTE [overlapped gradient reduction] in
  /// core/optimizer/overlapped_reduction.h), in the order buckets are cut: the head, the
  /// layers last to first, the embedding. With `run_weight_grads`, the chunk's last deferred
  /// weight gradients are still queued: it is called to run those of one tag (the untagged
  /// ones first, before the head: the head's and the tied embedding's), then of each layer
  /// just before that layer is reported, then with nullopt for any left, before the
  /// embedding. Gradients and their accumulation order are those of one Flush.
  absl::Status ReportFinalGradients(
      int64_t begin, int64_t end, bool with_head, bool with_embedding,
      const std::function<void(std::optional<int64_t> tag)>& run_weight_grads,
      const std::function<absl::Status(const Unit&)>& report) const;

  /// Sum of cross-entropy of head logits against labels [b, s].
  LossSum HeadLoss(const at::Tensor& hidden, const at::Tensor& labels) const;

  void ZeroGrad();

  /// NOTE [tied head on the embedding's rank]
  /// With chunks, one rank may hold both the word embeddings (its first chunk) and the tied
  /// head (its last) — ZB-V's rank 0. Their gradients then meet in one tensor, and the
  /// order in which the schedule runs the embedding's B and the head's W of the micro-
  /// batches would decide its rounding: two orders of one V (a cost-aware one, built from
  /// measured times, and the unit one) would train different bits. So the head's GEMM
  /// there takes a second handle of the same storage, whose gradient gathers the head's
  /// micro-batches alone, and FoldTiedHeadGradient adds it to the embedding's once both
  /// are final: Σ embedding + Σ head, the sum a pipeline with the two on different ranks
  /// forms (mirror, then the all-reduce), so ZB-V trains the bits 1F1B at pp = 2 does, in
  /// any order. Called by the executor before the embedding's gradient is reported and at
  /// the end of every run; a no-op elsewhere (no chunks, untied, or not both here). The
  /// cost: during a run that rank holds a second vocab/tp × h gradient (the one a pipeline
  /// with the two on different ranks keeps on its mirror), counted in the stage's load by
  /// TiedHeadGradientBytes.
  void FoldTiedHeadGradient() const;
  /// The bytes of that second gradient on this rank (NOTE [tied head on the embedding's
  /// rank]): the word embeddings' local size when this stage's chunks hold both ends of a
  /// tied model and the embeddings train; 0 otherwise. The pipeline adds it to the stage's
  /// gradient bytes, so the balancers' and re-packing's memory models count it.
  int64_t TiedHeadGradientBytes() const;

 private:
  // layer_begin_/layer_end_ from the held layers (NOTE [layer migration]).
  void UpdateRange();

  ModelOptions options_;
  TensorParallelGroup* tp_;
  std::shared_ptr<LayerCustomizer> customizer_;
  int64_t frozen_prefix_ = 0;
  int64_t layer_begin_ = 0;
  int64_t layer_end_ = 0;
  // NOTE [model chunks]: one range per chunk; empty for one chunk, whose range is then
  // [layer_begin_, layer_end_) (it follows the held layers, as before chunks).
  std::vector<std::pair<int64_t, int64_t>> chunk_ranges_;
  std::unique_ptr<Embedding> embedding_;
  std::map<int64_t, std::unique_ptr<TransformerLayer>> layers_;
  std::unique_ptr<Head> head_;
  // NOTE [tied head on the embedding's rank]: the head's handle of the word embeddings
  // (their storage and version counter, a gradient of its own, folded and cleared after
  // every run); undefined without chunks or tying.
  mutable at::Tensor tied_head_weight_;
};

}  // namespace fulcrum
