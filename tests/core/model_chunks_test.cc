// NOTE [model chunks] (core/gpt_model.h): one GptModel holding several non-adjacent layer
// ranges (a rank's chunks under virtual pipeline stages) runs each chunk alone, matches a
// whole model layer for layer, and checks what it holds.
#include <torch/torch.h>

#include "core/gpt_model.h"
#include "core/random.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing::SmallModelOf;

StageSpec Chunks(std::vector<std::pair<int64_t, int64_t>> ranges, bool embedding, bool head) {
  StageSpec spec;
  spec.has_embedding = embedding;
  spec.has_head = head;
  spec.chunk_ranges = std::move(ranges);
  return spec;
}

// ZB-V's rank 0 at p = 2, L = 8: chunk 0 = [0, 2), chunk 1 = [6, 8), embedding and head.
// Running the whole model as embed → chunk 0 → (the other rank's [2, 6)) → chunk 1 → head
// gives the whole model's loss and gradients bit for bit.
TEST(GptModelChunksTest, ChunksRunTheirOwnLayersAndMatchTheWholeModel) {
  const ModelOptions options = SmallModelOf(8, 16);
  GptModel whole(options);
  GptModel outer(options, Chunks({{0, 2}, {6, 8}}, true, true));
  GptModel inner(options, Chunks({{2, 6}}, false, false));
  EXPECT_EQ(outer.num_chunks(), 2);
  EXPECT_EQ(outer.chunk_range(1), (std::pair<int64_t, int64_t>{6, 8}));
  EXPECT_EQ(outer.layers().size(), 4u);
  EXPECT_EQ(outer.Units().size(), 6u);  // embedding, 4 layers, head
  EXPECT_TRUE(outer.CheckChunkRanges().ok());
  EXPECT_EQ(inner.num_chunks(), 1);
  EXPECT_TRUE(inner.CheckChunkRanges().ok());

  at::Generator gen = MakeGenerator(3, "tokens");
  const at::Tensor tokens = at::randint(options.vocab_size, {2, options.seq_length + 1}, gen,
                                        at::TensorOptions().dtype(at::kLong));
  ForwardContext ctx;
  ctx.training = true;
  LossSum reference = whole.ForwardLoss(tokens, ctx);
  reference.sum.backward();

  const int64_t s = options.seq_length;
  at::Tensor h = outer.Embed(tokens.narrow(1, 0, s), ctx);
  h = outer.ForwardLayers(h, ctx, 0, 2);
  h = inner.ForwardLayers(h, ctx, 2, 6);
  h = outer.ForwardLayers(h, ctx, 6, 8);
  LossSum loss = outer.HeadLoss(h, tokens.narrow(1, 1, s));
  loss.sum.backward();
  EXPECT_TRUE(at::equal(loss.sum, reference.sum));
  for (GptModel* part : {&outer, &inner}) {
    for (const auto& [index, layer] : part->layers()) {
      const Unit* ref = whole.layers().at(index).get();
      for (size_t p = 0; p < layer->parameters().size(); ++p) {
        EXPECT_TRUE(at::equal(layer->parameters()[p].value.grad(), ref->parameters()[p].value.grad()))
            << layer->GlobalName(layer->parameters()[p].name);
      }
    }
  }
  // A chunk range the stage does not hold is refused by name.
  EXPECT_THROW(outer.ForwardLayers(h, ctx, 1, 3), c10::Error);

  // NOTE [tied head on the embedding's rank]: only the rank holding both ends of the tied
  // model keeps the head's second gradient of the embeddings, vocab × h fp32 here.
  EXPECT_EQ(outer.TiedHeadGradientBytes(), options.vocab_size * options.hidden_size * 4);
  EXPECT_EQ(inner.TiedHeadGradientBytes(), 0);
  EXPECT_EQ(whole.TiedHeadGradientBytes(), 0) << "one chunk: the head uses the embeddings' own";
  ModelOptions untied = options;
  untied.tie_embeddings = false;
  EXPECT_EQ(GptModel(untied, Chunks({{0, 2}, {6, 8}}, true, true)).TiedHeadGradientBytes(), 0);
}

// NOTE [frozen prefix] per chunk: with layers [0, 3) frozen, rank 0's chunk 0 = [0, 2) has
// neither an input nor an output that needs a gradient, its chunk 1 = [6, 8) both; the
// single-range answers stay those of the whole span.
TEST(GptModelChunksTest, GradientNeedsPerChunk) {
  const ModelOptions options = SmallModelOf(8, 16);
  GptModel outer(options, Chunks({{0, 2}, {6, 8}}, true, true));
  outer.set_frozen_prefix(3);
  EXPECT_FALSE(outer.input_needs_grad(0));
  EXPECT_FALSE(outer.output_needs_grad(0));
  EXPECT_TRUE(outer.input_needs_grad(1));
  EXPECT_TRUE(outer.output_needs_grad(1));
  // Everything frozen: only the chunk ending the model at the head still needs its output's.
  outer.set_frozen_prefix(8);
  EXPECT_FALSE(outer.output_needs_grad(0));
  EXPECT_TRUE(outer.output_needs_grad(1));
  EXPECT_FALSE(outer.input_needs_grad(1));
  // One chunk: chunk 0 is the stage's range.
  GptModel single(options, StageSpec{2, 5, false, false});
  single.set_frozen_prefix(3);
  EXPECT_EQ(single.num_chunks(), 1);
  EXPECT_EQ(single.chunk_range(0), (std::pair<int64_t, int64_t>{2, 5}));
  EXPECT_EQ(single.input_needs_grad(0), single.input_needs_grad());
  EXPECT_EQ(single.output_needs_grad(0), single.output_needs_grad());
}

TEST(GptModelChunksTest, ChunkRangesAreCheckedAndMovesShowInCheckChunkRanges) {
  const ModelOptions options = SmallModelOf(8, 16);
  GptModel outer(options, Chunks({{0, 2}, {6, 8}}, true, true));
  EXPECT_FALSE(outer.set_chunk_ranges({{0, 3}, {2, 8}}).ok());  // overlap
  EXPECT_FALSE(outer.set_chunk_ranges({{0, 9}}).ok());          // outside the model
  EXPECT_FALSE(outer.set_chunk_ranges({}).ok());
  // A chunk-local move: layer 1 leaves chunk 0, and chunk 1 would start at 1 — the ranges
  // change, the held layers not; [0,1) + [1,8) is not what it holds.
  ASSERT_TRUE(outer.set_chunk_ranges({{0, 1}, {1, 8}}).ok());
  const absl::Status held = outer.CheckChunkRanges();
  EXPECT_FALSE(held.ok());
  EXPECT_NE(held.message().find("{0,1,6,7}"), std::string::npos) << held;
  ASSERT_TRUE(outer.set_chunk_ranges({{0, 1}, {1, 2}}).ok());
  EXPECT_FALSE(outer.CheckChunkRanges().ok());  // 6 and 7 are held but in no chunk
  ASSERT_TRUE(outer.set_chunk_ranges({{0, 1}, {6, 8}}).ok());
  EXPECT_FALSE(outer.CheckChunkRanges().ok());  // layer 1 is held but in no chunk
  EXPECT_THROW(GptModel(options, Chunks({{0, 4}, {3, 8}}, true, true)), c10::Error);
}

}  // namespace
}  // namespace fulcrum
