#include "core/gpt_model.h"

namespace fulcrum {

GptModel::GptModel(const ModelOptions& options, const StageSpec& stage) : options_(options) {
  const int64_t end = stage.layer_end < 0 ? options.num_layers : stage.layer_end;
  TORCH_CHECK(0 <= stage.layer_begin && stage.layer_begin <= end && end <= options.num_layers,
              "stage layer range [", stage.layer_begin, ", ", end, ") is outside [0, ",
              options.num_layers, ")");
  TORCH_CHECK(!(options.tie_embeddings && stage.has_head && !stage.has_embedding),
              "a tied output layer on a stage without the embedding is not supported yet");
  if (stage.has_embedding) embedding_ = std::make_unique<Embedding>(options);
  for (int64_t i = stage.layer_begin; i < end; ++i) {
    layers_.emplace(i, std::make_unique<TransformerLayer>(options, i));
  }
  if (stage.has_head) head_ = std::make_unique<Head>(options);
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

at::Tensor GptModel::ForwardLayers(at::Tensor hidden, const ForwardContext& ctx) const {
  for (const auto& [index, layer] : layers_) hidden = layer->Forward(hidden, ctx);
  return hidden;
}

LossSum GptModel::HeadLoss(const at::Tensor& hidden, const at::Tensor& labels) const {
  TORCH_CHECK(head_, "this stage holds no head");
  at::Tensor logits = head_->Logits(
      hidden, embedding_ ? embedding_->word_embeddings() : at::Tensor());  // [s, b, V]
  const int64_t vocab = logits.size(-1);
  at::Tensor flat_labels = labels.t().reshape({-1});  // [s·b] in the logits' order
  at::Tensor sum = at::cross_entropy_loss(logits.reshape({-1, vocab}), flat_labels,
                                          /*weight=*/{}, at::Reduction::Sum);
  return LossSum{sum, flat_labels.numel()};
}

LossSum GptModel::ForwardLoss(const at::Tensor& tokens, const ForwardContext& ctx) const {
  TORCH_CHECK(embedding_ && head_ && static_cast<int64_t>(layers_.size()) == options_.num_layers,
              "ForwardLoss needs the whole model on one stage");
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 2, "tokens must be [batch, seq+1], got ",
              tokens.sizes());
  const int64_t s = tokens.size(1) - 1;
  at::Tensor inputs = tokens.narrow(1, 0, s);
  at::Tensor labels = tokens.narrow(1, 1, s);
  at::Tensor hidden = embedding_->Forward(inputs, ctx);
  hidden = ForwardLayers(std::move(hidden), ctx);
  return HeadLoss(hidden, labels);
}

void GptModel::ZeroGrad() {
  for (Unit* unit : Units()) unit->ZeroGrad();
}

}  // namespace fulcrum
