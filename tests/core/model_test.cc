// Model pieces: shapes, causal masking, the custom Linear autograd function (against
// autograd and finite differences), the B/W split, rotary positions, dropout keys and
// layout-independent initialisation.
#include <ATen/ThreadLocalState.h>
#include <torch/torch.h>

#include <cmath>
#include <thread>

#include "core/optimizer/adamw.h"
#include "core/gpt_model.h"
#include "core/linear.h"
#include "core/random.h"
#include "core/transformer_layer.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing::SmallModel;

at::Tensor RandomTokens(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  at::Generator gen = MakeGenerator(seed, "tokens");
  return at::randint(vocab, {b, s}, gen, at::TensorOptions().dtype(at::kLong));
}

TEST(GptModelTest, ShapesAndInitialLoss) {
  ModelOptions options = SmallModel();
  GptModel model(options);
  at::Tensor tokens = RandomTokens(3, options.seq_length + 1, options.vocab_size, 1);
  ForwardContext ctx;
  at::Tensor hidden = model.embedding()->Forward(tokens.narrow(1, 0, options.seq_length), ctx);
  EXPECT_EQ(hidden.sizes(), (std::vector<int64_t>{options.seq_length, 3, options.hidden_size}));
  hidden = model.ForwardLayers(hidden, ctx);
  EXPECT_EQ(hidden.sizes(), (std::vector<int64_t>{options.seq_length, 3, options.hidden_size}));
  at::Tensor logits = model.head()->Logits(hidden, model.embedding()->word_embeddings());
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{options.seq_length, 3, options.vocab_size}));

  LossSum loss = model.ForwardLoss(tokens, ctx);
  EXPECT_EQ(loss.tokens, 3 * options.seq_length);
  // Small initial weights give near-uniform predictions: mean loss close to log(V).
  const double mean = loss.sum.item<double>() / loss.tokens;
  EXPECT_NEAR(mean, std::log(static_cast<double>(options.vocab_size)), 0.1);
}

TEST(GptModelTest, ParameterCountMatchesClosedForm) {
  ModelOptions o = SmallModel();
  const int64_t h = o.hidden_size, f = o.ffn_hidden_size, v = o.vocab_size, s = o.seq_length;
  const int64_t per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (f * h + f) +
                            (h * f + h);
  const int64_t expected = v * h + s * h + o.num_layers * per_layer + 2 * h;
  EXPECT_EQ(GptModel(o).NumParameterElements(), expected);
  o.tie_embeddings = false;
  EXPECT_EQ(GptModel(o).NumParameterElements(), expected + v * h);
}

// Changing token t must leave the logits of every position before t unchanged.
TEST(GptModelTest, AttentionIsCausal) {
  for (PositionEmbedding pe : {PositionEmbedding::kLearned, PositionEmbedding::kRotary}) {
    ModelOptions options = SmallModel();
    options.position_embedding = pe;
    GptModel model(options);
    const int64_t s = options.seq_length;
    at::Tensor tokens = RandomTokens(2, s, options.vocab_size, 3);
    ForwardContext ctx{/*training=*/false, 0, 0};
    auto logits_of = [&](const at::Tensor& t) {
      at::Tensor h = model.ForwardLayers(model.embedding()->Forward(t, ctx), ctx);
      return model.head()->Logits(h, model.embedding()->word_embeddings());
    };
    at::Tensor before = logits_of(tokens);
    const int64_t t = 9;
    at::Tensor changed = tokens.clone();
    changed.select(1, t).add_(1).remainder_(options.vocab_size);
    at::Tensor after = logits_of(changed);
    EXPECT_TRUE(at::equal(before.narrow(0, 0, t), after.narrow(0, 0, t)))
        << PositionEmbeddingName(pe);
    EXPECT_GT(testing::MaxAbsDiff(before.narrow(0, t, s - t), after.narrow(0, t, s - t)), 1e-4)
        << "later positions must see the change";
  }
}

TEST(LinearTest, ForwardAndGradientsMatchAutograd) {
  at::Generator gen = MakeGenerator(1, "linear");
  at::Tensor x = at::randn({5, 3, 7}, gen, at::kFloat).requires_grad_(true);
  at::Tensor w = at::randn({4, 7}, gen, at::kFloat).requires_grad_(true);
  at::Tensor b = at::randn({4}, gen, at::kFloat).requires_grad_(true);
  at::Tensor upstream = at::randn({5, 3, 4}, gen, at::kFloat);

  at::Tensor ours = LinearForward(x, w, b);
  (ours * upstream).sum().backward();
  at::Tensor gx = x.grad().clone(), gw = w.grad().clone(), gb = b.grad().clone();
  x.mutable_grad() = w.mutable_grad() = b.mutable_grad() = at::Tensor();

  at::Tensor reference = at::linear(x, w, b);
  (reference * upstream).sum().backward();
  EXPECT_LT(testing::MaxAbsDiff(ours, reference), 1e-5);
  EXPECT_LT(testing::MaxAbsDiff(gx, x.grad()), 1e-5);
  EXPECT_LT(testing::MaxAbsDiff(gw, w.grad()), 1e-5);
  EXPECT_LT(testing::MaxAbsDiff(gb, b.grad()), 1e-5);
}

// Central finite differences in double precision on f(x, W, b) = Σ u ⊙ (x·Wᵀ + b).
TEST(LinearTest, GradientsMatchFiniteDifferences) {
  at::Generator gen = MakeGenerator(2, "linear_fd");
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({3, 5}, gen, opts).requires_grad_(true);
  at::Tensor w = at::randn({2, 5}, gen, opts).requires_grad_(true);
  at::Tensor b = at::randn({2}, gen, opts).requires_grad_(true);
  at::Tensor u = at::randn({3, 2}, gen, opts);
  auto f = [&]() { return (LinearForward(x, w, b) * u).sum(); };
  f().backward();
  const double eps = 1e-6;
  for (at::Tensor* t : {&x, &w, &b}) {
    at::Tensor flat = t->detach().view({-1});
    at::Tensor grad = t->grad().view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double saved = flat[i].item<double>();
      double plus, minus;
      {
        at::NoGradGuard guard;
        flat[i] = saved + eps;
        plus = f().item<double>();
        flat[i] = saved - eps;
        minus = f().item<double>();
        flat[i] = saved;
      }
      EXPECT_NEAR(grad[i].item<double>(), (plus - minus) / (2 * eps), 1e-7);
    }
  }
}

// NOTE [B/W split]: deferring weight gradients and running them later gives the fused
// gradients bit for bit.
TEST(LinearTest, DeferredWeightGradientsAreBitIdentical) {
  ModelOptions options = SmallModel();
  options.tie_embeddings = false;
  at::Tensor tokens = RandomTokens(2, options.seq_length + 1, options.vocab_size, 4);
  ForwardContext ctx;

  GptModel fused(options);
  fused.ForwardLoss(tokens, ctx).sum.backward();

  GptModel split(options);
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(&store);
    split.ForwardLoss(tokens, ctx).sum.backward();
  }
  // 4 linears per layer, plus the untied output layer.
  EXPECT_EQ(store.size(), static_cast<size_t>(4 * options.num_layers + 1));
  const Parameter* qkv = split.layers().at(0)->FindParameter("self_attention.linear_qkv.weight");
  EXPECT_FALSE(qkv->value.grad().defined()) << "weight grads wait for W";
  EXPECT_TRUE(split.layers().at(0)->FindParameter("self_attention.linear_qkv.bias")->value.grad().defined())
      << "bias grads are computed in B";
  store.Flush();
  EXPECT_TRUE(store.empty());

  auto fused_units = fused.Units();
  auto split_units = split.Units();
  ASSERT_EQ(fused_units.size(), split_units.size());
  for (size_t u = 0; u < fused_units.size(); ++u) {
    for (size_t p = 0; p < fused_units[u]->parameters().size(); ++p) {
      const Parameter& a = fused_units[u]->parameters()[p];
      const Parameter& b = split_units[u]->parameters()[p];
      ASSERT_TRUE(a.value.grad().defined()) << a.name;
      ASSERT_TRUE(b.value.grad().defined()) << b.name;
      EXPECT_TRUE(at::equal(a.value.grad(), b.value.grad())) << fused_units[u]->GlobalName(a.name);
    }
  }
}

// NOTE [store across threads] in core/linear.cc: for CUDA tensors autograd runs the
// backward on its own device thread, under the thread-local state it captured from the
// thread that called backward(). That hand-over is reproduced here on the CPU: a thread
// that installs the captured state sees the store and defers into it; a thread that does
// not sees none; a nested Scope(nullptr) turns deferral off and the store comes back after.
TEST(LinearTest, ActiveStoreFollowsTheBackwardIntoAutogradsWorkerThreads) {
  ModelOptions options = SmallModel();
  options.tie_embeddings = false;
  const at::Tensor tokens = RandomTokens(2, options.seq_length + 1, options.vocab_size, 4);
  GptModel model(options);
  const at::Tensor loss = model.ForwardLoss(tokens, ForwardContext()).sum;
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(&store);
    ASSERT_EQ(WeightGradStore::Active(), &store);
    {
      WeightGradStore::Scope off(nullptr);
      EXPECT_EQ(WeightGradStore::Active(), nullptr);
    }
    EXPECT_EQ(WeightGradStore::Active(), &store);
    const at::ThreadLocalState captured;  // what the engine captures at backward()
    WeightGradStore* plain_thread_sees = &store;
    std::thread([&] { plain_thread_sees = WeightGradStore::Active(); }).join();
    EXPECT_EQ(plain_thread_sees, nullptr) << "a store is per thread, not per process";
    std::thread([&] {
      at::ThreadLocalStateGuard guard(captured);  // what the engine's worker thread does
      EXPECT_EQ(WeightGradStore::Active(), &store);
      loss.backward();
    }).join();
  }
  EXPECT_EQ(WeightGradStore::Active(), nullptr);
  EXPECT_EQ(store.size(), static_cast<size_t>(4 * options.num_layers + 1))
      << "the worker thread's linears deferred their weight gradients into the store";
  const Parameter* qkv = model.layers().at(0)->FindParameter("self_attention.linear_qkv.weight");
  EXPECT_FALSE(qkv->value.grad().defined());
  store.Flush();
  EXPECT_TRUE(qkv->value.grad().defined());
}

TEST(RotaryTest, IsARotationThatDependsOnRelativePosition) {
  const int64_t s = 6, d = 8;
  at::Generator gen = MakeGenerator(3, "rotary");
  at::Tensor q0 = at::randn({d}, gen, at::kDouble);
  at::Tensor k0 = at::randn({d}, gen, at::kDouble);
  at::Tensor q = ApplyRotary(q0.expand({1, 1, s, d}).contiguous(), 10000.0)[0][0];
  at::Tensor k = ApplyRotary(k0.expand({1, 1, s, d}).contiguous(), 10000.0)[0][0];
  // Norm preserved at every position.
  EXPECT_LT(testing::MaxAbsDiff(q.norm(2, {1}), q0.norm().expand({s})), 1e-12);
  // <q_m, k_n> is a function of m - n only.
  at::Tensor scores = at::matmul(q, k.t());
  for (int64_t m = 1; m < s; ++m) {
    for (int64_t n = 1; n < s; ++n) {
      EXPECT_NEAR(scores[m][n].item<double>(), scores[m - 1][n - 1].item<double>(), 1e-12);
    }
  }
  // Position 0 is the identity.
  EXPECT_LT(testing::MaxAbsDiff(q[0], q0), 1e-15);
}

TEST(DropoutTest, MasksAreKeyedByCounters) {
  at::Tensor x = at::ones({64, 64});
  ForwardContext a{true, 3, 16};
  ForwardContext b{true, 3, 20};
  at::Tensor ya = Dropout(x, 0.25, 1, "site", 0, a);
  EXPECT_TRUE(at::equal(ya, Dropout(x, 0.25, 1, "site", 0, a))) << "same key, same mask";
  EXPECT_FALSE(at::equal(ya, Dropout(x, 0.25, 1, "site", 0, b)));
  EXPECT_FALSE(at::equal(ya, Dropout(x, 0.25, 1, "site", 1, a)));
  EXPECT_FALSE(at::equal(ya, Dropout(x, 0.25, 1, "other", 0, a)));
  // Kept entries are scaled by 1/(1-p); the keep rate is about 1-p.
  at::Tensor kept = ya.ne(0);
  EXPECT_TRUE(at::allclose(ya.masked_select(kept), at::full({1}, 1.0 / 0.75)));
  EXPECT_NEAR(kept.to(at::kDouble).mean().item<double>(), 0.75, 0.03);
  ForwardContext eval{false, 3, 16};
  EXPECT_TRUE(at::equal(Dropout(x, 0.25, 1, "site", 0, eval), x));
}

// A stage holding layers [1, 2) initialises them exactly as the whole model does.
TEST(GptModelTest, InitialisationIsLayoutIndependent) {
  ModelOptions options = SmallModel();
  options.num_layers = 3;
  GptModel whole(options);
  GptModel stage(options, StageSpec{1, 2, /*has_embedding=*/false, /*has_head=*/false});
  ASSERT_EQ(stage.Units().size(), 1u);
  Unit* a = whole.layers().at(1).get();
  Unit* b = stage.layers().at(1).get();
  ASSERT_EQ(a->parameters().size(), b->parameters().size());
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(a->parameters()[i].value, b->parameters()[i].value))
        << a->GlobalName(a->parameters()[i].name);
  }
  // Distinct layers get distinct weights.
  EXPECT_FALSE(at::equal(whole.layers().at(0)->parameters()[2].value,
                         whole.layers().at(1)->parameters()[2].value));
}

TEST(UnitTest, StateRoundTripsThroughGlobalNames) {
  ModelOptions options = SmallModel();
  GptModel source(options);
  for (Unit* unit : source.Units()) {
    unit->set_optimizer_step(5);
    for (Parameter& p : unit->parameters()) {
      p.OptimizerState("exp_avg") = at::full_like(p.value, 0.5);
      p.OptimizerState("exp_avg_sq") = at::full_like(p.value, 0.25);
    }
  }
  std::map<std::string, at::Tensor> saved;
  for (Unit* unit : source.Units()) {
    for (auto& [name, tensor] : unit->StateTensors()) saved.emplace(name, tensor);
  }
  EXPECT_TRUE(saved.count("layers.1.mlp.linear_fc2.weight"));
  EXPECT_TRUE(saved.count("optimizer.layers.1.mlp.linear_fc2.weight.exp_avg_sq"));
  EXPECT_TRUE(saved.count("optimizer.embedding.step"));

  options.seed = 999;  // different initial weights
  GptModel target(options);
  auto lookup = [&](const std::string& name) -> absl::StatusOr<at::Tensor> {
    auto it = saved.find(name);
    if (it == saved.end()) return absl::NotFoundError(name);
    return it->second;
  };
  for (Unit* unit : target.Units()) ASSERT_TRUE(unit->LoadStateTensors(lookup, AdamW(OptimizerOptions()).StateSlots()).ok());
  auto s = source.Units();
  auto t = target.Units();
  for (size_t u = 0; u < s.size(); ++u) {
    EXPECT_EQ(t[u]->optimizer_step(), 5);
    for (size_t p = 0; p < s[u]->parameters().size(); ++p) {
      EXPECT_TRUE(at::equal(s[u]->parameters()[p].value, t[u]->parameters()[p].value));
      EXPECT_TRUE(at::equal(t[u]->parameters()[p].OptimizerState("exp_avg_sq"), at::full_like(t[u]->parameters()[p].value, 0.25)));
    }
  }
  // A missing parameter is an error naming it.
  saved.erase("layers.0.input_layernorm.bias");
  absl::Status status = target.layers().at(0)->LoadStateTensors(lookup, AdamW(OptimizerOptions()).StateSlots());
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("layers.0.input_layernorm.bias"), std::string::npos);
}

}  // namespace
}  // namespace fulcrum
