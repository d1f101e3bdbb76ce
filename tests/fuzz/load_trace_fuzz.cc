// Fuzzes ParseLoadTrace (dynamic/trace_replay.h) with --load_trace files as fulcrum_sim
// --trace reads them: an accepted trace must be something the simulator can replay (every
// line places the same layers over the same stages, one time per layer, times finite and
// non-negative); a refused one must say why.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

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
    int64_t next = 0;
    for (const auto& load : line.loads) {
      FULCRUM_FUZZ_CHECK(load.layer_begin == next && load.layer_end > load.layer_begin);
      const size_t n = static_cast<size_t>(load.layer_end - load.layer_begin);
      FULCRUM_FUZZ_CHECK(load.layer_forward_ms.size() == n && load.layer_backward_ms.size() == n);
      for (const double ms : load.layer_forward_ms) FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
      for (const double ms : load.layer_backward_ms) FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
      next = load.layer_end;
    }
    FULCRUM_FUZZ_CHECK(next == layers);
    FULCRUM_FUZZ_CHECK(line.microbatches >= 1);
    FULCRUM_FUZZ_CHECK(line.bubble_ratio >= 0 && line.bubble_ratio <= 1);
    for (const double ms : {line.pipeline_ms, line.iteration_ms}) {
      FULCRUM_FUZZ_CHECK(std::isfinite(ms) && ms >= 0);
    }
  }
  return 0;
}
