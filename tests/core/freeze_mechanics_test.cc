// What freezing a layer relies on in core/: a frozen weight queues no deferred weight
// gradient (no W work) and gets none; AdamW never updates a frozen parameter, even one with
// a gradient, and a unit with no trainable parameter takes no step; a frozen prefix (NOTE
// [frozen prefix] in core/gpt_model.h) builds no graph, and the layers after it get exactly
// the gradients they get without the prefix rule.
#include <torch/torch.h>

#include "core/gpt_model.h"
#include "core/linear.h"
#include "core/optimizer/adamw.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

TEST(FreezeMechanicsTest, AFrozenWeightQueuesNoWeightGradient) {
  at::Tensor x = torch::randn({3, 5}, torch::requires_grad());
  at::Tensor w = torch::randn({4, 5});  // frozen: requires_grad false
  at::Tensor trainable = torch::randn({4, 5}, torch::requires_grad());
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(&store);
    (LinearForward(x, w, at::Tensor()).sum() + LinearForward(x, trainable, at::Tensor()).sum()).backward();
  }
  EXPECT_EQ(store.size(), 1u) << "only the trainable weight's GEMM is deferred";
  store.Flush();
  EXPECT_FALSE(w.grad().defined());
  EXPECT_TRUE(trainable.grad().defined());
  // The input gradient still flows through the frozen weight.
  at::Tensor expected = w.sum(0).expand({3, 5}) + trainable.sum(0).expand({3, 5});
  EXPECT_TRUE(at::allclose(x.grad(), expected));
}

TEST(FreezeMechanicsTest, AdamWNeverUpdatesAFrozenParameter) {
  Unit unit("layers.0");
  // Handles (they share the parameters' tensors; references into the unit would dangle).
  at::Tensor frozen = unit.AddParameter("frozen.weight", torch::ones({3}), true);
  at::Tensor trained = unit.AddParameter("trained.weight", torch::ones({3}), true);
  frozen.set_requires_grad(false);
  frozen.mutable_grad() = torch::ones({3});  // a gradient that must be ignored
  trained.mutable_grad() = torch::ones({3});
  AdamW adamw(OptimizerOptions{});
  adamw.Step({&unit}, 1e-2);
  EXPECT_TRUE(at::equal(frozen, torch::ones({3})));
  EXPECT_FALSE(at::equal(trained, torch::ones({3})));
  EXPECT_EQ(unit.optimizer_step(), 1);
  // A unit with nothing trainable takes no step at all.
  trained.set_requires_grad(false);
  adamw.Step({&unit}, 1e-2);
  EXPECT_EQ(unit.optimizer_step(), 1);
}

void Freeze(TransformerLayer& layer) {
  for (Parameter& p : layer.parameters()) p.value.set_requires_grad(false);
}

TEST(FreezeMechanicsTest, AFrozenPrefixRunsNoBackwardAndLeavesTheOthersGradientsAlone) {
  ModelOptions o = testing::SmallModel();
  o.num_layers = 4;
  GptModel with_prefix(o), without(o);
  for (GptModel* m : {&with_prefix, &without}) {
    Freeze(*m->layers().at(0));
    Freeze(*m->layers().at(1));
  }
  with_prefix.set_frozen_prefix(2);
  at::Tensor tokens = at::randint(o.vocab_size, {2, o.seq_length + 1}, at::TensorOptions().dtype(at::kLong));
  for (GptModel* m : {&with_prefix, &without}) {
    LossSum loss = m->ForwardLoss(tokens, ForwardContext{true, 1, 0, 1.0});
    loss.sum.backward();
  }
  EXPECT_FALSE(with_prefix.input_needs_grad());
  for (int64_t l : {0, 1}) {
    for (const Parameter& p : with_prefix.layers().at(l)->parameters()) EXPECT_FALSE(p.value.grad().defined());
  }
  // No input-side gradient reaches the embedding: only the tied output weight's.
  const Parameter* positions = with_prefix.embedding()->FindParameter("position_embeddings.weight");
  if (positions != nullptr) {
    EXPECT_FALSE(positions->value.grad().defined());
  }
  // The trainable layers get the same gradients, bit for bit.
  for (int64_t l = 2; l < o.num_layers; ++l) {
    const auto& a = with_prefix.layers().at(l)->parameters();
    const auto& b = without.layers().at(l)->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(a[i].value.grad().defined()) << a[i].name;
      EXPECT_TRUE(at::equal(a[i].value.grad(), b[i].value.grad())) << "layer " << l << " " << a[i].name;
    }
  }
}

}  // namespace
}  // namespace fulcrum
