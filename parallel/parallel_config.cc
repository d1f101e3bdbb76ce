#include "parallel/parallel_config.h"

#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace fulcrum::parallel {

std::string_view GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTensor:
      return "tp";
    case GroupKind::kPipeline:
      return "pp";
    case GroupKind::kData:
      return "dp";
    case GroupKind::kExpert:
      return "ep";
    case GroupKind::kExpertData:
      return "edp";
    case GroupKind::kModel:
      return "mp";
  }
  return "unknown";
}

absl::Status ParallelConfig::Validate() const {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("world size %d must be at least 1", world_size));
  }
  const struct {
    const char* flag;
    int value;
  } sizes[] = {{"--tensor_model_parallel_size", tp},
               {"--pipeline_model_parallel_size", pp},
               {"--expert_model_parallel_size", ep}};
  for (const auto& size : sizes) {
    if (size.value < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s=%d must be at least 1", size.flag, size.value));
    }
  }
  // Compared as a quotient, not a product, so huge flag values cannot overflow.
  if (world_size % tp != 0 || (world_size / tp) % pp != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "world size %d is not divisible by --tensor_model_parallel_size=%d × "
        "--pipeline_model_parallel_size=%d",
        world_size, tp, pp));
  }
  if (dp() % ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--expert_model_parallel_size=%d must divide the data-parallel size %d",
                        ep, dp()));
  }
  return absl::OkStatus();
}

int ParallelConfig::GroupSize(GroupKind kind) const {
  switch (kind) {
    case GroupKind::kTensor:
      return tp;
    case GroupKind::kPipeline:
      return pp;
    case GroupKind::kData:
      return dp();
    case GroupKind::kExpert:
      return ep;
    case GroupKind::kExpertData:
      return expert_dp();
    case GroupKind::kModel:
      return tp * pp;
  }
  return 0;
}

std::vector<int> ParallelConfig::GroupOf(GroupKind kind, int rank) const {
  const RankCoords c = Coords(rank);
  std::vector<int> group;
  group.reserve(GroupSize(kind));
  // Each loop varies the coordinates the group spans and holds the others at `rank`'s.
  // Rank() grows with every coordinate, so the members come out ascending.
  switch (kind) {
    case GroupKind::kTensor:
      for (int t = 0; t < tp; ++t) group.push_back(Rank(t, c.dp, c.pp));
      break;
    case GroupKind::kPipeline:
      for (int p = 0; p < pp; ++p) group.push_back(Rank(c.tp, c.dp, p));
      break;
    case GroupKind::kData:
      for (int d = 0; d < dp(); ++d) group.push_back(Rank(c.tp, d, c.pp));
      break;
    case GroupKind::kExpert:
      for (int e = 0; e < ep; ++e) group.push_back(Rank(c.tp, c.edp * ep + e, c.pp));
      break;
    case GroupKind::kExpertData:
      for (int x = 0; x < expert_dp(); ++x) group.push_back(Rank(c.tp, x * ep + c.ep, c.pp));
      break;
    case GroupKind::kModel:
      for (int p = 0; p < pp; ++p) {
        for (int t = 0; t < tp; ++t) group.push_back(Rank(t, c.dp, p));
      }
      break;
  }
  return group;
}

std::vector<std::vector<int>> ParallelConfig::AllGroups(GroupKind kind) const {
  // Derived from GroupOf so that the two can never disagree: a group is listed when its
  // lowest member is reached.
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < world_size; ++rank) {
    std::vector<int> group = GroupOf(kind, rank);
    if (group.front() == rank) groups.push_back(std::move(group));
  }
  return groups;
}

std::string ParallelConfig::ToString() const {
  return absl::StrFormat("tp=%d pp=%d ep=%d dp=%d (world %d)", tp, pp, ep, dp(), world_size);
}

}  // namespace fulcrum::parallel
