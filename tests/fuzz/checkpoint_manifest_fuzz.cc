// Fuzzes ParseManifestJson (core/checkpoint/manifest_json.h) with manifest.json texts: an
// accepted manifest must be an object with a checksum that matches (format 2) and a tensor
// table of well-formed rows; a refused one must say why.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/checkpoint/checksum.h"
#include "core/checkpoint/manifest_json.h"
#include "core/checkpoint/safetensors_header.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum::ckpt;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto manifest = ParseManifestJson(text, "manifest.json");
  if (!manifest.ok()) {
    FULCRUM_FUZZ_CHECK(!manifest.status().message().empty());
    return 0;
  }
  FULCRUM_FUZZ_CHECK(manifest->json.is_object());
  FULCRUM_FUZZ_CHECK(manifest->format_version >= 1 &&
                     manifest->format_version <= kManifestFormatVersion);
  FULCRUM_FUZZ_CHECK(manifest->verified == (manifest->format_version >= 2));
  if (manifest->verified) {
    FULCRUM_FUZZ_CHECK(manifest->json[kManifestChecksumKey] == ManifestChecksum(manifest->json));
  }
  FULCRUM_FUZZ_CHECK(manifest->json["tensors"].size() == manifest->tensors.size());
  for (const auto& [name, row] : manifest->tensors) {
    FULCRUM_FUZZ_CHECK(SafetensorsDtypeSize(row.dtype) > 0);
    FULCRUM_FUZZ_CHECK(row.file.find('/') == std::string::npos && row.file[0] != '.');
    for (const int64_t extent : row.shape) FULCRUM_FUZZ_CHECK(extent >= 0);
    FULCRUM_FUZZ_CHECK(ChecksumFromHex(ChecksumToHex(row.xxh3)) == row.xxh3);
  }
  return 0;
}
