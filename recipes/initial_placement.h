// The placement a pipeline starts with (--pipeline_initial_partition): Megatron's even
// split, or DeepSpeed's parameter-balanced one — the two static baselines every balancing
// benchmark compares against.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/config.h"
#include "core/plugin.h"
#include "core/tensor_parallel.h"

namespace fulcrum {

/// Each stage's [begin, end) in the placement that balances trainable parameters over
/// `stages` stages (dynamic::PartitionBalance on the parameter counts): each layer counted
/// as this rank builds it (`customizer`, may be null: the plugins' blocks; `tp` shards;
/// layers are built one at a time, uninitialised, to be counted), the embedding pinned on
/// the first stage and the final norm and LM head on the last. Every rank computes the same
/// placement. With virtual pipeline stages `chunk_rank` gives the rank of each (model
/// order; BalanceProblem::chunk_rank) and the placement has one range per virtual stage,
/// balanced as the Partition balancer balances chunks (NOTE [partition under chunks]); a
/// tied output weight on the embedding's own rank (ZB-V) is no second copy.
absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ParameterBalancedPlacement(
    const ModelOptions& model, LayerCustomizer* customizer, TensorParallelGroup* tp, int stages,
    const std::vector<int>& chunk_rank = {});

}  // namespace fulcrum
