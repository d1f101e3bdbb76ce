// Helpers shared by the MoE tests: tiny router options, parameter setters and the
// hand-computed 4-token, 3-expert example that several tests route.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "moe/router.h"

namespace fulcrum::moe::testing {

inline RouterOptions TinyOptions(int64_t num_experts, int64_t hidden_size, int64_t topk) {
  RouterOptions options;
  options.num_experts = num_experts;
  options.hidden_size = hidden_size;
  options.topk = topk;
  return options;
}

inline std::unique_ptr<Router> MakeOrDie(const std::string& name, const RouterOptions& options) {
  absl::StatusOr<std::unique_ptr<Router>> router = MakeRouter(name, options);
  EXPECT_TRUE(router.ok()) << router.status();
  return router.ok() ? std::move(router).value() : nullptr;
}

/// The router's parameter handle called `name` (fails the test when absent).
inline at::Tensor& Param(Router& router, const std::string& name) {
  for (RouterParameter& p : router.Parameters()) {
    if (p.name == name) return *p.value;
  }
  ADD_FAILURE() << router.name() << " has no parameter " << name;
  static at::Tensor none;
  return none;
}

/// Overwrites a parameter in place (it stays the same leaf).
inline void SetParam(Router& router, const std::string& name, const at::Tensor& value) {
  at::NoGradGuard no_grad;
  Param(router, name).copy_(value);
}

/// Rebinds every parameter to a double copy, for finite differences (NOTE [router
/// precision]: routers compute in their parameters' dtype).
inline void ToDouble(Router& router) {
  for (RouterParameter& p : router.Parameters()) {
    *p.value = p.value->detach().to(at::kDouble).clone().set_requires_grad(true);
  }
}

/// The value of aux loss `name`, or NaN (and a failure) when the routing has none.
inline double AuxLoss(const Routing& routing, const std::string& name) {
  for (const auto& [loss_name, value] : routing.aux_losses) {
    if (loss_name == name) return value.item<double>();
  }
  ADD_FAILURE() << "no aux loss " << name;
  return std::nan("");
}

inline bool HasAuxLoss(const Routing& routing, const std::string& name) {
  for (const auto& entry : routing.aux_losses) {
    if (entry.first == name) return true;
  }
  return false;
}

inline std::vector<int64_t> Longs(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

inline std::vector<double> Doubles(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

inline void ExpectNear(const std::vector<double>& actual, const std::vector<double>& expected,
                       double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "at index " << i;
  }
}

// The hand example: 4 tokens, 3 experts, hidden size 3, router weight = identity, so the
// logits are the hidden states. Token t's logits are log(p_t) + c_t with c = (1, 2, 0, -1):
// the softmax is exactly p_t, and logsumexp(logits_t) = log(Σp) + c_t = c_t.
//   p_0 = (0.5,  0.3, 0.2 )
//   p_1 = (0.1,  0.6, 0.3 )
//   p_2 = (0.25, 0.1, 0.65)
//   p_3 = (0.7,  0.2, 0.1 )
inline at::Tensor HandProbs() {
  return at::tensor({0.5, 0.3, 0.2, 0.1, 0.6, 0.3, 0.25, 0.1, 0.65, 0.7, 0.2, 0.1}, at::kDouble)
      .reshape({4, 3});
}
inline at::Tensor HandHidden() {
  at::Tensor shift = at::tensor({1.0, 2.0, 0.0, -1.0}, at::kDouble).unsqueeze(1);
  return (HandProbs().log() + shift).to(at::kFloat);
}

inline RouteContext Eval() {
  RouteContext ctx;
  ctx.training = false;
  return ctx;
}

inline RouteContext Training(int64_t iteration, int64_t first_sample = 0, int64_t layer = 0) {
  RouteContext ctx;
  ctx.training = true;
  ctx.iteration = iteration;
  ctx.first_sample = first_sample;
  ctx.layer = layer;
  return ctx;
}

}  // namespace fulcrum::moe::testing
