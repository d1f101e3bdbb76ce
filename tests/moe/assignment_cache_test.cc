// DynaMoE's assignment cache (moe/assignment_cache.h) on its own: the per-epoch decision
// from the change counts, what a "change" is, exact counts past fp32's 2^24, and the step
// in progress travelling with a migrated layer. The MoE layer's use of it is in
// moe_layer_test.cc; replicas and checkpoints in tests/recipes/moe_train_test.cc.
#include "moe/assignment_cache.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <vector>

#include "core/unit.h"

namespace fulcrum::moe {
namespace {

at::Tensor Positions(std::vector<int64_t> p) { return at::tensor(p, at::kLong); }
at::Tensor ExpertPairs(std::vector<int64_t> e) { return at::tensor(e, at::kLong).view({-1, 2}); }

// One step: forward in `epoch` over `positions` with the router choosing `choice`, then the
// optimizer step on one replica. Returns what Lookup gave.
at::Tensor Step(AssignmentCache& cache, int64_t epoch, const at::Tensor& positions,
                const at::Tensor& choice) {
  cache.BeginForward(epoch);
  at::Tensor cached = cache.Lookup(positions);
  cache.Record(positions, cached, choice, cache.active());
  cache.AfterOptimizerStep(nullptr, cache.StepCounts());
  return cached;
}

TEST(AssignmentCacheTest, EachEpochIsDecidedByThePreviousOnesChanges) {
  AssignmentCache cache(/*positions=*/10, /*k=*/2, /*threshold=*/0.3);
  const at::Tensor tokens = Positions({7, 2, 4, 9});
  const at::Tensor first = ExpertPairs({0, 1, 2, 3, 1, 3, 0, 2});
  // Epoch 0: nothing cached.
  EXPECT_TRUE(Step(cache, 0, tokens, first).eq(-1).all().item<bool>());
  EXPECT_FALSE(cache.active());
  // Epoch 1 meets the tokens again; epoch 0 met nothing again, so still live. Token 2 swaps
  // the order of its experts (no change), token 4 changes one expert (a change).
  cache.BeginForward(1);
  EXPECT_FALSE(cache.active());
  EXPECT_EQ(cache.last_epoch_change_fraction(), -1.0);
  at::Tensor cached = cache.Lookup(tokens);
  EXPECT_TRUE(cached.equal(first));
  cache.Record(tokens, cached, ExpertPairs({0, 1, 3, 2, 1, 0, 0, 2}), false);
  EXPECT_EQ(cache.StepCounts(), (std::vector<int64_t>{1, 4, 0}));
  cache.AfterOptimizerStep(nullptr, cache.StepCounts());
  EXPECT_TRUE(cache.Lookup(Positions({4})).equal(ExpertPairs({1, 0}))) << "the table follows";
  // Epoch 2: 1/4 changed < 0.3, so the cache routes; a second step of epoch 1 would not
  // have decided anything yet.
  Step(cache, 2, tokens, ExpertPairs({0, 1, 3, 2, 1, 0, 0, 2}));
  EXPECT_TRUE(cache.active());
  EXPECT_DOUBLE_EQ(cache.last_epoch_change_fraction(), 0.25);
  // Epoch 2 changed nothing; epoch 3 routes by the cache and counts its tokens as such,
  // while the router drifts: 2 of 4 change.
  cache.BeginForward(3);
  EXPECT_TRUE(cache.active());
  cached = cache.Lookup(tokens);
  cache.Record(tokens, cached, ExpertPairs({3, 2, 3, 2, 1, 2, 2, 0}), cache.active());
  EXPECT_EQ(cache.StepCounts(), (std::vector<int64_t>{2, 4, 4}));
  cache.AfterOptimizerStep(nullptr, cache.StepCounts());
  // Epoch 4: 0.5 ≥ 0.3, back to live routing.
  cache.BeginForward(4);
  EXPECT_FALSE(cache.active());
  EXPECT_DOUBLE_EQ(cache.last_epoch_change_fraction(), 0.5);
}

TEST(AssignmentCacheTest, UnseenTokensAreNotCountedAndPositionsAreChecked) {
  AssignmentCache cache(6, 2, 0.5);
  Step(cache, 0, Positions({0, 1}), ExpertPairs({0, 1, 1, 2}));
  cache.BeginForward(1);
  at::Tensor cached = cache.Lookup(Positions({1, 5}));
  EXPECT_TRUE(cached.equal(ExpertPairs({1, 2, -1, -1})));
  cache.Record(Positions({1, 5}), cached, ExpertPairs({0, 3, 0, 3}), false);
  EXPECT_EQ(cache.StepCounts(), (std::vector<int64_t>{1, 1, 0})) << "only token 1 was met again";
  EXPECT_THROW(cache.Lookup(Positions({6})), c10::Error);
  EXPECT_THROW(cache.Lookup(Positions({-1})), c10::Error);
}

// The table and counters are unit buffers: a copy of them (a checkpoint, a migration) makes
// the same decisions, and counts beyond fp32's 2^24 stay exact in them.
TEST(AssignmentCacheTest, StateLivesInUnitBuffersAndCountsStayExact) {
  Unit unit("layers.0"), copy_unit("layers.0");
  AssignmentCache cache(8, 2, 0.5), copy(8, 2, 0.5);
  cache.Register(unit, "mlp.");
  copy.Register(copy_unit, "mlp.");
  ASSERT_EQ(unit.buffers().size(), 2u);
  EXPECT_EQ(unit.buffers()[0].first, "mlp.assignment_cache");
  EXPECT_EQ(unit.buffers()[1].first, "mlp.assignment_cache_state");
  cache.BeginForward(5);
  // Exactly, 2^24 / (2^25 + 1) < 0.5 routes by the cache; fp32 would round the count of
  // tokens met to 2^25, giving 0.5, which does not.
  const int64_t met = (int64_t{1} << 25) + 1;
  const int64_t changed = int64_t{1} << 24;
  cache.AfterOptimizerStep(nullptr, {changed, met, 0});
  Step(cache, 5, Positions({3}), ExpertPairs({1, 0}));
  std::map<std::string, at::Tensor> state;
  for (auto& [name, tensor] : unit.MigrationTensors()) state[name] = tensor.clone();
  ASSERT_TRUE(copy_unit.LoadMigrationTensors(state).ok());
  copy.BeginForward(6);
  EXPECT_TRUE(copy.active()) << "a fraction just under the threshold";
  EXPECT_TRUE(copy.Lookup(Positions({3})).equal(ExpertPairs({1, 0})));
}

// A layer that moves mid-step takes the step's records along: the new owner ends the step
// with the table and counts of a layer that never moved. Positions past 2^24 survive the
// fp32 transport.
TEST(AssignmentCacheTest, TheStepInProgressTravelsWithAMigration) {
  const int64_t big = (int64_t{1} << 24) + 5;
  const int64_t size = big + 3;
  AssignmentCache stay(size, 1, 0.5), before(size, 1, 0.5), after(size, 1, 0.5);
  auto one = [](std::vector<int64_t> e) { return at::tensor(e, at::kLong).view({-1, 1}); };
  for (AssignmentCache* c : {&stay, &before, &after}) Step(*c, 0, Positions({1, big}), one({2, 3}));
  // Epoch 1, micro-batch 1 on `before`, then the move, then micro-batch 2 on `after`.
  for (AssignmentCache* c : {&stay, &before}) {
    c->BeginForward(1);
    c->Record(Positions({big, 4}), c->Lookup(Positions({big, 4})), one({0, 1}), false);
  }
  after.LoadStepState(before.StepState());
  for (AssignmentCache* c : {&stay, &after}) {
    c->BeginForward(1);
    c->Record(Positions({1}), c->Lookup(Positions({1})), one({2}), false);
  }
  EXPECT_EQ(after.StepCounts(), stay.StepCounts());
  EXPECT_EQ(stay.StepCounts(), (std::vector<int64_t>{1, 2, 0}));
  stay.AfterOptimizerStep(nullptr, stay.StepCounts());
  after.AfterOptimizerStep(nullptr, after.StepCounts());
  const at::Tensor probe = Positions({1, 4, big});
  EXPECT_TRUE(after.Lookup(probe).equal(stay.Lookup(probe)));
  EXPECT_TRUE(stay.Lookup(probe).equal(one({2, 1, 0})));
}

}  // namespace
}  // namespace fulcrum::moe
