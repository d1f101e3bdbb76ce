// The `.idx` half of Megatron-LM's indexed dataset (NOTE [Megatron .idx layout] in
// core/data/indexed_dataset.h): its dtype codes, and the index file's bytes parsed into
// arrays and validated, or encoded from them. No file I/O and no LibTorch, so the fuzz
// target (tests/fuzz) can call the parser on its own.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum::data {

/// Element type of the tokens in a `.bin` file. The values are Megatron's dtype codes, the
/// byte stored at offset 17 of the `.idx` file.
enum class DType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

/// Whether `code` is one of DType's values (a dtype code Megatron writes).
bool IsDTypeCode(uint8_t code);

/// Size of one element in bytes.
int64_t DTypeSize(DType dtype);

/// NumPy's name for the type ("uint16", "int32", ...), as Megatron names it.
const char* DTypeName(DType dtype);

/// The token dtype Megatron's preprocessor picks for a vocabulary: uint16 when
/// `vocab_size < 65500`, else int32 (DType.optimal_dtype in indexed_dataset.py).
DType BestTokenDType(int64_t vocab_size);

/// The contents of a `.idx` file.
struct MegatronIndex {
  DType dtype = DType::kInt64;
  std::vector<int32_t> sequence_lengths;
  std::vector<int64_t> sequence_pointers;  // Bytes into .bin; derived from the lengths.
  std::vector<int64_t> document_indices;
  int64_t num_tokens = 0;  // Sum of sequence_lengths: the .bin holds num_tokens * itemsize bytes.
};

/// Parses and validates the bytes of a `.idx` file (magic, version, dtype, array sizes
/// against the file size, then ValidateMegatronIndex). `path` names the file in errors,
/// which are DataLoss naming the field, with what was expected and what was found.
absl::StatusOr<MegatronIndex> ParseMegatronIndex(const std::string& path, std::string_view bytes);

/// The `.idx` bytes of `index` (its sequence_pointers are recomputed from the lengths).
std::string EncodeMegatronIndex(const MegatronIndex& index);

/// Checks the index arrays against each other: lengths non-negative, pointers (when not
/// empty) consecutive in `dtype`'s item size, document indices starting at 0,
/// non-decreasing and ending at the sequence count. `where` names the file in messages.
absl::Status ValidateMegatronIndex(const std::string& where, DType dtype,
                                   const std::vector<int32_t>& lengths,
                                   const std::vector<int64_t>& pointers,
                                   const std::vector<int64_t>& document_indices);

}  // namespace fulcrum::data
