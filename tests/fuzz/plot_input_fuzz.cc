// Fuzzes ParsePlotInput (tools/internal/plot_input.h) with the files fulcrum_plot draws
// (metrics files, load traces, simulator output): an accepted file must give series with
// something to draw, every number finite; a refused one must say why, naming the file.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_check.h"
#include "tools/internal/plot_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto series = fulcrum::plot::ParsePlotInput(text, "m.jsonl");
  if (!series.ok()) {
    FULCRUM_FUZZ_CHECK(std::string(series.status().message()).rfind("m.jsonl", 0) == 0);
    return 0;
  }
  FULCRUM_FUZZ_CHECK(!series->empty());
  for (const auto& s : *series) {
    FULCRUM_FUZZ_CHECK(!s.stages.empty() || !s.training.empty());
  }
  return 0;
}
