// Each tensor-parallel piece against its single-process twin, on real processes: every rank
// builds the sharded unit (tp = 2 or 4 over Gloo) and the unsharded one from the same seed,
// runs the same input forward and backward, and checks that outputs and input gradients
// match and that each sharded parameter's gradient is its slice of the full gradient.
//
// The TpWorker cases run only under fulcrum_launch, started by SlowTensorParallelTest.
#include <torch/torch.h>

#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <iostream>
#include <vector>
#include <string>

#include <gtest/gtest.h>

#include "core/gpt_model.h"
#include "core/random.h"
#include "core/tensor_parallel.h"
#include "core/transformer_layer.h"
#include "parallel/comm_tensor_parallel_group.h"
#include "parallel/world.h"
#include "tests/core/test_util.h"
#include "tests/run_command.h"
#include "tests/worker_runs.h"
#include "parallel/world_communicator.h"

namespace fulcrum::parallel {
namespace {

constexpr double kTolerance = 2e-5;

bool IsTpWorker() {
  const char* worker = std::getenv("FULCRUM_TP_WORKER");
  return worker != nullptr && std::string(worker) == "1" && std::getenv("RANK") != nullptr;
}

Communicator& TpWorld() {
  static std::unique_ptr<Communicator> world = [] {
    auto info = WorldInfoFromEnvironment();
    if (!info.ok()) throw CommError(std::string(info.status().message()));
    auto comm = CreateWorldCommunicator(*info, Backend::kGloo, std::chrono::seconds(30));
    if (!comm.ok()) throw CommError(std::string(comm.status().message()));
    return std::move(comm).value();
  }();
  return *world;
}

ModelOptions Options() {
  ModelOptions o = fulcrum::testing::SmallModelOf(2, 8);
  o.seed = 11;
  o.hidden_dropout = 0.1;     // masks are keyed by global head / site, so they must agree
  o.attention_dropout = 0.1;
  return o;
}

using fulcrum::testing::MaxAbsDiff;

// Gradients of a sharded unit against the full unit's: slices for sharded parameters,
// equality for replicated ones.
void ExpectShardedGradients(const Unit& sharded, const Unit& full, int rank, int size) {
  ASSERT_EQ(sharded.parameters().size(), full.parameters().size());
  for (size_t i = 0; i < full.parameters().size(); ++i) {
    const Parameter& s = sharded.parameters()[i];
    const Parameter& f = full.parameters()[i];
    ASSERT_TRUE(s.value.grad().defined()) << s.name;
    const at::Tensor expected = ShardOf(f.value.grad(), s.sharding.tp_shard_dim, rank, size);
    EXPECT_LT(MaxAbsDiff(s.value.grad(), expected), kTolerance) << full.GlobalName(f.name);
    EXPECT_TRUE(at::equal(s.value, ShardOf(f.value, s.sharding.tp_shard_dim, rank, size)))
        << "initial value of " << full.GlobalName(f.name) << " is a slice of the full one";
    // A slice holds its own elements only, not the whole initial tensor's storage (a
    // dimension-0 view of it would, on every rank).
    EXPECT_EQ(s.value.storage().nbytes(), s.value.numel() * s.value.element_size())
        << full.GlobalName(f.name);
  }
}

TEST(TpWorker, TransformerLayerMatchesSingleProcess) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  Communicator& world = TpWorld();
  CommTensorParallelGroup tp(&world);
  const ModelOptions options = Options();
  for (PositionEmbedding pe : {PositionEmbedding::kLearned, PositionEmbedding::kRotary}) {
    ModelOptions o = options;
    o.position_embedding = pe;
    TransformerLayer full(o, 1);
    TransformerLayer sharded(o, 1, &tp);
    at::Generator gen = MakeGenerator(3, "tp_input");
    at::Tensor x = at::randn({o.seq_length, 3, o.hidden_size}, gen, at::kFloat);
    at::Tensor upstream = at::randn({o.seq_length, 3, o.hidden_size}, gen, at::kFloat);
    ForwardContext ctx{true, 5, 40};
    at::Tensor x_full = x.clone().requires_grad_(true);
    at::Tensor x_sharded = x.clone().requires_grad_(true);
    at::Tensor y_full = full.Forward(x_full, ctx);
    at::Tensor y_sharded = sharded.Forward(x_sharded, ctx);
    EXPECT_LT(MaxAbsDiff(y_full, y_sharded), kTolerance) << PositionEmbeddingName(pe);
    (y_full * upstream).sum().backward();
    (y_sharded * upstream).sum().backward();
    EXPECT_LT(MaxAbsDiff(x_full.grad(), x_sharded.grad()), kTolerance);
    ExpectShardedGradients(sharded, full, world.rank(), world.size());
  }
}

TEST(TpWorker, VocabParallelCrossEntropyMatchesDense) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  Communicator& world = TpWorld();
  CommTensorParallelGroup tp(&world);
  const int64_t vocab = 12 * world.size(), tokens = 10;
  at::Generator gen = MakeGenerator(5, "tp_ce");
  at::Tensor logits = at::randn({tokens, vocab}, gen, at::kFloat) * 3;
  at::Tensor targets = at::randint(vocab, {tokens}, gen, at::TensorOptions().dtype(at::kLong));
  at::Tensor dense = logits.clone().requires_grad_(true);
  at::Tensor shard = ShardOf(logits, 1, world.rank(), world.size()).requires_grad_(true);
  at::Tensor expected = at::cross_entropy_loss(dense, targets, {}, at::Reduction::None);
  at::Tensor got = VocabParallelCrossEntropy(shard, targets, world.rank() * (vocab / world.size()), &tp);
  EXPECT_LT(MaxAbsDiff(expected, got), 1e-5);
  at::Tensor weights = at::arange(tokens, at::kFloat);
  (expected * weights).sum().backward();
  (got * weights).sum().backward();
  // Gradients are weighted by up to 9: fp32 rounding of ~1e-7 relative.
  EXPECT_LT(MaxAbsDiff(ShardOf(dense.grad(), 1, world.rank(), world.size()), shard.grad()), 1e-5);
}

TEST(ShardOfTest, EachSliceOwnsItsStorage) {
  const at::Tensor full = at::arange(24, at::kFloat).view({6, 4});
  for (int64_t dim : {0, 1}) {
    const at::Tensor shard = ShardOf(full, dim, 1, 2);
    EXPECT_TRUE(at::equal(shard, full.narrow(dim, dim == 0 ? 3 : 2, dim == 0 ? 3 : 2)));
    EXPECT_FALSE(shard.is_alias_of(full)) << "dim " << dim;
    EXPECT_EQ(shard.storage().nbytes(), 12 * sizeof(float)) << "dim " << dim;
  }
}

// NOTE [sequence parallelism] in core/tensor_parallel.h.
ModelOptions SequenceParallel(ModelOptions o) {
  o.sequence_parallel = true;
  return o;
}

// The gradients of a sequence-parallel unit against the full unit's, after the sum over
// the group that ParallelContext::AllReduceModelParallelGradients does: slices for sharded
// parameters, equality for replicated ones. Returns the names marked sequence_parallel.
std::vector<std::string> ExpectSequenceParallelGradients(Unit& sharded, const Unit& full,
                                                         CommTensorParallelGroup& tp) {
  std::vector<std::string> marked;
  for (Parameter& p : sharded.parameters()) {
    if (!p.sharding.sequence_parallel) continue;
    marked.push_back(p.name);
    at::Tensor& g = p.value.mutable_grad();
    tp.AllReduceSum(g);
  }
  ExpectShardedGradients(sharded, full, tp.rank(), tp.size());
  return marked;
}

// A layer's shard of the residual stream in, its shard out: the rows of the full layer's
// output, the rows of its input gradient, and — once the marked parameters' gradients are
// summed over the group — every parameter gradient of the full layer. Dropout on (0.1 at
// both sites): each rank keeps its rows of the whole mask.
TEST(TpWorker, SequenceParallelLayerMatchesSingleProcess) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  Communicator& world = TpWorld();
  CommTensorParallelGroup tp(&world);
  for (PositionEmbedding pe : {PositionEmbedding::kLearned, PositionEmbedding::kRotary}) {
    ModelOptions o = Options();
    o.position_embedding = pe;
    TransformerLayer full(o, 1);
    TransformerLayer sharded(SequenceParallel(o), 1, &tp);
    at::Generator gen = MakeGenerator(3, "sp_input");
    at::Tensor x = at::randn({o.seq_length, 3, o.hidden_size}, gen, at::kFloat);
    at::Tensor upstream = at::randn({o.seq_length, 3, o.hidden_size}, gen, at::kFloat);
    ForwardContext ctx{true, 5, 40};
    at::Tensor x_full = x.clone().requires_grad_(true);
    at::Tensor x_shard = ShardOf(x, 0, world.rank(), world.size()).requires_grad_(true);
    at::Tensor y_full = full.Forward(x_full, ctx);
    at::Tensor y_shard = sharded.Forward(x_shard, ctx);
    ASSERT_EQ(y_shard.size(0), o.seq_length / world.size()) << "the output is this rank's rows";
    EXPECT_LT(MaxAbsDiff(ShardOf(y_full, 0, world.rank(), world.size()), y_shard), kTolerance)
        << PositionEmbeddingName(pe);
    (y_full * upstream).sum().backward();
    (y_shard * ShardOf(upstream, 0, world.rank(), world.size())).sum().backward();
    EXPECT_LT(MaxAbsDiff(ShardOf(x_full.grad(), 0, world.rank(), world.size()), x_shard.grad()),
              kTolerance);
    const std::vector<std::string> marked = ExpectSequenceParallelGradients(sharded, full, tp);
    EXPECT_EQ(marked, (std::vector<std::string>{
                          "input_layernorm.weight", "input_layernorm.bias",
                          "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight",
                          "pre_mlp_layernorm.bias", "mlp.linear_fc2.bias"}));
  }
}

// The whole model on one stage, tied and untied, against the single-process model: the
// loss and every gradient (slices of the sharded parameters, after the sum over the group
// that ParallelContext::AllReduceModelParallelGradients does for the marked ones).
// Returns, per tying, the global names of the parameters marked sequence_parallel.
std::vector<std::vector<std::string>> ExpectModelMatchesSingleProcess(bool sequence_parallel) {
  Communicator& world = TpWorld();
  CommTensorParallelGroup tp(&world);
  std::vector<std::vector<std::string>> marked_per_tying;
  for (bool tied : {true, false}) {
    ModelOptions o = Options();
    o.tie_embeddings = tied;
    o.sequence_parallel = sequence_parallel;
    ModelOptions single = o;
    single.sequence_parallel = false;
    GptModel full(single);
    GptModel sharded(o, StageSpec(), &tp);
    EXPECT_EQ(sharded.local_sequence_length(),
              sequence_parallel ? o.seq_length / world.size() : o.seq_length);
    at::Generator gen = MakeGenerator(4, sequence_parallel ? "sp_tokens" : "tp_tokens");
    at::Tensor tokens = at::randint(o.vocab_size, {3, o.seq_length + 1}, gen,
                                    at::TensorOptions().dtype(at::kLong));
    ForwardContext ctx{true, 2, 8};
    LossSum a = full.ForwardLoss(tokens, ctx);
    LossSum b = sharded.ForwardLoss(tokens, ctx);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_NEAR(a.sum.item<double>(), b.sum.item<double>(), kTolerance * a.sum.item<double>())
        << (tied ? "tied" : "untied");
    a.sum.backward();
    b.sum.backward();
    auto full_units = full.Units();
    auto sharded_units = sharded.Units();
    EXPECT_EQ(full_units.size(), sharded_units.size());
    std::vector<std::string> marked;
    for (size_t u = 0; u < std::min(full_units.size(), sharded_units.size()); ++u) {
      for (const std::string& name :
           ExpectSequenceParallelGradients(*sharded_units[u], *full_units[u], tp)) {
        marked.push_back(sharded_units[u]->GlobalName(name));
      }
    }
    marked_per_tying.push_back(std::move(marked));
  }
  return marked_per_tying;
}

// The vocab-parallel embedding and head with tensor-parallel layers: nothing is marked.
TEST(TpWorker, VocabParallelEmbeddingAndHeadMatchSingleProcess) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  for (const auto& marked : ExpectModelMatchesSingleProcess(/*sequence_parallel=*/false)) {
    EXPECT_TRUE(marked.empty());
  }
}

// With sequence parallelism: the embedding (vocab-parallel, then reduce-scattered over the
// sequence), layers on shards, the head gathering the sequence before its vocab-parallel
// output layer.
TEST(TpWorker, SequenceParallelModelMatchesSingleProcess) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  for (const auto& marked : ExpectModelMatchesSingleProcess(/*sequence_parallel=*/true)) {
    // The position embeddings, 6 per layer, the final norm's two.
    ASSERT_EQ(marked.size(), 1u + 6u * Options().num_layers + 2u);
    EXPECT_EQ(marked.front(), "embedding.position_embeddings.weight");
    EXPECT_EQ(marked.back(), "head.final_layernorm.bias");
  }
}

// What a layer's forward keeps for the backward, with and without sequence parallelism:
// the norms', the dropouts' and the residual adds' tensors are this rank's rows only.
// The reporter is this thread's: a tensor a Gloo worker thread released last would never
// report its free here. The communicator drops finished works on the calling thread (NOTE
// [collective tensors freed here] in parallel/gloo_communicator.cc), but only within a
// bounded wait, so a measurement can only be too high: the least of five is taken.
int64_t LayerForwardKeeps(const ModelOptions& o, TensorParallelGroup* tp, bool recompute) {
  TransformerLayer layer(o, 1, tp);
  const int64_t rows = o.sequence_parallel ? o.seq_length / tp->size() : o.seq_length;
  int64_t least = std::numeric_limits<int64_t>::max();
  for (int attempt = 0; attempt < 5; ++attempt) {
    at::Tensor x = at::randn({rows, 4, o.hidden_size}, MakeGenerator(6, "sp_keeps"), at::kFloat)
                       .requires_grad_(true);
    auto live = std::make_shared<fulcrum::testing::LiveBytes>();
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
    const ForwardContext ctx{true, 1, 0};
    at::Tensor y = recompute ? RecomputedForward(layer, x, ctx) : layer.Forward(x, ctx);
    least = std::min(least, live->live());
  }
  return least;
}

TEST(TpWorker, SequenceParallelLayerKeepsLessForTheBackward) {
  if (!IsTpWorker()) GTEST_SKIP() << "runs under fulcrum_launch";
  Communicator& world = TpWorld();
  CommTensorParallelGroup tp(&world);
  const ModelOptions o = Options();  // dropout 0.1 at both sites
  const int64_t rows_bytes = o.seq_length * 4 * o.hidden_size * 4;  // one [s, 4, h] fp32
  const int64_t plain = LayerForwardKeeps(o, &tp, false);
  const int64_t sequence = LayerForwardKeeps(SequenceParallel(o), &tp, false);
  const int64_t recomputed = LayerForwardKeeps(o, &tp, true);
  const int64_t both = LayerForwardKeeps(SequenceParallel(o), &tp, true);
  std::cout << "rank " << world.rank() << ": a layer's forward keeps " << plain << " bytes, "
            << sequence << " sequence-parallel; recomputed " << recomputed << ", " << both
            << " sequence-parallel (one [s, b, h] is " << rows_bytes << ")" << std::endl;
  // Four [s, b, h] tensors between the regions shrink to their rows: both dropout masks,
  // the second norm's input, the output. (The gathered inputs of the column-parallel
  // linears stay whole: NOTE [sequence parallelism].)
  EXPECT_GE(plain - sequence, 4 * rows_bytes - 4 * rows_bytes / world.size());
  // Recomputed, the layer keeps its output alone: this rank's rows of it.
  EXPECT_EQ(recomputed, rows_bytes);
  EXPECT_EQ(both, rows_bytes / world.size());
}

std::string RunWorkers(int n, int* code) {
  const std::string bin = FULCRUM_BIN_DIR;
  const std::string command = "FULCRUM_TP_WORKER=1 " + bin + "/fulcrum_launch --nproc_per_node=" +
                              std::to_string(n) + " --master_port=0 -- " + bin +
                              "/parallel_test --gtest_filter=TpWorker.*";
  std::string output;
  *code = fulcrum::testing::RunCommand(command, &output);
  return output;
}

// Every rank ran and passed every TpWorker case (tests/worker_runs.h).
void ExpectEveryRankPassed(const std::string& output, int n) {
  const int selected =
      fulcrum::testing::CountSelectedTests(std::string(FULCRUM_BIN_DIR) + "/parallel_test",
                                           "TpWorker.*");
  EXPECT_TRUE(fulcrum::testing::RanksRanAndPassed(output, fulcrum::testing::FirstRanks(n), selected))
      << output;
}

TEST(SlowTensorParallelTest, TwoRanks) {
  int code = 0;
  const std::string output = RunWorkers(2, &code);
  EXPECT_EQ(code, 0) << output;
  ExpectEveryRankPassed(output, 2);
}

TEST(SlowTensorParallelTest, FourRanks) {
  int code = 0;
  const std::string output = RunWorkers(4, &code);
  EXPECT_EQ(code, 0) << output;
  ExpectEveryRankPassed(output, 4);
}

}  // namespace
}  // namespace fulcrum::parallel
