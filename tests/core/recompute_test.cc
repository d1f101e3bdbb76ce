// NOTE [activation recomputation] (core/transformer_layer.h): a recomputed layer gives the
// plain layer's output and gradients bit for bit — dropout on, with and without the B/W
// split (its weight gradients still deferred under the forward's tag) — and keeps only its
// input between the forward and the backward.
#include <torch/torch.h>

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/linear.h"
#include "core/random.h"
#include "core/transformer_layer.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing::LiveBytes;

ModelOptions Options() {
  ModelOptions o;
  o.num_layers = 2;
  o.hidden_size = 32;
  o.num_attention_heads = 4;
  o.ffn_hidden_size = 128;
  o.seq_length = 16;
  o.vocab_size = 64;
  o.hidden_dropout = 0.1;
  o.attention_dropout = 0.1;
  return o;
}

struct Result {
  at::Tensor output, input_grad;
  std::vector<at::Tensor> grads;
  size_t queued = 0;
  bool weight_grads_before_w = false;
};

// How the layer runs: plainly, wholly recomputed (full), or with its attention core
// recomputed (selective).
enum class Mode { kPlain, kFull, kSelective };

const char* ModeName(Mode mode) {
  return mode == Mode::kPlain ? "plain" : mode == Mode::kFull ? "full" : "selective";
}

Result RunLayer(Mode mode, bool deferred) {
  ModelOptions o = Options();
  o.recompute_attention = mode == Mode::kSelective;
  const bool recompute = mode == Mode::kFull;
  TransformerLayer layer(o, 1);
  at::Generator gen = MakeGenerator(9, "recompute_test");
  const at::Tensor x = at::randn({o.seq_length, 3, o.hidden_size}, gen);
  const at::Tensor upstream = at::randn({o.seq_length, 3, o.hidden_size}, gen);
  at::Tensor input = x.clone().requires_grad_(true);
  const ForwardContext ctx{true, 3, 8, 0.5};
  Result r;
  WeightGradStore store;
  {
    WeightGradStore::Scope scope(deferred ? &store : nullptr);
    {
      WeightGradStore::TagScope tag(1);
      r.output = recompute ? RecomputedForward(layer, input, ctx) : layer.Forward(input, ctx);
    }
    // The backward runs outside the forward's tag, as the executor's B action does.
    (r.output * upstream).sum().backward();
  }
  r.queued = store.size();
  for (const Parameter& p : layer.parameters()) {
    if (p.name.find("weight") != std::string::npos && p.name.find("linear") != std::string::npos) {
      r.weight_grads_before_w = r.weight_grads_before_w || p.value.grad().defined();
    }
  }
  store.FlushTag(1);
  EXPECT_TRUE(store.empty()) << "every deferred weight gradient carries the forward's tag";
  r.input_grad = input.grad();
  for (const Parameter& p : layer.parameters()) r.grads.push_back(p.value.grad());
  return r;
}

TEST(RecomputeTest, GradientsEqualThePlainLayerBitForBitWithAndWithoutTheSplit) {
  for (const auto& [mode, deferred] : {std::pair{Mode::kFull, false}, std::pair{Mode::kFull, true},
                                      std::pair{Mode::kSelective, false},
                                      std::pair{Mode::kSelective, true}}) {
    SCOPED_TRACE(std::string(ModeName(mode)) + (deferred ? ", B/W split" : ", fused backward"));
    const Result plain = RunLayer(Mode::kPlain, deferred);
    const Result again = RunLayer(mode, deferred);
    EXPECT_TRUE(at::equal(plain.output, again.output));
    ASSERT_TRUE(again.input_grad.defined());
    EXPECT_TRUE(at::equal(plain.input_grad, again.input_grad));
    ASSERT_EQ(plain.grads.size(), again.grads.size());
    for (size_t i = 0; i < plain.grads.size(); ++i) {
      ASSERT_TRUE(plain.grads[i].defined() && again.grads[i].defined()) << i;
      EXPECT_TRUE(at::equal(plain.grads[i], again.grads[i])) << "parameter " << i;
    }
    EXPECT_EQ(again.queued, plain.queued);
    if (deferred) {
      EXPECT_GT(again.queued, 0u);
      EXPECT_FALSE(again.weight_grads_before_w) << "the recomputed GEMMs' weight gradients wait for W";
    }
  }
  // Dropout acted: without it the output is another one (so the recomputed forward had to
  // redraw the same masks to match).
  ModelOptions o = Options();
  o.hidden_dropout = o.attention_dropout = 0.0;
  TransformerLayer layer(o, 1);
  at::Generator gen = MakeGenerator(9, "recompute_test");
  const at::Tensor x = at::randn({o.seq_length, 3, o.hidden_size}, gen);
  const at::Tensor with_dropout = RunLayer(Mode::kPlain, false).output;
  at::NoGradGuard no_grad;
  EXPECT_FALSE(at::equal(layer.Forward(x, ForwardContext{true, 3, 8, 0.5}), with_dropout));
}

// Bytes alive after the forward beyond the input and the parameters: what autograd keeps
// for the backward, and the output.
int64_t ForwardKeeps(Mode mode) {
  ModelOptions o = Options();
  o.recompute_attention = mode == Mode::kSelective;
  const bool recompute = mode == Mode::kFull;
  TransformerLayer layer(o, 1);
  at::Tensor input = at::randn({o.seq_length, 4, o.hidden_size}, MakeGenerator(4, "keeps"))
                         .requires_grad_(true);
  auto live = std::make_shared<LiveBytes>();
  c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
  const ForwardContext ctx{true, 1, 0, 0.5};
  at::Tensor y = recompute ? RecomputedForward(layer, input, ctx) : layer.Forward(input, ctx);
  return live->live();
}

TEST(RecomputeTest, KeepsOnlyTheOutputBetweenForwardAndBackward) {
  const ModelOptions o = Options();
  const int64_t hidden_bytes = o.seq_length * 4 * o.hidden_size * 4;  // one [s, b, h] fp32
  const int64_t plain = ForwardKeeps(Mode::kPlain);
  const int64_t again = ForwardKeeps(Mode::kFull);
  // The recomputed layer allocates the output alone (its input is the caller's, saved by
  // reference); the plain one keeps many [s, b, h]-sized intermediates and the attention
  // probabilities that dropout needs.
  EXPECT_EQ(again, hidden_bytes) << "plain " << plain;
  EXPECT_GT(plain, 8 * hidden_bytes);
}

// Selective: the attention core keeps q, k and v alone. With attention dropout on the plain
// core keeps the probabilities, their masks and the dropped probabilities (s×s per head);
// those go, and the rest of the layer keeps what it kept.
TEST(RecomputeTest, SelectiveDropsTheAttentionCoresSquareTensors) {
  const ModelOptions o = Options();
  const int64_t square_bytes = 4 * o.num_attention_heads * o.seq_length * o.seq_length * 4;  // b = 4
  const int64_t plain = ForwardKeeps(Mode::kPlain);
  const int64_t selective = ForwardKeeps(Mode::kSelective);
  const int64_t full = ForwardKeeps(Mode::kFull);
  std::cout << "the layer's forward keeps " << plain << " bytes plain, " << selective
            << " with its attention core recomputed, " << full << " recomputed whole (one "
            << "[b, heads, s, s] is " << square_bytes << ")" << std::endl;
  EXPECT_LE(selective, plain - 2 * square_bytes);
  EXPECT_GT(selective, full);
}

}  // namespace
}  // namespace fulcrum
