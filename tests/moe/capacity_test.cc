// Capacity policy (Tutel's capacity factor), slot assignment in list order, and
// batch-prioritized reordering.
#include "moe/capacity.h"

#include <gtest/gtest.h>

#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::Doubles;
using testing::Eval;
using testing::ExpectNear;
using testing::HandHidden;
using testing::Longs;
using testing::MakeOrDie;
using testing::SetParam;
using testing::TinyOptions;

// A routing built by hand: only expert (and token/probs for prioritising) matter here.
Routing ListRouting(std::vector<int64_t> tokens, std::vector<int64_t> experts) {
  Routing r;
  r.token = at::tensor(tokens);
  r.expert = at::tensor(experts);
  r.gate = at::ones({static_cast<int64_t>(tokens.size())});
  return r;
}

// The top-2 hand example of moe_test_util.h: experts (0, 1, 2, 0 | 1, 2, 0, 1).
Routing HandTopTwo() {
  auto router = MakeOrDie("topk", TinyOptions(3, 3, 2));
  SetParam(*router, "router.weight", at::eye(3));
  return router->Route(HandHidden(), 2, Eval());
}

TEST(CapacityTest, FixedFactorIsCeilOfKXTOverE) {
  const at::Tensor load = at::tensor({3, 5, 1});
  EXPECT_EQ(ExpertCapacity(1.25, 2, 12, load), 10);  // 2·1.25·12/3 = 10 exactly
  EXPECT_EQ(ExpertCapacity(1.0, 1, 10, load), 4);    // 10/3 = 3.33 -> 4
  EXPECT_EQ(ExpertCapacity(1.2, 1, 10, load), 4);    // 1.2·10/3 = 4 (not 4.0000000001 -> 5)
  EXPECT_EQ(ExpertCapacity(0.1, 1, 10, load), 1);    // 1/3 -> 1
  EXPECT_EQ(CeilCapacity(2.0, 2, 6, 4), 6);
}

TEST(CapacityTest, ZeroIsDroplessAndNegativeIsCapped) {
  const at::Tensor load = at::tensor({3, 5, 1});   // T = 9, k = 1, E = 3
  EXPECT_EQ(ExpertCapacity(0.0, 1, 9, load), 5);   // the largest load
  EXPECT_EQ(ExpertCapacity(-1.0, 1, 9, load), 3);  // min(5, ceil(1·9/3) = 3)
  EXPECT_EQ(ExpertCapacity(-2.0, 1, 9, load), 5);  // min(5, 6)
}

// With expert parallelism the need is max-reduced over the group before the cap.
TEST(CapacityTest, NeedIsReducedOnlyWhenDynamic) {
  const at::Tensor load = at::tensor({3, 5, 1});
  int calls = 0;
  auto other_rank_needs_seven = [&calls](int64_t local) {
    ++calls;
    EXPECT_EQ(local, 5);
    return std::max<int64_t>(local, 7);
  };
  EXPECT_EQ(ExpertCapacity(0.0, 1, 9, load, other_rank_needs_seven), 7);
  EXPECT_EQ(ExpertCapacity(-2.0, 1, 9, load, other_rank_needs_seven), 6);  // min(7, 6)
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(ExpertCapacity(1.0, 1, 9, load, other_rank_needs_seven), 3);
  EXPECT_EQ(calls, 2);  // fixed capacity: no collective
}

TEST(CapacityTest, FactorMustBeFinite) {
  EXPECT_TRUE(ValidateCapacityFactor(-1.5).ok());
  EXPECT_TRUE(ValidateCapacityFactor(0.0).ok());
  absl::Status status = ValidateCapacityFactor(std::nan(""));
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("--moe_capacity_factor"), std::string::npos) << status;
  EXPECT_FALSE(ValidateCapacityFactor(INFINITY).ok());
}

TEST(AssignSlotsTest, FirstChoicesClaimSlotsBeforeSecondChoices) {
  Routing r = HandTopTwo();
  ASSERT_EQ(Longs(r.expert), (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1}));
  // C = 2, in list order per expert:
  //   e0: (t0, 1st) slot 0, (t3, 1st) slot 1, (t2, 2nd) dropped
  //   e1: (t1, 1st) slot 0, (t0, 2nd) slot 1, (t3, 2nd) dropped
  //   e2: (t2, 1st) slot 0, (t1, 2nd) slot 1
  SlotAssignment slots = AssignSlots(r, 3, 2);
  EXPECT_EQ(Longs(slots.slot), (std::vector<int64_t>{0, 0, 0, 1, 1, 1, -1, -1}));
  EXPECT_EQ(slots.capacity, 2);
  EXPECT_EQ(slots.dropped, 2);
  EXPECT_EQ(Longs(slots.dropped_per_expert), (std::vector<int64_t>{1, 1, 0}));
  // Every first choice (positions 0..3) kept.
  EXPECT_TRUE(slots.slot.narrow(0, 0, 4).ge(0).all().item<bool>());
}

TEST(AssignSlotsTest, ZeroAndAmpleCapacity) {
  Routing r = ListRouting({0, 1, 2, 3, 4}, {2, 0, 2, 2, 0});
  SlotAssignment none = AssignSlots(r, 3, 0);
  EXPECT_EQ(Longs(none.slot), std::vector<int64_t>(5, -1));
  EXPECT_EQ(Longs(none.dropped_per_expert), (std::vector<int64_t>{2, 0, 3}));
  SlotAssignment all = AssignSlots(r, 3, 3);
  EXPECT_EQ(Longs(all.slot), (std::vector<int64_t>{0, 0, 1, 2, 1}));
  EXPECT_EQ(all.dropped, 0);
  EXPECT_THROW(AssignSlots(ListRouting({0}, {3}), 3, 1), c10::Error);  // expert out of range
}

TEST(PrioritizeByConfidenceTest, ConfidentTokensClaimSlotsFirst) {
  Routing r = HandTopTwo();
  // Priorities max_e p_t = (.5, .6, .65, .7): within each choice round the order is
  // t3, t2, t1, t0.
  //   round 1: (t3, e0) (t2, e2) (t1, e1) (t0, e0)
  //   round 2: (t3, e1) (t2, e0) (t1, e2) (t0, e1)
  Routing prioritized = PrioritizeByConfidence(r);
  EXPECT_EQ(Longs(prioritized.token), (std::vector<int64_t>{3, 2, 1, 0, 3, 2, 1, 0}));
  EXPECT_EQ(Longs(prioritized.expert), (std::vector<int64_t>{0, 2, 1, 0, 1, 0, 2, 1}));
  ExpectNear(Doubles(prioritized.gate),
             {7.0 / 9, 13.0 / 18, 2.0 / 3, 5.0 / 8, 2.0 / 9, 5.0 / 18, 1.0 / 3, 3.0 / 8}, 1e-6);
  EXPECT_TRUE(prioritized.expert_load.equal(r.expert_load));
  // C = 1: e0 goes to t3 (not t0, which claims first in GShard order), e1 to t1, e2 to t2.
  SlotAssignment slots = AssignSlots(prioritized, 3, 1);
  EXPECT_EQ(Longs(slots.slot), (std::vector<int64_t>{0, 0, 0, -1, -1, -1, -1, -1}));
  SlotAssignment default_order = AssignSlots(r, 3, 1);
  EXPECT_EQ(Longs(default_order.slot), (std::vector<int64_t>{0, 0, 0, -1, -1, -1, -1, -1}));
  EXPECT_EQ(Longs(r.token.masked_select(default_order.slot.ge(0))),
            (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(Longs(prioritized.token.masked_select(slots.slot.ge(0))),
            (std::vector<int64_t>{3, 2, 1}));
}

TEST(PrioritizeByConfidenceTest, GateStaysDifferentiable) {
  auto router = MakeOrDie("topk", TinyOptions(3, 3, 2));
  Routing prioritized = PrioritizeByConfidence(router->Route(HandHidden(), 2, Eval()));
  ASSERT_TRUE(prioritized.gate.requires_grad());
  prioritized.gate[0].backward();
  EXPECT_TRUE(testing::Param(*router, "router.weight").grad().defined());
}

}  // namespace
}  // namespace fulcrum::moe
