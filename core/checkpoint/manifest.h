// The on-disk schema of a checkpoint directory: directory names, and the tensor table
// shared by manifest.json and the per-shard <shard>.index.json files, with LibTorch dtypes.
// The JSON-only half, file names and format constants included, is manifest_json.h. Layout
// and crash-safety rules are described in core/checkpoint/checkpoint.h.
//
//   "tensors": {
//     "layers.0.mlp.fc1.weight": {"file": "model.safetensors", "dtype": "F32",
//                                 "shape": [256, 64], "xxh3": "9f3c0c2b5a1e7d44"},
//     ...
//   }
//
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint/manifest_json.h"

namespace fulcrum::ckpt {

/// "iter_0000020" for 20: zero-padded to 7 digits like Megatron (more digits past 9999999).
/// `iteration` must be non-negative.
std::string IterationDirName(int64_t iteration);

/// The iteration of a name made by IterationDirName ("iter_" and at least 7 digits), or
/// nullopt for anything else (".tmp_iter_0000020", "iter_20", "../iter_0000020").
std::optional<int64_t> ParseIterationDirName(std::string_view name);

/// One row of a tensor table.
struct ManifestEntry {
  std::string file;  // Shard file name, relative to the checkpoint directory.
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;
  uint64_t xxh3 = 0;  // Xxh3Checksum of the tensor's stored (little-endian) bytes.

  int64_t numel() const;
  uint64_t byte_size() const;
};

using TensorTable = std::map<std::string, ManifestEntry, std::less<>>;

/// `entry` as its JSON row.
nlohmann::json ManifestEntryToJson(const ManifestEntry& entry);

/// `rows` (ParseTensorRows) with their dtypes as LibTorch types.
TensorTable ToTensorTable(std::map<std::string, TensorRow, std::less<>> rows);

/// Parses a "tensors" table: ParseTensorRows (which lists the checks and errors), then
/// ToTensorTable.
absl::StatusOr<TensorTable> ParseTensorTable(const nlohmann::json& table,
                                             const std::string& source);

}  // namespace fulcrum::ckpt
