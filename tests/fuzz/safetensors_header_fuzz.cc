// Fuzzes ParseSafetensorsHeader (core/checkpoint/safetensors_header.h) with whole files: an
// accepted header must describe tensors that tile the data buffer exactly, each of
// numel * itemsize bytes; a refused one must say why.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/checkpoint/safetensors_header.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  const auto header = fulcrum::ckpt::ParseSafetensorsHeader("fuzz.safetensors", file);
  if (!header.ok()) {
    FULCRUM_FUZZ_CHECK(!header.status().message().empty());
    return 0;
  }
  FULCRUM_FUZZ_CHECK(header->data_start >= 8 && header->data_start <= size);
  uint64_t covered = 0;
  for (const fulcrum::ckpt::SafetensorsHeaderEntry& entry : header->entries) {
    FULCRUM_FUZZ_CHECK(entry.begin == covered && entry.end >= entry.begin);
    unsigned __int128 bytes = fulcrum::ckpt::SafetensorsDtypeSize(entry.dtype);
    FULCRUM_FUZZ_CHECK(bytes > 0);
    for (const int64_t extent : entry.shape) {
      FULCRUM_FUZZ_CHECK(extent >= 0);
      bytes *= static_cast<uint64_t>(extent);
      if (bytes > size) bytes = size + 1;  // Only compared with a range inside the file.
    }
    FULCRUM_FUZZ_CHECK(bytes == entry.end - entry.begin);
    covered = entry.end;
  }
  FULCRUM_FUZZ_CHECK(covered == size - header->data_start);
  return 0;
}
