// The torch-free half of the safetensors reader: the 8-byte length and the JSON header of
// a safetensors file (NOTE [safetensors layout] in core/checkpoint/safetensors.h), parsed
// into a tensor table and validated against the file's size. SafetensorsReader maps dtype
// names to LibTorch types on top of it; the fuzz target (tests/fuzz) calls it directly, so
// it must not pull in LibTorch.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fulcrum::ckpt {

/// Headers larger than this are rejected before being parsed (the reference
/// implementation's limit; real headers are at most a few MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

/// Bytes per element of the safetensors dtype `name` ("F32" → 4), or 0 for a name this
/// build does not read. Supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
size_t SafetensorsDtypeSize(std::string_view name);

/// One tensor's header entry, as written in the file.
struct SafetensorsHeaderEntry {
  std::string name;
  std::string dtype;           // A name SafetensorsDtypeSize knows.
  std::vector<int64_t> shape;  // Empty for a 0-d tensor (which holds one element).
  uint64_t begin = 0;          // "data_offsets", relative to the start of the data buffer.
  uint64_t end = 0;
};

/// A validated header.
struct SafetensorsHeader {
  uint64_t data_start = 0;                      // 8 + the header length.
  std::vector<SafetensorsHeaderEntry> entries;  // Sorted by begin; they tile the data buffer.
  std::map<std::string, std::string> metadata;  // "__metadata__" (empty if absent).
};

/// Parses the header of `file`, the whole file's bytes (`path` names it in errors), and
/// checks it: length field sane for the file size, header a JSON object, every entry with
/// a known dtype, a shape of non-negative integers and a byte range of exactly numel *
/// itemsize, the ranges tiling the data buffer (no overlap, no gap, nothing missing or
/// trailing), metadata values strings. DataLoss naming the file and, where it applies,
/// the tensor otherwise.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path,
                                                         std::string_view file);

}  // namespace fulcrum::ckpt
