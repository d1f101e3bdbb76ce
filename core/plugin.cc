#include "core/plugin.h"

#include <map>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "core/gpt_model.h"
#include "core/optimizer/adamw.h"
#include "core/parallel_context.h"
#include "core/transformer_layer.h"

namespace fulcrum {
namespace {

// Runs `hook` of every plugin in order; the first error names its plugin.
template <typename Hook>
absl::Status ForEach(const std::vector<std::unique_ptr<Plugin>>& plugins, const char* what,
                     Hook hook) {
  for (const auto& plugin : plugins) {
    absl::Status s = hook(*plugin);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("plugin ", plugin->name(), " (", what, "): ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void PluginContext::SumOverModel(std::vector<double>& values) {
  if (parallel_ != nullptr) parallel_->SumOverModelParallel(values);
}

void PluginContext::SumOverExperts(std::vector<double>& values) {
  if (parallel_ != nullptr) parallel_->SumOverExpertParallel(values);
}

ReducedGradients& PluginContext::gradients() {
  if (gradients_ != nullptr) return *gradients_;
  if (state_parts_) {
    throw std::logic_error(
        "PluginContext::gradients() outside AfterBackward: the reduced gradients exist only "
        "there (NOTE [reduced gradients] in core/optimizer/parameter_parts.h)");
  }
  if (own_gradients_ == nullptr) {
    own_gradients_ = std::make_shared<ReducedGradients>(WholeGradientParts(model_.Units()));
  }
  return *own_gradients_;
}

std::vector<double> PluginContext::LayerGradientSquares() {
  const int64_t num_layers = model_.options().num_layers;
  std::map<const Unit*, int64_t> layer_of;
  for (const auto& [index, layer] : model_.layers()) layer_of[layer.get()] = index;
  // Per layer, its dense and its experts' pieces, each Σ x² as the global norm takes it.
  std::vector<std::vector<at::Tensor>> dense_pieces(num_layers), expert_pieces(num_layers);
  ReducedGradients& reduced = gradients();
  for (const GradientPart& part : reduced.parts()) {
    auto it = layer_of.find(part.unit);
    // NOTE [parameter sharding]: slices on every tensor-parallel rank, replicas once.
    if (it == layer_of.end() ||
        !part.param->sharding.CountedOn(part.unit->tp_rank(), part.unit->tp_size())) {
      continue;
    }
    (part.expert ? expert_pieces : dense_pieces)[it->second].push_back(part.grad);
  }
  std::vector<double> dense(num_layers, 0.0), experts(num_layers, 0.0);
  for (int64_t l = 0; l < num_layers; ++l) {
    dense[l] = AdamW::SumOfSquares(dense_pieces[l]);
    experts[l] = AdamW::SumOfSquares(expert_pieces[l]);
  }
  reduced.SumOverHolders(false, dense);
  reduced.SumOverHolders(true, experts);
  SumOverExperts(experts);
  for (int64_t l = 0; l < num_layers; ++l) dense[l] += experts[l];
  SumOverModel(dense);
  return dense;
}

absl::StatusOr<std::vector<MomentSlice>> PluginContext::OptimizerStateParts() {
  if (state_parts_) return state_parts_();
  return WholeStateParts(model_.Units());
}

int PluginContext::model_parallel_rank() const { return roles_.model_parallel_rank; }

int PluginContext::model_parallel_size() const { return roles_.model_parallel_size; }

bool PluginContext::is_logging_rank() const { return roles_.is_logging_rank; }

std::string PluginSet::Names() const {
  std::string out;
  for (const auto& plugin : plugins_) absl::StrAppend(&out, out.empty() ? "" : ", ", plugin->name());
  return out;
}

std::unique_ptr<FeedForward> PluginSet::MakeFeedForward(int64_t layer, Unit& unit, bool initialize) {
  std::unique_ptr<FeedForward> block;
  const char* builder = nullptr;
  for (const auto& plugin : plugins_) {
    std::unique_ptr<FeedForward> mine = plugin->MakeFeedForward(layer, unit, initialize);
    if (mine == nullptr) continue;
    if (block != nullptr) {
      throw std::logic_error(absl::StrCat("plugins ", builder, " and ", plugin->name(),
                                          " both replace the MLP of layer ", layer));
    }
    block = std::move(mine);
    builder = plugin->name();
  }
  return block;
}

std::unique_ptr<AttentionCore> PluginSet::MakeAttentionCore(int64_t layer, Unit& unit,
                                                            bool initialize) {
  std::unique_ptr<AttentionCore> core;
  const char* builder = nullptr;
  for (const auto& plugin : plugins_) {
    std::unique_ptr<AttentionCore> mine = plugin->MakeAttentionCore(layer, unit, initialize);
    if (mine == nullptr) continue;
    if (core != nullptr) {
      throw std::logic_error(absl::StrCat("plugins ", builder, " and ", plugin->name(),
                                          " both replace the attention of layer ", layer));
    }
    core = std::move(mine);
    builder = plugin->name();
  }
  return core;
}

void PluginSet::EditLayer(TransformerLayer& layer, bool initialize) {
  for (const auto& plugin : plugins_) plugin->EditLayer(layer, initialize);
}

absl::Status PluginSet::OnLayout(ParallelContext* parallel) {
  return ForEach(plugins_, "on the parallel layout", [&](Plugin& p) { return p.OnLayout(parallel); });
}

absl::Status PluginSet::BeforeIteration(PluginContext& ctx) {
  return ForEach(plugins_, "before the iteration", [&](Plugin& p) { return p.BeforeIteration(ctx); });
}

absl::Status PluginSet::AfterBackward(PluginContext& ctx) {
  return ForEach(plugins_, "after the backward", [&](Plugin& p) { return p.AfterBackward(ctx); });
}

absl::Status PluginSet::AfterOptimizerStep(PluginContext& ctx) {
  return ForEach(plugins_, "after the optimizer step",
                 [&](Plugin& p) { return p.AfterOptimizerStep(ctx); });
}

absl::Status PluginSet::AfterLoad(PluginContext& ctx) {
  return ForEach(plugins_, "after loading a checkpoint", [&](Plugin& p) { return p.AfterLoad(ctx); });
}

absl::Status PluginSet::Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) {
  return ForEach(plugins_, "metrics", [&](Plugin& p) { return p.Metrics(ctx, record, log_line); });
}

absl::Status PluginSet::AfterEvaluation(PluginContext& ctx, nlohmann::json* record,
                                        std::string* log_line) {
  return ForEach(plugins_, "after evaluation",
                 [&](Plugin& p) { return p.AfterEvaluation(ctx, record, log_line); });
}

bool PluginSet::NeedsLabels() const {
  for (const auto& plugin : plugins_) {
    if (plugin->NeedsLabels()) return true;
  }
  return false;
}

bool PluginSet::CarriesTokenState() const {
  for (const auto& plugin : plugins_) {
    if (plugin->CarriesTokenState()) return true;
  }
  return false;
}

double PluginSet::InitialTokenState() const {
  for (const auto& plugin : plugins_) {
    if (plugin->CarriesTokenState()) return plugin->InitialTokenState();
  }
  return 0.0;
}

std::vector<std::pair<std::string, std::string>> PluginSet::CheckpointShape() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& plugin : plugins_) {
    for (auto& field : plugin->CheckpointShape()) out.push_back(std::move(field));
  }
  return out;
}

}  // namespace fulcrum
