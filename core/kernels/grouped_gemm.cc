#include "core/kernels/grouped_gemm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

namespace fulcrum::kernels {

at::Tensor GroupedExpertGemm(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3 && x.size(0) == weight.size(0) &&
                  x.size(2) == weight.size(2),
              "GroupedExpertGemm: x [E, C, D] and weight [E, F, D] expected, got x ", x.sizes(),
              " and weight ", weight.sizes());
  TORCH_CHECK(!bias.defined() || (bias.dim() == 2 && bias.size(0) == weight.size(0) &&
                                  bias.size(1) == weight.size(1)),
              "GroupedExpertGemm: bias must be [", weight.size(0), ", ", weight.size(1), "], got ",
              bias.sizes());
  const at::Tensor weight_t = weight.transpose(1, 2);  // [E, D, F]
  if (!bias.defined()) return at::bmm(x, weight_t);
  return at::baddbmm(bias.unsqueeze(1), x, weight_t);
}

at::Tensor RaggedExpertGemm(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert,
                            const std::vector<at::Tensor>& weights,
                            const std::vector<at::Tensor>& biases) {
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(weights.size()) == experts,
              "RaggedExpertGemm: ", rows_per_expert.size(), " row counts but ", weights.size(),
              " expert weights");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "RaggedExpertGemm: ",
              biases.size(), " biases for ", weights.size(), " experts (give all or none)");
  TORCH_CHECK(rows.dim() == 2, "RaggedExpertGemm: rows must be [tokens, D], got ", rows.sizes());
  const int64_t total = std::accumulate(rows_per_expert.begin(), rows_per_expert.end(), int64_t{0});
  TORCH_CHECK(total == rows.size(0), "RaggedExpertGemm: row counts sum to ", total, " but rows has ",
              rows.size(0));
  const int64_t capacity = *std::max_element(rows_per_expert.begin(), rows_per_expert.end());
  const int64_t d = rows.size(1);
  // Scatter each expert's rows into its padded slot; the index says where, so one
  // index_copy (and one index_select back) instead of E narrows and copies.
  std::vector<int64_t> slot;
  slot.reserve(total);
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(rows_per_expert[e] >= 0, "RaggedExpertGemm: expert ", e, " has ",
                rows_per_expert[e], " rows");
    for (int64_t r = 0; r < rows_per_expert[e]; ++r) slot.push_back(e * capacity + r);
  }
  const at::Tensor index = at::tensor(slot, at::kLong).to(rows.device());
  const at::Tensor padded =
      at::zeros({experts * capacity, d}, rows.options()).index_copy(0, index, rows);
  const at::Tensor out = GroupedExpertGemm(padded.view({experts, capacity, d}), at::stack(weights),
                                           biases.empty() ? at::Tensor() : at::stack(biases));
  return out.view({experts * capacity, -1}).index_select(0, index);
}

}  // namespace fulcrum::kernels
