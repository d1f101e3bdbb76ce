#include "tests/core/test_util.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "gtest/gtest.h"

namespace fulcrum::testing {

ModelOptions SmallModelOf(int64_t num_layers, int64_t seq_length) {
  ModelOptions m;
  m.num_layers = num_layers;
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.ffn_hidden_size = 64;
  m.vocab_size = 64;
  m.seq_length = seq_length;
  return m;
}

ModelOptions SmallModel() {
  ModelOptions m = SmallModelOf(2, 16);
  m.seed = 42;
  return m;
}

TrainerConfig SmallTrainerConfig() {
  TrainerConfig c;
  c.model = SmallModel();
  c.optimizer.lr = 3e-3;
  c.schedule.lr = 3e-3;
  c.schedule.min_lr = 3e-4;
  c.schedule.warmup_iters = 2;
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 4;
  c.train.train_iters = 8;
  c.train.log_interval = 1000;
  c.data.seq_length = c.model.seq_length;
  c.data.seed = 5;
  c.data.split = "90,10,0";
  return c;
}

std::shared_ptr<data::IndexedDataset> SyntheticCorpus(int64_t num_documents, int64_t tokens_per_doc,
                                                      int64_t vocab, uint64_t seed) {
  std::vector<int64_t> tokens;
  std::vector<int32_t> lengths;
  std::vector<int64_t> doc_index{0};
  uint64_t state = seed;
  auto next = [&state]() {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state >> 33;
  };
  // Every document walks the same cycle t → (5t + 3) mod (vocab - 1) from a seeded start:
  // a bigram rule a small model learns in a few dozen steps.
  for (int64_t d = 0; d < num_documents; ++d) {
    int64_t t = static_cast<int64_t>(next() % (vocab - 1));
    for (int64_t i = 0; i < tokens_per_doc - 1; ++i) {
      tokens.push_back(t);
      t = (5 * t + 3) % (vocab - 1);
    }
    tokens.push_back(vocab - 1);  // end of document
    lengths.push_back(static_cast<int32_t>(tokens_per_doc));
    doc_index.push_back(d + 1);
  }
  return data::IndexedDataset::FromMemory("synthetic", std::move(tokens), std::move(lengths),
                                          std::move(doc_index));
}

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst;
}

void ExpectLayerMatchesReference(const TransformerLayer& layer,
                                 const std::function<at::Tensor(const at::Tensor&)>& reference,
                                 at::IntArrayRef shape, double tolerance) {
  const at::Tensor x0 = at::randn(shape, at::kDouble);
  const at::Tensor probe = at::randn_like(x0);
  at::Tensor x = x0.clone().requires_grad_();
  at::Tensor y = x0.clone().requires_grad_();
  const at::Tensor got = layer.Forward(x, ForwardContext{true, 1, 0, 0.0, {}, 0});
  const at::Tensor want = reference(y);
  EXPECT_LE((got - want).abs().max().item<double>(), tolerance);
  (got * probe).sum().backward();
  (want * probe).sum().backward();
  EXPECT_LE((x.grad() - y.grad()).abs().max().item<double>(), tolerance);
}

}  // namespace fulcrum::testing
