#include "parallel/data_parallel.h"

namespace fulcrum::parallel {

void GradientReducer::AllReduce(const std::vector<Unit*>& units,
                                const std::function<bool(const Parameter&)>& reduced) {
  if (dp_->size() == 1) return;
  std::vector<at::Tensor> bucket;
  int64_t bucket_bytes = 0;
  auto flush = [&]() {
    if (bucket.empty()) return;
    at::Tensor flat = at::cat([&] {
      std::vector<at::Tensor> views;
      views.reserve(bucket.size());
      for (const at::Tensor& g : bucket) views.push_back(g.reshape({-1}));
      return views;
    }());
    dp_->AllReduce(flat, ReduceOp::kSum);
    int64_t offset = 0;
    for (at::Tensor& g : bucket) {
      g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
    bucket.clear();
    bucket_bytes = 0;
  };
  // A parameter has a gradient after the step if any rank produced one (as in one process
  // over the whole batch): agree on that first, with one small collective, so every rank
  // contributes the same tensors — zeros where it has none.
  std::vector<Parameter*> params;
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      // NOTE [parameter sharding]: which data-parallel group sums it.
      if (select_ == Select::kDense && p.sharding.ReducedOverExpertData()) continue;
      if (select_ == Select::kExpertParallel && !p.sharding.ReducedOverExpertData()) continue;
      if (reduced && reduced(p)) continue;
      params.push_back(&p);
    }
  }
  at::Tensor present = at::zeros({static_cast<int64_t>(params.size())}, at::kFloat);
  for (size_t i = 0; i < params.size(); ++i) {
    present.data_ptr<float>()[i] = params[i]->value.grad().defined() ? 1.0f : 0.0f;
  }
  dp_->AllReduce(present, ReduceOp::kMax);
  const float* any_rank = present.data_ptr<float>();
  for (size_t i = 0; i < params.size(); ++i) {
    if (any_rank[i] == 0) continue;  // no rank has a gradient: it stays undefined everywhere
    Parameter& p = *params[i];
    at::Tensor& g = p.value.mutable_grad();
    if (!g.defined()) g = at::zeros_like(p.value);
    if (!bucket.empty() && bucket.front().scalar_type() != g.scalar_type()) flush();
    bucket.push_back(g);
    bucket_bytes += g.numel() * static_cast<int64_t>(g.element_size());
    if (bucket_bytes >= bucket_bytes_) flush();
  }
  flush();
}

}  // namespace fulcrum::parallel
