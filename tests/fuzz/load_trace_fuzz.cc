// Fuzzes ParseLoadTrace (dynamic/trace_replay.h) with --load_trace files as fulcrum_sim
// --trace reads them: an accepted trace must be something the simulator can replay (every
// line places the same layers over the same (virtual) stages, one time per layer, times
// finite and non-negative, and CostsFromTraceLine reads it in bounds); a refused one must
// say why.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "dynamic/trace_replay.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto trace = fulcrum::dynamic::ParseLoadTrace(text, "t.jsonl");
  if (!trace.ok()) {
    FULCRUM_FUZZ_CHECK(!trace.status().message().empty());
    return 0;
  }
  FULCRUM_FUZZ_CHECK(!trace->lines.empty());
  const int stages = trace->num_stages();
  const int64_t layers = trace->num_layers();
  FULCRUM_FUZZ_CHECK(stages >= 1 && layers >= stages);
  for (const auto& line : trace->lines) {
    FULCRUM_FUZZ_CHECK(static_cast<int>(line.loads.size()) == stages);
    FULCRUM_FUZZ_CHECK(line.num_chunks == trace->num_chunks() && line.num_chunks >= 1);
    FULCRUM_FUZZ_CHECK(static_cast<int64_t>(line.ran_on.size()) ==
                       static_cast<int64_t>(stages) * line.num_chunks);
    // The loads' ranges (a range per stage, or each rank's chunks) tile the layers.
    std::vector<std::pair<int64_t, int64_t>> held;
    for (const auto& load : line.loads) {
      const auto ranges = load.chunk_ranges.empty()
                              ? std::vector<std::pair<int64_t, int64_t>>{{load.layer_begin, load.layer_end}}
                              : load.chunk_ranges;
      FULCRUM_FUZZ_CHECK(static_cast<int>(ranges.size()) == line.num_chunks);
      size_t n = 0;
      for (const auto& [begin, end] : ranges) {
        FULCRUM_FUZZ_CHECK(end > begin);
        n += static_cast<size_t>(end - begin);
        held.emplace_back(begin, end);
      }
      FULCRUM_FUZZ_CHECK(load.layer_forward_ms.size() == n && load.layer_backward_ms.size() == n);
      for (const double ms : load.layer_forward_ms) FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
      for (const double ms : load.layer_backward_ms) FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
    }
    std::sort(held.begin(), held.end());
    int64_t next = 0;
    for (const auto& [begin, end] : held) {
      FULCRUM_FUZZ_CHECK(begin == next);
      next = end;
    }
    FULCRUM_FUZZ_CHECK(next == layers);
    FULCRUM_FUZZ_CHECK(line.microbatches >= 1);
    FULCRUM_FUZZ_CHECK(line.bubble_ratio >= 0 && line.bubble_ratio <= 1);
    for (const double ms : {line.pipeline_ms, line.iteration_ms}) {
      FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
    }
    // What the replay makes of it (indexes the per-layer and per-chunk vectors).
    const fulcrum::dynamic::IterationCosts costs = fulcrum::dynamic::CostsFromTraceLine(line);
    FULCRUM_FUZZ_CHECK(costs.num_layers() == layers);
    for (const double ms : {costs.first_forward, costs.first_backward, costs.first_weight,
                            costs.last_forward, costs.last_backward, costs.last_weight}) {
      FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
    }
  }
  return 0;
}
