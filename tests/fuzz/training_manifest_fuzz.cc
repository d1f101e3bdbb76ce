// Fuzzes ParseTrainingManifest (core/training_manifest.h) with manifest.json texts, read as
// CheckpointReader reads them (nesting limit, then nlohmann_json without exceptions): an
// accepted manifest must survive TrainingManifestToJson and parse back to the same fields;
// a refused one must say why.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/training_manifest.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (!fulcrum::CheckJsonDepth(text, "manifest.json").ok()) return 0;
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return 0;
  const auto manifest = fulcrum::ParseTrainingManifest(json, "manifest.json");
  if (!manifest.ok()) {
    FULCRUM_FUZZ_CHECK(!manifest.status().message().empty());
    return 0;
  }
  // What a save writes, a load reads back. (A manifest without the data identity, from
  // before it was recorded, writes documents = 0, which only old manifests may lack.)
  if (manifest->data.documents == 0) return 0;
  const auto again =
      fulcrum::ParseTrainingManifest(fulcrum::TrainingManifestToJson(*manifest), "again.json");
  FULCRUM_FUZZ_CHECK(again.ok());
  FULCRUM_FUZZ_CHECK(again->iteration == manifest->iteration);
  FULCRUM_FUZZ_CHECK(again->consumed_samples == manifest->consumed_samples);
  FULCRUM_FUZZ_CHECK(again->lr == manifest->lr);
  FULCRUM_FUZZ_CHECK(again->data_seed == manifest->data_seed);
  FULCRUM_FUZZ_CHECK(again->split == manifest->split);
  FULCRUM_FUZZ_CHECK(again->data.path == manifest->data.path);
  FULCRUM_FUZZ_CHECK(again->data.documents == manifest->data.documents);
  FULCRUM_FUZZ_CHECK(again->data.tokens == manifest->data.tokens);
  FULCRUM_FUZZ_CHECK(again->config == manifest->config);
  FULCRUM_FUZZ_CHECK(again->layer_placement == manifest->layer_placement);
  return 0;
}
