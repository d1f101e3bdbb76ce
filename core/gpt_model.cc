#include "core/gpt_model.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "core/linear.h"
#include "core/status.h"

namespace fulcrum {

StageSpec EvenStage(int64_t num_layers, int stages, int stage) {
  const int64_t base = num_layers / stages;
  const int64_t extra = num_layers % stages;
  StageSpec spec;
  spec.layer_begin = stage * base + std::min<int64_t>(stage, extra);
  spec.layer_end = spec.layer_begin + base + (stage < extra ? 1 : 0);
  spec.has_embedding = stage == 0;
  spec.has_head = stage == stages - 1;
  return spec;
}

StageSpec StageOfChunks(const std::vector<std::pair<int64_t, int64_t>>& virtual_ranges,
                        const std::vector<std::pair<int, int>>& owners, int stage) {
  TORCH_CHECK(!virtual_ranges.empty() && virtual_ranges.size() == owners.size(),
              virtual_ranges.size(), " layer ranges for ", owners.size(), " virtual stages");
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (size_t k = 0; k < owners.size(); ++k) {
    if (owners[k].first != stage) continue;
    const int chunk = owners[k].second;
    TORCH_CHECK(chunk >= 0 && chunk < static_cast<int>(owners.size()), "virtual stage ", k,
                " is chunk ", chunk);
    if (static_cast<int>(chunks.size()) <= chunk) chunks.resize(chunk + 1, {-1, -1});
    chunks[chunk] = virtual_ranges[k];
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    TORCH_CHECK(chunks[c].first >= 0, "stage ", stage, " holds no chunk ", c);
  }
  StageSpec spec;
  spec.has_embedding = owners.front().first == stage;
  spec.has_head = owners.back().first == stage;
  if (chunks.size() == 1) {
    spec.layer_begin = chunks[0].first;
    spec.layer_end = chunks[0].second;
  } else {
    spec.chunk_ranges = std::move(chunks);
  }
  return spec;
}

GptModel::GptModel(const ModelOptions& options, const StageSpec& stage, TensorParallelGroup* tp,
                   FeedForwardFactory feed_forward)
    : GptModel(options, stage, tp,
               feed_forward ? std::make_shared<FeedForwardCustomizer>(std::move(feed_forward))
                            : nullptr) {}

GptModel::GptModel(const ModelOptions& options, const StageSpec& stage, TensorParallelGroup* tp,
                   std::shared_ptr<LayerCustomizer> customizer)
    : options_(options), tp_(tp), customizer_(std::move(customizer)) {
  const int tp_size = tp ? tp->size() : 1;
  TORCH_CHECK(options.num_attention_heads % tp_size == 0 && options.query_groups() % tp_size == 0 &&
                  options.ffn_hidden_size % tp_size == 0 && options.vocab_size % tp_size == 0,
              "heads (", options.num_attention_heads, "), query groups (", options.query_groups(),
              "), ffn size (", options.ffn_hidden_size, ") and vocabulary (", options.vocab_size,
              ") must be divisible by tp=", tp_size);
  if (stage.has_embedding) embedding_ = std::make_unique<Embedding>(options, tp);
  if (stage.chunk_ranges.empty()) {
    const int64_t end = stage.layer_end < 0 ? options.num_layers : stage.layer_end;
    TORCH_CHECK(0 <= stage.layer_begin && stage.layer_begin <= end && end <= options.num_layers,
                "stage layer range [", stage.layer_begin, ", ", end, ") is outside [0, ",
                options.num_layers, ")");
    layer_begin_ = stage.layer_begin;
    layer_end_ = end;
    for (int64_t i = stage.layer_begin; i < end; ++i) {
      layers_.emplace(i, std::make_unique<TransformerLayer>(options, i, tp, /*initialize=*/true,
                                                            customizer_.get()));
    }
  } else {
    // NOTE [model chunks]: every chunk's layers; each layer's initial values depend on its
    // global index only (NOTE [layer migration]), so the chunks match one process's model.
    const absl::Status valid = set_chunk_ranges(stage.chunk_ranges);
    TORCH_CHECK(valid.ok(), valid.message());
    for (const auto& [begin, end] : chunk_ranges_) {
      for (int64_t i = begin; i < end; ++i) {
        layers_.emplace(i, std::make_unique<TransformerLayer>(options, i, tp, /*initialize=*/true,
                                                              customizer_.get()));
      }
    }
    layer_begin_ = chunk_ranges_.front().first;
    layer_end_ = chunk_ranges_.front().second;
    UpdateRange();
  }
  if (stage.has_head) {
    head_ = std::make_unique<Head>(options, tp,
                                   /*mirror_word_embeddings=*/options.tie_embeddings && !stage.has_embedding);
  }
}

std::vector<Unit*> GptModel::Units() const {
  std::vector<Unit*> units;
  if (embedding_) units.push_back(embedding_.get());
  for (const auto& [index, layer] : layers_) units.push_back(layer.get());
  if (head_) units.push_back(head_.get());
  return units;
}

int64_t GptModel::NumParameterElements() const {
  int64_t n = 0;
  for (Unit* unit : Units()) n += unit->NumParameterElements();
  return n;
}

absl::StatusOr<std::unique_ptr<TransformerLayer>> GptModel::TakeLayer(int64_t index) {
  auto it = layers_.find(index);
  if (it == layers_.end()) {
    return absl::NotFoundError(absl::StrCat("this stage does not hold layer ", index, " (it holds ",
                                            layers_.size(), " layers in [", layer_begin_, ", ",
                                            layer_end_, "))"));
  }
  std::unique_ptr<TransformerLayer> layer = std::move(it->second);
  layers_.erase(it);
  UpdateRange();
  return layer;
}

absl::Status GptModel::InsertLayer(std::unique_ptr<TransformerLayer> layer) {
  const int64_t index = layer->layer_index();
  if (index < 0 || index >= options_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", index, " is outside [0, ", options_.num_layers, ")"));
  }
  if (!layers_.emplace(index, std::move(layer)).second) {
    return absl::AlreadyExistsError(absl::StrCat("this stage already holds layer ", index));
  }
  UpdateRange();
  return absl::OkStatus();
}

absl::Status GptModel::CheckRange(int64_t begin, int64_t end) const {
  const bool contiguous = layers_.empty() || static_cast<int64_t>(layers_.size()) ==
                                                 layers_.rbegin()->first - layers_.begin()->first + 1;
  if (contiguous && layer_begin_ == begin && layer_end_ == end &&
      static_cast<int64_t>(layers_.size()) == end - begin) {
    return absl::OkStatus();
  }
  std::string held;
  for (const auto& [index, layer] : layers_) absl::StrAppend(&held, held.empty() ? "" : ",", index);
  return absl::FailedPreconditionError(absl::StrCat("the stage should hold layers [", begin, ", ",
                                                    end, ") but holds {", held, "}"));
}

std::pair<int64_t, int64_t> GptModel::chunk_range(int chunk) const {
  TORCH_CHECK(0 <= chunk && chunk < num_chunks(), "chunk ", chunk, " of a stage holding ",
              num_chunks());
  if (chunk_ranges_.empty()) return {layer_begin_, layer_end_};
  return chunk_ranges_[chunk];
}

absl::Status GptModel::set_chunk_ranges(std::vector<std::pair<int64_t, int64_t>> ranges) {
  if (ranges.empty()) return absl::InvalidArgumentError("a stage holds at least one chunk");
  for (size_t c = 0; c < ranges.size(); ++c) {
    const auto [begin, end] = ranges[c];
    if (begin < 0 || begin > end || end > options_.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", c, "'s layer range [", begin, ", ",
                                                     end, ") is outside [0, ",
                                                     options_.num_layers, ")"));
    }
    for (size_t d = 0; d < c; ++d) {
      if (begin < ranges[d].second && ranges[d].first < end) {
        return absl::InvalidArgumentError(absl::StrCat("chunks ", d, " and ", c, " overlap: [",
                                                       ranges[d].first, ", ", ranges[d].second,
                                                       ") and [", begin, ", ", end, ")"));
      }
    }
  }
  chunk_ranges_ = std::move(ranges);
  return absl::OkStatus();
}

absl::Status GptModel::CheckChunkRanges() const {
  if (chunk_ranges_.empty()) return CheckRange(layer_begin_, layer_end_);
  int64_t expected = 0;
  for (const auto& [begin, end] : chunk_ranges_) expected += end - begin;
  bool ok = static_cast<int64_t>(layers_.size()) == expected;
  for (const auto& [begin, end] : chunk_ranges_) {
    for (int64_t i = begin; ok && i < end; ++i) ok = layers_.count(i) == 1;
  }
  if (ok) return absl::OkStatus();
  std::string held, want;
  for (const auto& [index, layer] : layers_) absl::StrAppend(&held, held.empty() ? "" : ",", index);
  for (const auto& [begin, end] : chunk_ranges_) {
    absl::StrAppend(&want, want.empty() ? "" : " ", "[", begin, ", ", end, ")");
  }
  return absl::FailedPreconditionError(absl::StrCat("the stage's chunks should hold layers ", want,
                                                    " but it holds {", held, "}"));
}

void GptModel::UpdateRange() {
  if (layers_.empty()) {
    layer_end_ = layer_begin_;
    return;
  }
  layer_begin_ = layers_.begin()->first;
  layer_end_ = layers_.rbegin()->first + 1;
}

std::unique_ptr<TransformerLayer> GptModel::NewLayerShell(int64_t index) const {
  return std::make_unique<TransformerLayer>(options_, index, tp_, /*initialize=*/false,
                                            customizer_.get());
}

int64_t GptModel::local_sequence_length() const {
  return TensorParallelRegions(tp_, options_.sequence_parallel).SequenceRows(options_.seq_length).second;
}

at::Tensor GptModel::Embed(const at::Tensor& tokens, const ForwardContext& ctx) const {
  TORCH_CHECK(embedding_, "this stage holds no embedding");
  std::optional<at::NoGradGuard> frozen;
  if (frozen_prefix_ > 0) frozen.emplace();  // NOTE [frozen prefix]
  return embedding_->Forward(tokens, ctx);
}

at::Tensor GptModel::ForwardLayers(at::Tensor hidden, const ForwardContext& ctx) const {
  TORCH_CHECK(static_cast<int64_t>(layers_.size()) == layer_end_ - layer_begin_,
              "the stage's layers [", layer_begin_, ", ", layer_end_, ") have gaps");
  int64_t position = 0;
  for (const auto& [index, layer] : layers_) hidden = ForwardLayer(*layer, position++, hidden, ctx);
  return hidden;
}

at::Tensor GptModel::ForwardLayer(const TransformerLayer& layer, int64_t position,
                                  const at::Tensor& hidden, const ForwardContext& ctx) const {
  const bool recompute = options_.recompute_layers && ctx.training &&
                         (options_.recompute_num_layers == 0 || position < options_.recompute_num_layers);
  WeightGradStore::TagScope tag(layer.layer_index());  // NOTE [weight-gradient tags]
  return recompute ? RecomputedForward(layer, hidden, ctx) : layer.Forward(hidden, ctx);
}

absl::Status GptModel::ReportFinalGradients(
    int64_t begin, int64_t end, bool with_head, bool with_embedding,
    const std::function<void(std::optional<int64_t> tag)>& run_weight_grads,
    const std::function<absl::Status(const Unit&)>& report) const {
  if (run_weight_grads) run_weight_grads(WeightGradStore::kNoTag);
  if (with_head && head_) FULCRUM_RETURN_IF_ERROR(report(*head_));
  for (auto it = layers_.lower_bound(end); it != layers_.lower_bound(begin);) {
    --it;
    if (run_weight_grads) run_weight_grads(it->first);
    FULCRUM_RETURN_IF_ERROR(report(*it->second));
  }
  if (run_weight_grads) run_weight_grads(std::nullopt);
  if (with_embedding && embedding_) {
    // NOTE [tied head on the embedding's rank]: the head's last W ran before this chunk's
    // (ZB-V: the head's chunk finishes its backward first).
    FoldTiedHeadGradient();
    FULCRUM_RETURN_IF_ERROR(report(*embedding_));
  }
  return absl::OkStatus();
}

at::Tensor GptModel::ForwardLayers(at::Tensor hidden, const ForwardContext& ctx, int64_t begin,
                                   int64_t end) const {
  for (int64_t i = begin; i < end; ++i) {
    auto it = layers_.find(i);
    TORCH_CHECK(it != layers_.end(), "the stage does not hold layer ", i, " of the range [",
                begin, ", ", end, ")");
    hidden = ForwardLayer(*it->second, i - begin, hidden, ctx);
  }
  return hidden;
}

LossSum GptModel::HeadLoss(const at::Tensor& hidden, const at::Tensor& labels) const {
  TORCH_CHECK(head_, "this stage holds no head");
  at::Tensor tied;
  if (embedding_ && options_.tie_embeddings) {
    tied = embedding_->word_embeddings();
    if (num_chunks() > 1) {  // NOTE [tied head on the embedding's rank]
      // One handle for the whole training run (a fresh one per iteration would leave a
      // stale bf16 compute copy behind on a GPU each time: core/linear.cc keys them by the
      // tensor); made again only when the embedding's storage changed.
      if (!tied_head_weight_.defined() || tied_head_weight_.data_ptr() != tied.data_ptr() ||
          !tied_head_weight_.sizes().equals(tied.sizes()) ||
          tied_head_weight_.scalar_type() != tied.scalar_type() ||
          tied_head_weight_.device() != tied.device()) {
        tied_head_weight_ = tied.detach();
      }
      if (tied_head_weight_.requires_grad() != tied.requires_grad()) {
        tied_head_weight_.requires_grad_(tied.requires_grad());
      }
      tied = tied_head_weight_;
    }
  }
  at::Tensor losses = head_->TokenLosses(hidden, tied, labels.t());  // [s, b]
  return LossSum{losses.sum(), losses.numel()};
}

void GptModel::FoldTiedHeadGradient() const {
  if (!tied_head_weight_.defined()) return;
  const at::Tensor head_grad = tied_head_weight_.grad();
  if (!head_grad.defined()) return;  // No backward ran since the last fold (an evaluation).
  tied_head_weight_.mutable_grad() = at::Tensor();  // The next run gathers afresh.
  at::Tensor& grad = const_cast<at::Tensor&>(embedding_->word_embeddings()).mutable_grad();
  if (grad.defined()) {
    grad.add_(head_grad);  // Σ embedding + Σ head, as the all-reduce of a mirror forms it.
  } else {
    grad = head_grad;  // The embedding's input side is frozen (NOTE [frozen prefix]).
  }
}

int64_t GptModel::TiedHeadGradientBytes() const {
  if (!embedding_ || !head_ || !options_.tie_embeddings || num_chunks() < 2) return 0;
  const at::Tensor& weight = embedding_->word_embeddings();
  if (!weight.requires_grad()) return 0;  // frozen: the head's handle gathers nothing
  return weight.numel() * static_cast<int64_t>(weight.element_size());
}

bool GptModel::needs_token_positions() const {
  for (const auto& [index, layer] : layers_) {
    if (layer->feed_forward() != nullptr && layer->feed_forward()->needs_token_positions()) return true;
  }
  return false;
}

LossSum GptModel::ForwardLoss(const at::Tensor& tokens, const ForwardContext& ctx) const {
  TORCH_CHECK(embedding_ && head_ && static_cast<int64_t>(layers_.size()) == options_.num_layers,
              "ForwardLoss needs the whole model on one stage");
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 2, "tokens must be [batch, seq+1], got ",
              tokens.sizes());
  const int64_t s = tokens.size(1) - 1;
  at::Tensor inputs = tokens.narrow(1, 0, s);
  at::Tensor labels = tokens.narrow(1, 1, s);
  ForwardContext local = ctx;  // the micro-batch starts without carried state
  local.token_state = at::Tensor();
  // Plugins that read labels (early exit) compute on the model's device.
  if (needs_labels()) local.labels = labels.t().to(options_.device_spec.device);
  at::Tensor hidden = Embed(inputs, local);
  hidden = ForwardLayers(std::move(hidden), local);
  return HeadLoss(hidden, labels);
}

std::vector<std::vector<std::pair<int64_t, int64_t>>> GatherChunkRanges(
    const GptModel& stage, int num_chunks,
    const std::function<at::Tensor(const at::Tensor& row)>& stack) {
  at::Tensor mine = at::zeros({2 * num_chunks}, at::kLong);
  for (int c = 0; c < num_chunks && c < stage.num_chunks(); ++c) {
    mine[2 * c] = stage.chunk_range(c).first;
    mine[2 * c + 1] = stage.chunk_range(c).second;
  }
  const at::Tensor all = stack(mine).contiguous();  // [stages, 2·num_chunks]
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(all.size(0));
  for (int64_t s = 0; s < all.size(0); ++s) {
    for (int c = 0; c < num_chunks; ++c) {
      ranges[s].emplace_back(all[s][2 * c].item<int64_t>(), all[s][2 * c + 1].item<int64_t>());
    }
  }
  return ranges;
}

void GptModel::ZeroGrad() {
  for (Unit* unit : Units()) unit->ZeroGrad();
  // An unfolded head gradient goes with the rest (the handle stays).
  if (tied_head_weight_.defined()) tied_head_weight_.mutable_grad() = at::Tensor();
}

}  // namespace fulcrum
