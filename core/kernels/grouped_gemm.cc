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

namespace {

// Checks the counts against `rows` and returns C, the largest count.
int64_t CheckCounts(const char* who, int64_t row_count,
                    const std::vector<int64_t>& rows_per_expert) {
  TORCH_CHECK(!rows_per_expert.empty(), who, ": no experts (empty row counts)");
  int64_t total = 0;
  for (size_t e = 0; e < rows_per_expert.size(); ++e) {
    TORCH_CHECK(rows_per_expert[e] >= 0, who, ": expert ", e, " has ", rows_per_expert[e],
                " rows");
    total += rows_per_expert[e];
  }
  TORCH_CHECK(total == row_count, who, ": row counts sum to ", total, " but there are ",
              row_count, " rows");
  return *std::max_element(rows_per_expert.begin(), rows_per_expert.end());
}

bool AllEqual(const std::vector<int64_t>& counts) {
  return std::all_of(counts.begin(), counts.end(), [&](int64_t n) { return n == counts[0]; });
}

// Row r of expert e sits at e·C + r of the flattened [E·C, ...] buffer: one index, so one
// index_copy (and one index_select back) instead of E narrows and copies.
at::Tensor SlotIndex(const std::vector<int64_t>& rows_per_expert, int64_t capacity,
                     const at::Device& device) {
  std::vector<int64_t> slot;
  for (size_t e = 0; e < rows_per_expert.size(); ++e) {
    for (int64_t r = 0; r < rows_per_expert[e]; ++r) {
      slot.push_back(static_cast<int64_t>(e) * capacity + r);
    }
  }
  return at::tensor(slot, at::kLong).to(device);
}

}  // namespace

at::Tensor PadByExpert(const at::Tensor& rows, const std::vector<int64_t>& rows_per_expert) {
  TORCH_CHECK(rows.dim() == 2, "PadByExpert: rows must be [rows, D], got ", rows.sizes());
  const int64_t capacity = CheckCounts("PadByExpert", rows.size(0), rows_per_expert);
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  const int64_t d = rows.size(1);
  if (AllEqual(rows_per_expert)) return rows.view({experts, capacity, d});
  return at::zeros({experts * capacity, d}, rows.options())
      .index_copy(0, SlotIndex(rows_per_expert, capacity, rows.device()), rows)
      .view({experts, capacity, d});
}

at::Tensor UnpadByExpert(const at::Tensor& padded, const std::vector<int64_t>& rows_per_expert) {
  TORCH_CHECK(padded.dim() == 3 && padded.size(0) == static_cast<int64_t>(rows_per_expert.size()),
              "UnpadByExpert: padded must be [", rows_per_expert.size(), ", C, F], got ",
              padded.sizes());
  const int64_t total =
      std::accumulate(rows_per_expert.begin(), rows_per_expert.end(), int64_t{0});
  const int64_t capacity = CheckCounts("UnpadByExpert", total, rows_per_expert);
  TORCH_CHECK(padded.size(1) >= capacity, "UnpadByExpert: ", padded.size(1),
              " slots per expert, but an expert has ", capacity, " rows");
  const int64_t f = padded.size(2);
  if (AllEqual(rows_per_expert) && padded.size(1) == capacity) {
    return padded.reshape({total, f});
  }
  return padded.reshape({-1, f}).index_select(
      0, SlotIndex(rows_per_expert, padded.size(1), padded.device()));
}

at::Tensor GroupedExpertWeightGrad(const at::Tensor& grad_output, const at::Tensor& input,
                                   bool fp32_accumulate) {
  TORCH_CHECK(grad_output.dim() == 3 && input.dim() == 3 &&
                  grad_output.size(0) == input.size(0) && grad_output.size(1) == input.size(1),
              "GroupedExpertWeightGrad: grad_output [E, C, F] and input [E, C, D] expected, got ",
              grad_output.sizes(), " and ", input.sizes());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "GroupedExpertWeightGrad: ",
              "grad_output is ", grad_output.scalar_type(), " but input is ", input.scalar_type());
  const at::Tensor grad_t = grad_output.transpose(1, 2);  // [E, F, C]
  if (!fp32_accumulate || input.scalar_type() == at::kFloat) {
    const at::Tensor dw = at::bmm(grad_t, input);
    return fp32_accumulate ? dw.to(at::kFloat) : dw;
  }
  // bf16 operands, fp32 result: cuBLAS accumulates in fp32 and writes fp32 (no bf16
  // rounding of the product); the CPU gets the same product from widened operands.
  if (input.is_cuda()) return at::bmm(grad_t, input, at::kFloat);
  return at::bmm(grad_t.to(at::kFloat), input.to(at::kFloat));
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
  const at::Tensor out = GroupedExpertGemm(PadByExpert(rows, rows_per_expert), at::stack(weights),
                                           biases.empty() ? at::Tensor() : at::stack(biases));
  return UnpadByExpert(out, rows_per_expert);
}

}  // namespace fulcrum::kernels
