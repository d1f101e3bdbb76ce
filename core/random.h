// Counter-based randomness keyed by global identity.
//
// NOTE [layout-independent randomness]
// Every random draw in training is a pure function of (seed, a global name, counters):
// a parameter's initial value of (seed, its global name); a dropout mask of (seed,
// iteration, first sample of the micro-batch, layer, site). Nothing depends on which rank
// or stage computes it, or on how many draws happened before. So a layer initialises to the
// same values on any pipeline stage, a tensor-parallel shard is a slice of the same full
// tensor, a migrated layer draws the same masks, and resuming from a checkpoint needs no
// generator state to reproduce the run bit for bit.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace fulcrum {

/// SplitMix64 finaliser: a bijective 64-bit mix with good avalanche.
constexpr uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// FNV-1a of `text`, then mixed: stable across platforms and library versions.
uint64_t StableHash(std::string_view text);

/// Combines a seed with a name and integer counters into one 64-bit stream seed.
uint64_t StreamSeed(uint64_t seed, std::string_view name, std::initializer_list<int64_t> counters);

/// A fresh CPU generator seeded with StreamSeed(seed, name, counters).
at::Generator MakeGenerator(uint64_t seed, std::string_view name,
                            std::initializer_list<int64_t> counters = {});

/// An fp32 tensor of `shape` drawn from N(0, std²) with MakeGenerator(seed, name): every
/// parameter's initial value, keyed by its global name.
at::Tensor NormalInit(uint64_t seed, std::string_view name, at::IntArrayRef shape, double std);

}  // namespace fulcrum

// NOTE: ATen's CPU generator seeds its mt19937 with 32 bits of the stream seed, so two
// streams collide with probability ~2^-32 per pair: harmless for dropout masks, and for
// initialisation the handful of parameter names make a collision practically impossible.
