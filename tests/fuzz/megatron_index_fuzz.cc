// Fuzzes ParseMegatronIndex (core/data/megatron_index.h) with whole `.idx` files: an
// accepted index must be consistent (ValidateMegatronIndex) and encode back to the very
// bytes it was parsed from; a refused one must say why.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/data/megatron_index.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto index = fulcrum::data::ParseMegatronIndex("fuzz.idx", bytes);
  if (!index.ok()) {
    FULCRUM_FUZZ_CHECK(!index.status().message().empty());
    return 0;
  }
  FULCRUM_FUZZ_CHECK(fulcrum::data::ValidateMegatronIndex("fuzz.idx", index->dtype,
                                                         index->sequence_lengths,
                                                         index->sequence_pointers,
                                                         index->document_indices)
                         .ok());
  int64_t tokens = 0;
  for (const int32_t length : index->sequence_lengths) tokens += length;
  FULCRUM_FUZZ_CHECK(tokens == index->num_tokens);
  FULCRUM_FUZZ_CHECK(fulcrum::data::EncodeMegatronIndex(*index) == bytes);
  return 0;
}
