#include "core/data/megatron_index.h"

#include <cstring>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/data/internal/unaligned.h"
#include "core/status.h"

// The format is little-endian and we read it with plain loads.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "megatron_index.cc assumes a little-endian host (the .idx format is LE)");

namespace fulcrum::data {
namespace {

constexpr char kMagic[] = "MMIDIDX\x00\x00";  // 9 bytes; the literal adds a 10th NUL.
constexpr int64_t kMagicSize = 9;
constexpr uint64_t kVersion = 1;
// magic + u64 version + u8 dtype + u64 sequence_count + u64 document_count.
constexpr int64_t kHeaderSize = kMagicSize + 8 + 1 + 8 + 8;
static_assert(kHeaderSize == 34, "Megatron's _IndexReader documents a 34-byte header");

using internal::LoadUnaligned;

}  // namespace

bool IsDTypeCode(uint8_t code) { return code >= 1 && code <= 8; }

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kInt16:
    case DType::kUInt16: return 2;
    case DType::kInt32:
    case DType::kFloat32: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kUInt16: return "uint16";
  }
  return "unknown";
}

DType BestTokenDType(int64_t vocab_size) {
  return vocab_size < 65500 ? DType::kUInt16 : DType::kInt32;
}

absl::Status ValidateMegatronIndex(const std::string& where, DType dtype,
                                   const std::vector<int32_t>& lengths,
                                   const std::vector<int64_t>& pointers,
                                   const std::vector<int64_t>& document_indices) {
  const int64_t itemsize = DTypeSize(dtype);
  const int64_t num_sequences = static_cast<int64_t>(lengths.size());
  int64_t expected_pointer = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    if (lengths[i] < 0) {
      return absl::DataLossError(absl::StrCat(where, ": sequence_lengths[", i, "] is ", lengths[i],
                                              ", expected a length >= 0"));
    }
    if (!pointers.empty() && pointers[i] != expected_pointer) {
      return absl::DataLossError(absl::StrCat(
          where, ": sequence_pointers[", i, "] is ", pointers[i], ", expected ", expected_pointer,
          i == 0 ? " (the first sequence starts at byte 0)"
                 : absl::StrCat(" (= sequence_pointers[", i - 1, "] + sequence_lengths[", i - 1,
                                "] * ", itemsize, " bytes per ", DTypeName(dtype), ")")));
    }
    expected_pointer += int64_t{lengths[i]} * itemsize;
  }
  if (document_indices.empty()) {
    return absl::DataLossError(
        absl::StrCat(where, ": document_indices is empty, expected at least the leading 0"));
  }
  if (document_indices.front() != 0) {
    return absl::DataLossError(
        absl::StrCat(where, ": document_indices[0] is ", document_indices.front(), ", expected 0"));
  }
  for (size_t d = 1; d < document_indices.size(); ++d) {
    if (document_indices[d] < document_indices[d - 1] || document_indices[d] > num_sequences) {
      return absl::DataLossError(
          absl::StrCat(where, ": document_indices[", d, "] is ", document_indices[d],
                       ", expected a value in [", document_indices[d - 1], ", ", num_sequences,
                       "] (document indices are non-decreasing sequence counts)"));
    }
  }
  if (document_indices.back() != num_sequences) {
    return absl::DataLossError(absl::StrCat(
        where, ": the last document index is ", document_indices.back(), ", expected ",
        num_sequences, " (the sequence count), so every sequence belongs to a document"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MegatronIndex> ParseMegatronIndex(const std::string& path, std::string_view bytes) {
  // Header.
  const uint8_t* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const int64_t idx_size = static_cast<int64_t>(bytes.size());
  if (idx_size < kHeaderSize) {
    return absl::DataLossError(absl::StrCat(path, ": truncated: ", idx_size,
                                            " bytes, shorter than the ", kHeaderSize,
                                            "-byte header of a Megatron indexed dataset"));
  }
  if (std::memcmp(p, kMagic, kMagicSize) != 0) {
    return absl::DataLossError(absl::StrCat(
        path, ": bad magic: expected \"", absl::CHexEscape(std::string(kMagic, kMagicSize)),
        "\" (Megatron MMIDIDX index), found \"",
        absl::CHexEscape(std::string(reinterpret_cast<const char*>(p), kMagicSize)), "\""));
  }
  const uint64_t version = LoadUnaligned<uint64_t>(p + 9);
  if (version != kVersion) {
    return absl::DataLossError(
        absl::StrCat(path, ": unsupported version ", version, ", expected ", kVersion));
  }
  const uint8_t dtype_code = p[17];
  if (!IsDTypeCode(dtype_code)) {
    return absl::DataLossError(absl::StrCat(path, ": unknown dtype code ", dtype_code,
                                            ", expected 1..8 (Megatron's DType enum)"));
  }
  const uint64_t sequence_count = LoadUnaligned<uint64_t>(p + 18);
  const uint64_t document_count = LoadUnaligned<uint64_t>(p + 26);

  // Array sizes. Bound the counts first so the byte arithmetic cannot overflow.
  const uint64_t room = static_cast<uint64_t>(idx_size - kHeaderSize);
  const uint64_t expected_bytes = sequence_count <= room / 12 && document_count <= room / 8
                                      ? sequence_count * 12 + document_count * 8
                                      : std::numeric_limits<uint64_t>::max();
  if (expected_bytes > room) {
    return absl::DataLossError(absl::StrCat(
        path, ": truncated: header says ", sequence_count, " sequences and ", document_count,
        " document indices, which need ", kHeaderSize, " + 12 * ", sequence_count, " + 8 * ",
        document_count, " bytes; file has ", idx_size, " bytes (room for ",
        document_count <= room / 8 ? (room - document_count * 8) / 12 : 0, " sequences)"));
  }
  if (expected_bytes < room) {
    const uint64_t extra = room - expected_bytes;
    return absl::DataLossError(absl::StrCat(
        path, ": ", extra, " unexpected bytes after the document indices (header says ",
        sequence_count, " sequences and ", document_count, " document indices)",
        extra == sequence_count ? "; this looks like a multimodal dataset (per-sequence modes), "
                                  "which is not supported"
                                : ""));
  }

  MegatronIndex index;
  index.dtype = static_cast<DType>(dtype_code);
  const uint8_t* arrays = p + kHeaderSize;
  index.sequence_lengths.resize(sequence_count);
  index.sequence_pointers.resize(sequence_count);
  index.document_indices.resize(document_count);
  // memcpy's pointers must not be null even for zero bytes, and an empty vector's may be.
  if (sequence_count > 0) {
    std::memcpy(index.sequence_lengths.data(), arrays, sequence_count * 4);
    std::memcpy(index.sequence_pointers.data(), arrays + sequence_count * 4, sequence_count * 8);
  }
  if (document_count > 0) {
    std::memcpy(index.document_indices.data(), arrays + sequence_count * 12, document_count * 8);
  }
  FULCRUM_RETURN_IF_ERROR(ValidateMegatronIndex(path, index.dtype, index.sequence_lengths,
                                                index.sequence_pointers, index.document_indices));
  for (int32_t length : index.sequence_lengths) index.num_tokens += length;
  return index;
}

std::string EncodeMegatronIndex(const MegatronIndex& index) {
  const uint64_t sequence_count = index.sequence_lengths.size();
  const uint64_t document_count = index.document_indices.size();
  std::string idx;
  idx.reserve(kHeaderSize + sequence_count * 12 + document_count * 8);
  auto append = [&idx](const void* data, size_t size) {
    idx.append(static_cast<const char*>(data), size);
  };
  append(kMagic, kMagicSize);
  append(&kVersion, 8);
  const uint8_t code = static_cast<uint8_t>(index.dtype);
  append(&code, 1);
  append(&sequence_count, 8);
  append(&document_count, 8);
  append(index.sequence_lengths.data(), sequence_count * 4);
  const int64_t itemsize = DTypeSize(index.dtype);
  int64_t pointer = 0;
  for (int32_t length : index.sequence_lengths) {
    append(&pointer, 8);
    pointer += int64_t{length} * itemsize;
  }
  append(index.document_indices.data(), document_count * 8);
  return idx;
}

}  // namespace fulcrum::data
