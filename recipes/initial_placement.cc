#include "recipes/initial_placement.h"

#include <memory>

#include "core/status.h"
#include "core/transformer_layer.h"
#include "dynamic/load_model.h"
#include "dynamic/partition.h"

namespace fulcrum {

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParameterBalancedPlacement(
    const ModelOptions& model, LayerCustomizer* customizer, TensorParallelGroup* tp, int stages,
    const std::vector<int>& chunk_rank) {
  const double tp_size = tp != nullptr ? tp->size() : 1;
  const double h = static_cast<double>(model.hidden_size);
  const double vocab_rows = static_cast<double>(model.vocab_size) / tp_size;
  dynamic::BalanceProblem problem;
  problem.num_stages = stages;
  problem.chunk_rank = chunk_rank;
  for (int64_t i = 0; i < model.num_layers; ++i) {
    TransformerLayer shell(model, i, tp, /*initialize=*/false, customizer);
    double trainable = 0;
    for (const Parameter& p : shell.parameters()) trainable += static_cast<double>(p.value.numel());
    problem.layer_cost.push_back(trainable);
  }
  // The embedding (words, and learned positions); the final norm and the output weight,
  // which the last stage holds untied or as the tied weight's mirror when it is another
  // rank than the embedding's (pp > 1, and not ZB-V's rank 0 holding both).
  problem.first_stage_cost =
      vocab_rows * h + (model.position_embedding == PositionEmbedding::kLearned
                            ? static_cast<double>(model.position_rows()) * h
                            : 0.0);
  const int first_rank = chunk_rank.empty() ? 0 : chunk_rank.front();
  const int last_rank = chunk_rank.empty() ? stages - 1 : chunk_rank.back();
  const bool output_weight = !model.tie_embeddings || first_rank != last_rank;
  problem.last_stage_cost = 2 * h + (output_weight ? vocab_rows * h : 0.0);
  FULCRUM_ASSIGN_OR_RETURN(dynamic::Placement placement, dynamic::PartitionBalance(problem));
  return dynamic::ToLayerRanges(placement);
}

}  // namespace fulcrum
