#include "core/random.h"

#include <ATen/CPUGeneratorImpl.h>

namespace fulcrum {

uint64_t StableHash(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return Mix64(h);
}

uint64_t StreamSeed(uint64_t seed, std::string_view name,
                    std::initializer_list<int64_t> counters) {
  uint64_t s = Mix64(seed ^ StableHash(name));
  for (int64_t c : counters) s = Mix64(s ^ static_cast<uint64_t>(c));
  return s;
}

at::Generator MakeGenerator(uint64_t seed, std::string_view name,
                            std::initializer_list<int64_t> counters) {
  // The CPU generator is an mt19937 seeded with 64 bits; the stream seed is already mixed.
  return at::detail::createCPUGenerator(StreamSeed(seed, name, counters));
}

at::Tensor NormalInit(uint64_t seed, std::string_view name, at::IntArrayRef shape, double std) {
  at::Generator gen = MakeGenerator(seed, name);
  return at::empty(shape, at::kFloat).normal_(0.0, std, gen);
}

}  // namespace fulcrum
