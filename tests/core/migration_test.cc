// NOTE [layer migration]: a stage's layer range changes one boundary layer at a time, and
// moving layers — with their gradients mid-step and their Adam state — never changes the
// math. Two stages of one model run in one process here (the boundary activation and its
// gradient are handed over by hand, as the pipeline's p2p will); a script moves layers back
// and forth between iterations' backward and optimizer step, and the loss curve and final
// weights are bit-identical to the run without moves and to the unsplit model.
#include <torch/torch.h>

#include <functional>
#include <map>

#include "core/gpt_model.h"
#include "core/optimizer/adamw.h"
#include "core/random.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

ModelOptions FourLayers() {
  ModelOptions o = testing::SmallModel();
  o.num_layers = 4;
  o.tie_embeddings = false;  // a tied head on another stage needs the pipeline's copy
  o.hidden_dropout = 0.1;    // masks keyed by global layer: must follow the layer
  o.attention_dropout = 0.1;
  return o;
}

// Sequences following t → (5t + 3) mod 63 from seeded starts: learnable in a few steps.
at::Tensor Batch(const ModelOptions& o, int64_t iteration, int64_t micro) {
  at::Generator gen = MakeGenerator(9, "migration_batch", {iteration, micro});
  at::Tensor tokens = at::empty({2, o.seq_length + 1}, at::kLong);
  at::Tensor starts = at::randint(63, {2}, gen, at::TensorOptions().dtype(at::kLong));
  for (int64_t b = 0; b < 2; ++b) {
    int64_t t = starts[b].item<int64_t>();
    for (int64_t i = 0; i <= o.seq_length; ++i, t = (5 * t + 3) % 63) tokens[b][i] = t;
  }
  return tokens;
}

// Moves layer `index` from `from` to `to`, through MigrationTensors as a remote stage
// would receive it.
void Migrate(GptModel& from, GptModel& to, int64_t index) {
  auto layer = from.TakeLayer(index);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::map<std::string, at::Tensor> wire;
  for (auto& [name, tensor] : (*layer)->MigrationTensors()) wire.emplace(name, tensor.clone());
  layer->reset();  // the sender's copy is gone
  std::unique_ptr<TransformerLayer> shell = to.NewLayerShell(index);
  ASSERT_TRUE(shell->LoadMigrationTensors(wire).ok());
  ASSERT_TRUE(to.InsertLayer(std::move(shell)).ok());
}

using Script = std::map<int64_t, std::vector<std::pair<int64_t, bool>>>;  // iteration → (layer, to_second)

// Trains `iterations` steps of two micro-batches. With `second` null, `first` is the whole
// model; else the model is split between the two stages and `script` moves layers after
// each iteration's backward, before its optimizer step.
std::vector<double> Train(GptModel& first, GptModel* second, const Script& script, int iterations) {
  const ModelOptions& o = first.options();
  OptimizerOptions oo;
  oo.lr = 1e-2;
  oo.clip_grad = 0.5;  // clipping on: the global norm must not depend on the split either
  AdamW adamw(oo);
  std::vector<double> losses;
  for (int64_t it = 1; it <= iterations; ++it) {
    const double tokens = 2.0 * 2.0 * o.seq_length;
    double loss_sum = 0;
    for (int64_t m = 0; m < 2; ++m) {
      at::Tensor batch = Batch(o, it, m);
      ForwardContext ctx{true, it, m * 2};
      const int64_t s = o.seq_length;
      if (second == nullptr) {
        LossSum loss = first.ForwardLoss(batch, ctx);
        (loss.sum / tokens).backward();
        loss_sum += loss.sum.item<double>();
        continue;
      }
      at::Tensor hidden = first.ForwardLayers(first.embedding()->Forward(batch.narrow(1, 0, s), ctx), ctx);
      at::Tensor boundary = hidden.detach().requires_grad_(true);
      LossSum loss = second->HeadLoss(second->ForwardLayers(boundary, ctx), batch.narrow(1, 1, s));
      (loss.sum / tokens).backward();
      hidden.backward(boundary.grad());
      loss_sum += loss.sum.item<double>();
    }
    if (second != nullptr && script.count(it)) {
      for (auto [layer, to_second] : script.at(it)) {
        if (to_second) Migrate(first, *second, layer); else Migrate(*second, first, layer);
      }
    }
    std::vector<Unit*> units = first.Units();
    if (second != nullptr) {
      for (Unit* u : second->Units()) units.push_back(u);
    }
    const double norm = std::sqrt(AdamW::GradSquaredSum(units));
    AdamW::ScaleGradients(units, adamw.ClipFactor(norm));
    adamw.Step(units, 1e-2);
    for (Unit* u : units) u->ZeroGrad();
    losses.push_back(loss_sum / tokens);
  }
  return losses;
}

std::map<std::string, at::Tensor> AllState(const std::vector<const GptModel*>& models) {
  std::map<std::string, at::Tensor> state;
  for (const GptModel* model : models) {
    for (Unit* u : model->Units()) {
      for (auto& [name, t] : u->StateTensors()) state.emplace(name, t);
    }
  }
  return state;
}

TEST(MigrationTest, MovingLayersBackAndForthKeepsTheLossCurveBitIdentical) {
  const ModelOptions o = FourLayers();
  const int kIterations = 7;
  GptModel whole(o);
  const std::vector<double> reference = Train(whole, nullptr, {}, kIterations);

  GptModel a(o, StageSpec{0, 2, true, false});
  GptModel b(o, StageSpec{2, 4, false, true});
  const std::vector<double> unmoved = Train(a, &b, {}, kIterations);

  GptModel c(o, StageSpec{0, 2, true, false});
  GptModel d(o, StageSpec{2, 4, false, true});
  const Script script = {{1, {{1, true}}},                  // [0,1) | [1,4)
                         {3, {{1, false}, {2, false}}},     // [0,3) | [3,4)
                         {4, {{2, true}}},                  // [0,2) | [2,4)
                         {6, {{1, true}}}};                 // [0,1) | [1,4)
  const std::vector<double> moved = Train(c, &d, script, kIterations);

  EXPECT_EQ(c.layer_begin(), 0);
  EXPECT_EQ(c.layer_end(), 1);
  EXPECT_EQ(d.layer_begin(), 1);
  EXPECT_EQ(d.layer_end(), 4);
  for (int i = 0; i < kIterations; ++i) {
    EXPECT_EQ(moved[i], unmoved[i]) << "iteration " << i + 1;
    EXPECT_EQ(moved[i], reference[i]) << "iteration " << i + 1;
  }
  EXPECT_LT(moved.back(), moved.front());
  const auto expected = AllState({&whole});
  const auto got = AllState({&c, &d});
  ASSERT_EQ(expected.size(), got.size());
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(at::equal(tensor, got.at(name))) << name;
  }
}

TEST(MigrationTest, LayersLeaveAndArriveAnywhereAndTheRangeIsChecked) {
  const ModelOptions o = FourLayers();
  GptModel a(o, StageSpec{0, 3, true, false});
  GptModel b(o, StageSpec{3, 4, false, true});
  EXPECT_TRUE(a.CheckRange(0, 3).ok());
  EXPECT_EQ(a.TakeLayer(3).status().code(), absl::StatusCode::kNotFound);
  // A middle layer leaves: the range has a gap until it is back.
  auto middle = a.TakeLayer(1);
  ASSERT_TRUE(middle.ok()) << middle.status();
  EXPECT_EQ(a.layers().count(1), 0u);
  EXPECT_THAT(std::string(a.CheckRange(0, 3).message()), ::testing::HasSubstr("holds {0,2}"));
  EXPECT_EQ(a.InsertLayer(a.NewLayerShell(0)).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(a.InsertLayer(std::move(*middle)).ok());
  EXPECT_TRUE(a.CheckRange(0, 3).ok());
  // A stage may hold no layer while a plan is carried out.
  auto only = b.TakeLayer(3);
  ASSERT_TRUE(only.ok());
  EXPECT_EQ(b.layer_begin(), b.layer_end());
  EXPECT_TRUE(b.CheckRange(3, 3).ok());
  ASSERT_TRUE(b.InsertLayer(b.NewLayerShell(0)).ok());
  EXPECT_EQ(b.layer_begin(), 0);
  EXPECT_EQ(b.layer_end(), 1);
}

TEST(MigrationTest, MigrationTensorsCarryGradientsAndAdamState) {
  const ModelOptions o = FourLayers();
  TransformerLayer layer(o, 2);
  layer.set_optimizer_step(3);
  for (Parameter& p : layer.parameters()) {
    p.OptimizerState("exp_avg") = at::full_like(p.value, 0.5);
    p.OptimizerState("exp_avg_sq") = at::full_like(p.value, 0.25);
    p.value.mutable_grad() = at::full_like(p.value, -1.0);
  }
  std::map<std::string, at::Tensor> wire;
  for (auto& [name, t] : layer.MigrationTensors()) wire.emplace(name, t);
  EXPECT_TRUE(wire.count("layers.2.mlp.linear_fc1.weight.grad"));
  TransformerLayer shell(o, 2, nullptr, /*initialize=*/false);
  ASSERT_TRUE(shell.LoadMigrationTensors(wire).ok());
  EXPECT_EQ(shell.optimizer_step(), 3);
  for (size_t i = 0; i < layer.parameters().size(); ++i) {
    const Parameter& p = layer.parameters()[i];
    const Parameter& q = shell.parameters()[i];
    EXPECT_TRUE(at::equal(p.value, q.value)) << p.name;
    EXPECT_TRUE(at::equal(p.value.grad(), q.value.grad())) << p.name;
    EXPECT_TRUE(at::equal(p.OptimizerState("exp_avg_sq"), q.OptimizerState("exp_avg_sq"))) << p.name;
  }
  wire.erase("optimizer.layers.2.mlp.linear_fc1.weight.exp_avg");
  absl::Status status = shell.LoadMigrationTensors(wire);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("layers.2.mlp.linear_fc1.weight"), std::string::npos) << status;
}

// A parameter's slots are the names one dot past its prefix: a parameter whose name extends
// it ("w.extra") and the unit's step counter are not its slots.
TEST(MigrationTest, OptimizerSlotsInReadsOneParametersSlotsOnly) {
  const at::Tensor a = at::ones({1}), b = at::zeros({1}), c = at::full({1}, 2.0);
  const std::map<std::string, at::Tensor> tensors = {{"optimizer.layers.1.w.exp_avg", a},
                                                     {"optimizer.layers.1.w.momentum", b},
                                                     {"optimizer.layers.1.w.extra.exp_avg", c},
                                                     {"optimizer.layers.1.step", c},
                                                     {"optimizer.layers.1.wide.exp_avg", c},
                                                     {"layers.1.w", c}};
  EXPECT_EQ(OptimizerStatePrefix("layers.1.w"), "optimizer.layers.1.w.");
  const std::map<std::string, at::Tensor> slots = OptimizerSlotsIn(tensors, "layers.1.w");
  ASSERT_EQ(slots.size(), 2u);
  EXPECT_TRUE(slots.at("exp_avg").is_same(a));
  EXPECT_TRUE(slots.at("momentum").is_same(b));
  EXPECT_TRUE(OptimizerSlotsIn(tensors, "layers.2.w").empty());
}

}  // namespace
}  // namespace fulcrum

namespace fulcrum {
namespace {

// A tied head on a stage without the embedding keeps a mirror of the word embeddings that
// starts equal, is not checkpointed, loads from the embedding's name and is left out of
// the gradient norm.
TEST(MirrorTest, TiedHeadOnAnotherStageMirrorsTheWordEmbeddings) {
  ModelOptions o = testing::SmallModel();
  o.tie_embeddings = true;
  GptModel first(o, StageSpec{0, 1, true, false});
  GptModel last(o, StageSpec{1, 2, false, true});
  Parameter* mirror = last.head()->FindParameter("word_embeddings_mirror.weight");
  ASSERT_NE(mirror, nullptr);
  EXPECT_EQ(mirror->sharding.mirror_of, "embedding.word_embeddings.weight");
  EXPECT_TRUE(at::equal(mirror->value, first.embedding()->word_embeddings()));
  for (auto& [name, t] : last.head()->StateTensors()) {
    EXPECT_EQ(name.find("mirror"), std::string::npos) << name << " must not be checkpointed";
  }
  mirror->value.mutable_grad() = at::ones_like(mirror->value);
  EXPECT_EQ(AdamW::GradSquaredSum({last.head()}), 0.0);

  std::map<std::string, at::Tensor> saved;
  for (Unit* u : first.Units()) {
    for (auto& [name, t] : u->StateTensors()) saved.emplace(name, t.clone().fill_(0.5));
  }
  for (auto& [name, t] : last.head()->StateTensors()) saved.emplace(name, t);
  auto lookup = [&](const std::string& name) -> absl::StatusOr<at::Tensor> {
    auto it = saved.find(name);
    if (it == saved.end()) return absl::NotFoundError(name);
    return it->second;
  };
  ASSERT_TRUE(last.head()->LoadStateTensors(lookup, AdamW(OptimizerOptions()).StateSlots()).ok());
  EXPECT_TRUE(at::equal(mirror->value, at::full_like(mirror->value, 0.5)));
}

}  // namespace
}  // namespace fulcrum
