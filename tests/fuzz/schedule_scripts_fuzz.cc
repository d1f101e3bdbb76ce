// Fuzzes the script-valued flags of fulcrum_train's pipeline: --rebalance_script
// (pipeline::ScriptedRebalancer::Parse, then Placements, which plays it through as
// fulcrum_train does before any work) and --repack_script (dynamic::ParseRepackScript).
// Input: a byte choosing the flag, a byte for the layer count, one for the stage count,
// then the flag's value. An accepted script must lead only to valid placements, and a
// repack script only to decreasing stage counts after increasing iterations.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dynamic/repack_trigger.h"
#include "pipeline/rebalancer.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const int64_t layers = 1 + data[1] % 64;
  const int stages = 1 + static_cast<int>(data[2] % std::min<int64_t>(layers, 16));
  const std::string script(reinterpret_cast<const char*>(data + 3), size - 3);
  if (data[0] % 2 == 0) {
    const auto rebalancer = fulcrum::pipeline::ScriptedRebalancer::Parse(script);
    if (!rebalancer.ok()) {
      FULCRUM_FUZZ_CHECK(!rebalancer.status().message().empty());
      return 0;
    }
    // The even split fulcrum_train starts from.
    fulcrum::pipeline::LayerRanges initial;
    for (int s = 0; s < stages; ++s) {
      initial.emplace_back(layers * s / stages, layers * (s + 1) / stages);
    }
    const auto placements = (*rebalancer)->Placements(initial);
    if (!placements.ok()) return 0;
    for (const auto& [iteration, ranges] : *placements) {
      FULCRUM_FUZZ_CHECK(iteration >= 1);
      FULCRUM_FUZZ_CHECK(fulcrum::pipeline::ValidateRanges(ranges, layers, stages).ok());
    }
  } else {
    const auto steps = fulcrum::dynamic::ParseRepackScript(script);
    if (!steps.ok()) {
      FULCRUM_FUZZ_CHECK(!steps.status().message().empty());
      return 0;
    }
    FULCRUM_FUZZ_CHECK(!steps->empty());
    int last_stages = 0;
    for (const auto& [iteration, to_stages] : *steps) {
      FULCRUM_FUZZ_CHECK(iteration >= 1 && to_stages >= 1);
      FULCRUM_FUZZ_CHECK(last_stages == 0 || to_stages < last_stages);
      last_stages = to_stages;
    }
  }
  return 0;
}
