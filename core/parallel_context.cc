#include "core/parallel_context.h"

namespace fulcrum {

std::vector<bool> ParallelContext::AnyRank(GroupRole role, const std::vector<bool>& mine,
                                           c10::Device device) {
  at::Tensor flags = at::zeros({static_cast<int64_t>(mine.size())}, at::kFloat);
  float* host = flags.data_ptr<float>();
  for (size_t i = 0; i < mine.size(); ++i) host[i] = mine[i] ? 1.0f : 0.0f;
  at::Tensor summed = flags.to(device);
  AllReduceSum(role, summed);
  flags = summed.cpu();
  host = flags.data_ptr<float>();
  std::vector<bool> any(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) any[i] = host[i] > 0;
  return any;
}

}  // namespace fulcrum
