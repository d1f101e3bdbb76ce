// Seeded random inputs of the kernel tests: a fresh CPU generator per call, so a test's
// tensors do not depend on which tests ran before it in the process.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>

namespace fulcrum::testing {

/// Standard normal values of `shape` drawn in fp32 from `seed`, then cast to `type`
/// (so a bf16 input is the rounding of the fp32 one of the same seed).
inline at::Tensor Random(at::IntArrayRef shape, uint64_t seed, at::ScalarType type = at::kFloat) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat)).to(type);
}

}  // namespace fulcrum::testing
