// Index dispatch and combine (moe/dispatch.h): a hand example of the plan and the buffer,
// the identity-expert closed form, gradients against GShard's dense one-hot einsums and
// against finite differences, edge cases and caller errors.
#include "moe/dispatch.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <string>
#include <vector>

#include "core/random.h"
#include "moe/capacity.h"
#include "tests/moe/moe_test_util.h"

namespace fulcrum::moe {
namespace {

using testing::Doubles;
using testing::ExpectNear;
using testing::Longs;

Routing ListedRouting(std::vector<int64_t> tokens, std::vector<int64_t> experts,
                    std::vector<double> gates, int64_t num_experts) {
  Routing r;
  r.token = at::tensor(tokens);
  r.expert = at::tensor(experts);
  r.gate = at::tensor(gates, at::kDouble).set_requires_grad(true);
  r.expert_load = at::bincount(r.expert, /*weights=*/{}, num_experts);
  return r;
}

// The hand example: T = 5 tokens, E = 3 experts, k = 2, capacity 2, in choice-major order.
//   list a:   0    1    2    3    4  |  5    6    7    8    9
//   token:    0    1    2    3    4  |  0    1    2    3    4
//   expert:   0    0    0    1    2  |  1    2    1    0    1
//   gate:    .6   .7   .5   .8   .9  | .25   .3   .5   .2   .1
//   slot:     0    1   -1    0    0  |  1    1   -1   -1   -1
// Expert 0 fills with tokens 0 and 1, expert 1 with tokens 3 and 0, expert 2 with 4 and 1;
// token 2 loses both choices.
Routing HandRouting() {
  return ListedRouting({0, 1, 2, 3, 4, 0, 1, 2, 3, 4}, {0, 0, 0, 1, 2, 1, 2, 1, 0, 1},
                     {.6, .7, .5, .8, .9, .25, .3, .5, .2, .1}, 3);
}

// Row t of x is (t+1)·(1, 10, 100): every row and column tells where it came from.
at::Tensor RowValuedX(int64_t tokens) {
  return (at::arange(1, tokens + 1, at::kDouble).unsqueeze(1) *
          at::tensor({1.0, 10.0, 100.0}, at::kDouble).unsqueeze(0));
}

TEST(DispatchTest, HandExamplePlanAndBuffer) {
  Routing r = HandRouting();
  SlotAssignment slots = AssignSlots(r, 3, 2);
  DispatchPlan plan = MakeDispatchPlan(r, slots, 5);
  EXPECT_EQ(plan.num_tokens, 5);
  EXPECT_EQ(plan.num_experts, 3);
  EXPECT_EQ(plan.capacity, 2);
  ASSERT_EQ(plan.size(), 6);
  EXPECT_EQ(Longs(plan.token), (std::vector<int64_t>{0, 1, 3, 4, 0, 1}));
  EXPECT_EQ(Longs(plan.position), (std::vector<int64_t>{0, 1, 2, 4, 3, 5}));
  ExpectNear(Doubles(plan.gate), {.6, .7, .8, .9, .25, .3}, 0.0);

  at::Tensor buffer = Dispatch(RowValuedX(5), plan);
  ASSERT_EQ(buffer.sizes(), (at::IntArrayRef{3, 2, 3}));
  // Buffer rows by expert and slot: e0 = [x0, x1], e1 = [x3, x0], e2 = [x4, x1].
  const std::vector<double> row_token = Doubles(buffer.select(2, 0));
  ExpectNear(row_token, {1, 2, 4, 1, 5, 2}, 0.0);
  ExpectNear(Doubles(buffer),
             Doubles(RowValuedX(5).index_select(0, at::tensor({0, 1, 3, 0, 4, 1}))), 0.0);
}

TEST(DispatchTest, IdentityExpertGivesGateWeightedSum) {
  Routing r = HandRouting();
  DispatchPlan plan = MakeDispatchPlan(r, AssignSlots(r, 3, 2), 5);
  at::Tensor x = RowValuedX(5);
  at::Tensor out = Combine(Dispatch(x, plan), plan);
  // Kept gates per token: .6+.25, .7+.3, none (both dropped), .8, .9.
  const at::Tensor kept_gate = at::tensor({.85, 1.0, 0.0, .8, .9}, at::kDouble).unsqueeze(1);
  ExpectNear(Doubles(out), Doubles(kept_gate * x), 1e-12);
  EXPECT_EQ(out.scalar_type(), at::kDouble);
}

// ---- The dense reference: GShard's one-hot [T, E, C] tensors and einsums. ----------------

struct Dense {
  at::Tensor mask;     // [T, E, C], 1 where a kept assignment sits
  at::Tensor combine;  // [T, E, C], its gate there (differentiable w.r.t. routing.gate)
};

Dense DenseReference(const Routing& r, const SlotAssignment& slots, int64_t tokens,
                     int64_t experts) {
  const at::Tensor kept = at::nonzero(slots.slot >= 0).view({-1});
  const c10::List<std::optional<at::Tensor>> where({r.token.index_select(0, kept),
                                                    r.expert.index_select(0, kept),
                                                    slots.slot.index_select(0, kept)});
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const std::vector<int64_t> shape = {tokens, experts, slots.capacity};
  Dense dense;
  dense.mask = at::zeros(shape, options).index_put_(where, at::ones({}, options));
  dense.combine = at::zeros(shape, options).index_put(where, r.gate.index_select(0, kept));
  return dense;
}

// Top-k routing of `tokens` tokens over `experts` experts, k distinct experts per token,
// choice-major as the routers emit it; gates are leaves in (0, 1).
Routing RandomRouting(int64_t tokens, int64_t experts, int64_t k, uint64_t seed) {
  at::Generator gen = MakeGenerator(seed, "dispatch_test");
  std::vector<at::Tensor> choices;
  for (int64_t t = 0; t < tokens; ++t) {
    choices.push_back(at::randperm(experts, gen, at::kLong).narrow(0, 0, k));
  }
  at::Tensor expert = at::stack(choices, 1).reshape({-1});  // [k, T] → choice-major
  Routing r;
  r.token = at::arange(tokens, at::kLong).repeat({k});
  r.expert = expert;
  r.gate = at::empty({tokens * k}, at::kDouble).uniform_(0.05, 1.0, gen).set_requires_grad(true);
  r.expert_load = at::bincount(expert, /*weights=*/{}, experts);
  return r;
}

// What the experts do in the gradient tests: a nonlinear, expert-dependent map.
at::Tensor Expert(const at::Tensor& buffer, const at::Tensor& scale) {
  return buffer.tanh() * scale;  // scale [E, 1, D]
}

TEST(DispatchTest, GradientsMatchDenseOneHotEinsums) {
  const int64_t tokens = 9, experts = 4, k = 2, hidden = 5;
  Routing r = RandomRouting(tokens, experts, k, 7);
  SlotAssignment slots = AssignSlots(r, experts, /*capacity=*/4);
  ASSERT_GT(slots.dropped, 0);  // 18 assignments, 16 slots
  DispatchPlan plan = MakeDispatchPlan(r, slots, tokens);
  Dense dense = DenseReference(r, slots, tokens, experts);

  at::Generator gen = MakeGenerator(8, "dispatch_test");
  at::Tensor x =
      at::empty({tokens, hidden}, at::kDouble).normal_(0, 1, gen).set_requires_grad(true);
  at::Tensor scale = at::empty({experts, 1, hidden}, at::kDouble).normal_(0, 1, gen);
  at::Tensor upstream = at::empty({tokens, hidden}, at::kDouble).normal_(0, 1, gen);

  // The buffer, then the whole layer x → experts → combine.
  at::Tensor ours_buffer = Dispatch(x, plan);
  at::Tensor dense_buffer = at::einsum("tec,td->ecd", {dense.mask, x});
  ExpectNear(Doubles(ours_buffer), Doubles(dense_buffer), 1e-14);
  at::Tensor ours_out = Combine(Expert(ours_buffer, scale), plan);
  at::Tensor dense_out = at::einsum("tec,ecd->td", {dense.combine, Expert(dense_buffer, scale)});
  ExpectNear(Doubles(ours_out), Doubles(dense_out), 1e-13);

  // plan.gate and dense.combine are shared by two graphs each: keep them for the second.
  auto grads = [&](const at::Tensor& out) {
    return torch::autograd::grad({(out * upstream).sum()}, {x, r.gate}, /*grad_outputs=*/{},
                                 /*retain_graph=*/true);
  };
  const auto ours = grads(ours_out);
  const auto theirs = grads(dense_out);
  ExpectNear(Doubles(ours[0]), Doubles(theirs[0]), 1e-13);  // x
  ExpectNear(Doubles(ours[1]), Doubles(theirs[1]), 1e-13);  // gate
  // Dropped assignments get no gradient.
  const at::Tensor dropped = at::nonzero(slots.slot < 0).view({-1});
  ExpectNear(Doubles(ours[1].index_select(0, dropped)), std::vector<double>(dropped.size(0), 0.0),
             0.0);

  // Combine alone, w.r.t. the expert output y as a leaf.
  at::Tensor y =
      at::empty({experts, 4, hidden}, at::kDouble).normal_(0, 1, gen).set_requires_grad(true);
  const auto ours_y = torch::autograd::grad({(Combine(y, plan) * upstream).sum()}, {y, r.gate});
  const auto dense_y = torch::autograd::grad(
      {(at::einsum("tec,ecd->td", {dense.combine, y}) * upstream).sum()}, {y, r.gate});
  ExpectNear(Doubles(ours_y[0]), Doubles(dense_y[0]), 1e-13);
  ExpectNear(Doubles(ours_y[1]), Doubles(dense_y[1]), 1e-13);
}

// Central differences of a scalar function of the leaves against autograd, element by
// element (torch.autograd.gradcheck in the small).
void ExpectFiniteDifferences(const std::function<at::Tensor()>& loss,
                             const std::vector<at::Tensor>& leaves, const char* what) {
  const auto analytic = torch::autograd::grad({loss()}, leaves);
  constexpr double kEps = 1e-6;
  for (size_t i = 0; i < leaves.size(); ++i) {
    at::Tensor flat = leaves[i].detach().view({-1});  // shares storage with the leaf
    const std::vector<double> grad = Doubles(analytic[i].reshape({-1}));
    for (int64_t j = 0; j < flat.numel(); ++j) {
      const double saved = flat[j].item<double>();
      flat[j].fill_(saved + kEps);
      const double plus = loss().item<double>();
      flat[j].fill_(saved - kEps);
      const double minus = loss().item<double>();
      flat[j].fill_(saved);
      EXPECT_NEAR(grad[j], (plus - minus) / (2 * kEps), 1e-7)
          << what << " leaf " << i << " [" << j << "]";
    }
  }
}

TEST(DispatchTest, GradientsMatchFiniteDifferences) {
  const int64_t tokens = 6, experts = 3, k = 2, hidden = 3;
  Routing r = RandomRouting(tokens, experts, k, 11);
  DispatchPlan plan = MakeDispatchPlan(r, AssignSlots(r, experts, 3), tokens);
  at::Generator gen = MakeGenerator(12, "dispatch_test");
  at::Tensor x =
      at::empty({tokens, hidden}, at::kDouble).normal_(0, 1, gen).set_requires_grad(true);
  at::Tensor scale = at::empty({experts, 1, hidden}, at::kDouble).normal_(0, 1, gen);
  at::Tensor upstream = at::empty({tokens, hidden}, at::kDouble).normal_(0, 1, gen);
  // The plan's gate is a function of the routing's leaf; rebuild it in every evaluation.
  ExpectFiniteDifferences(
      [&] {
        DispatchPlan p = MakeDispatchPlan(r, AssignSlots(r, experts, 3), tokens);
        return (Combine(Expert(Dispatch(x, p), scale), p) * upstream).sum();
      },
      {x, r.gate}, "layer");
  at::Tensor y =
      at::empty({experts, 3, hidden}, at::kDouble).normal_(0, 1, gen).set_requires_grad(true);
  ExpectFiniteDifferences([&] { return (Combine(y, plan) * upstream).sum(); }, {y}, "combine");
}

// ---- Edge cases. ----------------------------------------------------------------------------

TEST(DispatchTest, NoDropsKeepsEveryAssignment) {
  Routing r = HandRouting();
  SlotAssignment slots = AssignSlots(r, 3, /*capacity=*/10);
  ASSERT_EQ(slots.dropped, 0);
  DispatchPlan plan = MakeDispatchPlan(r, slots, 5);
  EXPECT_EQ(plan.size(), r.size());
  at::Tensor x = RowValuedX(5);
  at::Tensor out = Combine(Dispatch(x, plan), plan);
  // Every gate counts: .6+.25, .7+.3, .5+.5, .8+.2, .9+.1.
  const at::Tensor gate_sum = at::tensor({.85, 1.0, 1.0, 1.0, 1.0}, at::kDouble).unsqueeze(1);
  ExpectNear(Doubles(out), Doubles(gate_sum * x), 1e-12);
}

TEST(DispatchTest, EmptyExpertHasZeroRowsAndNoGradient) {
  // Expert 2 of 3 receives nobody.
  Routing r = ListedRouting({0, 1, 2, 0}, {0, 1, 0, 1}, {.5, .6, .7, .8}, 3);
  DispatchPlan plan = MakeDispatchPlan(r, AssignSlots(r, 3, 2), 3);
  at::Tensor x = RowValuedX(3).set_requires_grad(true);
  at::Tensor buffer = Dispatch(x, plan);
  ExpectNear(Doubles(buffer.select(0, 2)), std::vector<double>(6, 0.0), 0.0);
  at::Tensor y = (buffer * 2.0).detach().set_requires_grad(true);
  at::Tensor out = Combine(y, plan);
  ExpectNear(
      Doubles(out),
      Doubles(at::tensor({2 * 1.3, 2 * .6, 2 * .7}, at::kDouble).unsqueeze(1) * RowValuedX(3)),
      1e-12);
  const auto grads = torch::autograd::grad({out.sum()}, {y});
  ExpectNear(Doubles(grads[0].select(0, 2)), std::vector<double>(6, 0.0), 0.0);
}

TEST(DispatchTest, AllDroppedGivesZerosAndZeroGradients) {
  Routing r = HandRouting();
  SlotAssignment slots = AssignSlots(r, 3, /*capacity=*/0);
  DispatchPlan plan = MakeDispatchPlan(r, slots, 5);
  EXPECT_EQ(plan.size(), 0);
  at::Tensor x = RowValuedX(5).set_requires_grad(true);
  at::Tensor buffer = Dispatch(x, plan);
  EXPECT_EQ(buffer.sizes(), (at::IntArrayRef{3, 0, 3}));
  at::Tensor out = Combine(buffer, plan);
  ExpectNear(Doubles(out), std::vector<double>(15, 0.0), 0.0);
  const auto grads = torch::autograd::grad({out.sum()}, {x, r.gate}, {}, {}, false,
                                           /*allow_unused=*/true);
  ExpectNear(Doubles(grads[0]), std::vector<double>(15, 0.0), 0.0);
  if (grads[1].defined()) ExpectNear(Doubles(grads[1]), std::vector<double>(10, 0.0), 0.0);
}

TEST(DispatchTest, FloatAndGateOfAnotherDtype) {
  // Routers keep fp32 gates; experts may run in another dtype. The sum takes y's dtype.
  Routing r = HandRouting();
  DispatchPlan plan = MakeDispatchPlan(r, AssignSlots(r, 3, 2), 5);
  at::Tensor x = RowValuedX(5).to(at::kFloat);
  at::Tensor out = Combine(Dispatch(x, plan), plan);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  const at::Tensor kept_gate = at::tensor({.85, 1.0, 0.0, .8, .9}, at::kDouble).unsqueeze(1);
  ExpectNear(Doubles(out), Doubles(kept_gate * RowValuedX(5)), 1e-4);
  const auto grads = torch::autograd::grad({out.sum()}, {r.gate});
  EXPECT_EQ(grads[0].scalar_type(), at::kDouble);
}

// ---- Caller errors. -------------------------------------------------------------------------

void ExpectErrorMentions(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning '" << text << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(DispatchTest, MismatchedShapesAreNamed) {
  Routing r = HandRouting();
  DispatchPlan plan = MakeDispatchPlan(r, AssignSlots(r, 3, 2), 5);
  ExpectErrorMentions([&] { Dispatch(RowValuedX(4), plan); }, "x must be [T, D] with T = 5");
  ExpectErrorMentions([&] { Dispatch(at::zeros({5}), plan); }, "x must be [T, D]");
  ExpectErrorMentions(
      [&] {
        Combine(at::zeros({3, 3, 4}), plan);
      },
      "y must be [E, C, D] with E = 3 and C = 2");
  ExpectErrorMentions([&] { Combine(at::zeros({6, 4}), plan); }, "y must be [E, C, D]");
  ExpectErrorMentions([&] { Dispatch(RowValuedX(5), DispatchPlan{}); }, "MakeDispatchPlan");
  ExpectErrorMentions([&] { MakeDispatchPlan(r, AssignSlots(r, 3, 2), 4); },
                      "routing.token out of [0, 4)");
  Routing short_gate = r;
  short_gate.gate = r.gate.narrow(0, 0, 9);
  ExpectErrorMentions([&] { MakeDispatchPlan(short_gate, AssignSlots(r, 3, 2), 5); },
                      "routing.gate must be [N] with N = 10");
  ExpectErrorMentions([&] { MakeDispatchPlan(r, AssignSlots(r, 4, 2), 5); },
                      "the routing has 3 experts but the slot assignment 4");
}

}  // namespace
}  // namespace fulcrum::moe
