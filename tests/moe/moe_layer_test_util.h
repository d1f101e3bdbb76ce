// Helpers shared by the tests of the MoE layer (moe_layer_test.cc, mixtral_test.cc): a
// block built by the layer's factory in its own unit, that unit's parameters by local name,
// and its gradients.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/config.h"
#include "core/unit.h"
#include "moe/moe_layer.h"

namespace fulcrum::moe::testing {

/// A unit whose parameters are `dtype` (as TransformerLayer sets from the master dtype of ModelOptions::device_spec).
class TypedUnit : public Unit {
 public:
  TypedUnit(const std::string& name, at::ScalarType dtype) : Unit(name) { set_params_dtype(dtype); }
};

/// An MoE block and the unit that owns its parameters.
struct BuiltMoe {
  std::unique_ptr<Unit> unit;
  std::unique_ptr<FeedForward> block;
};

/// The block MakeMoeFactory(options, model) makes for layer `layer`, initialised, in a unit
/// "layers.<layer>" whose parameters are `dtype`.
inline BuiltMoe BuildMoe(const MoeOptions& options, const ModelOptions& model, int64_t layer = 0,
                         at::ScalarType dtype = at::kFloat) {
  auto factory = MakeMoeFactory(options, model, MoeGroups());
  EXPECT_TRUE(factory.ok()) << factory.status();
  BuiltMoe b;
  b.unit = std::make_unique<TypedUnit>(absl::StrCat("layers.", layer), dtype);
  b.block = (*factory)(layer, *b.unit, /*initialize=*/true);
  return b;
}

/// The unit's parameter `local` (fails the test when absent).
inline at::Tensor& ParamOf(Unit& unit, const std::string& local) {
  Parameter* p = unit.FindParameter(local);
  EXPECT_NE(p, nullptr) << local;
  static at::Tensor none;
  return p ? p->value : none;
}

/// The unit's gradients by parameter name (those that have one); zeroes them.
inline std::map<std::string, at::Tensor> TakeGrads(Unit& unit) {
  std::map<std::string, at::Tensor> grads;
  for (Parameter& p : unit.parameters()) {
    if (p.value.grad().defined()) grads[p.name] = p.value.grad().clone();
  }
  unit.ZeroGrad();
  return grads;
}

}  // namespace fulcrum::moe::testing
