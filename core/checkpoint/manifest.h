// The on-disk schema of a checkpoint directory: file and directory names, and the tensor
// table shared by manifest.json and the per-shard <shard>.index.json files. Layout and
// crash-safety rules are described in core/checkpoint/checkpoint.h.
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
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fulcrum::ckpt {

inline constexpr char kLatestFileName[] = "latest";
inline constexpr char kManifestFileName[] = "manifest.json";
inline constexpr char kSafetensorsSuffix[] = ".safetensors";
inline constexpr char kShardIndexSuffix[] = ".index.json";
/// A save in progress is written to <save>/<kTempDirPrefix>iter_NNNNNNN.
inline constexpr char kTempDirPrefix[] = ".tmp_";
/// An iteration being re-saved is moved aside to <save>/<kOldDirPrefix>iter_NNNNNNN.
inline constexpr char kOldDirPrefix[] = ".old_";
/// Bumped when the manifest changes incompatibly; readers refuse newer versions.
/// Version 2 added the manifest's own checksum (kManifestChecksumKey).
inline constexpr int64_t kManifestFormatVersion = 2;
/// The manifest field holding ManifestChecksum of the rest of the manifest, so that an
/// edit of any field is caught like a damaged tensor (NOTE [manifest checksum]).
inline constexpr char kManifestChecksumKey[] = "manifest_xxh3";

// NOTE [manifest checksum]
// The tensors' checksums protect the tensors; the manifest says how to read them and where
// training stands (iteration, data position), so it is protected too: the writer stores
// the XXH3 of the manifest's canonical serialisation (nlohmann::json::dump() of the whole
// object without this field: keys sorted, no whitespace) under kManifestChecksumKey, and
// every reader recomputes it. Re-indenting the file keeps it valid; changing any value,
// adding or removing a field does not. Manifests of format 1 have no checksum; since
// "format_version" is itself just a field, setting it to 1 and deleting the checksum would
// otherwise let any edit through, so a format 1 manifest is read only when the caller asks
// for it (CheckpointReadOptions::allow_unchecksummed_manifest: fulcrum_train and
// fulcrum_ckpt's --allow_unchecksummed_manifest), with a warning.

/// XXH3 of `manifest` without kManifestChecksumKey, canonically serialised, as 16 hex digits.
std::string ManifestChecksum(const nlohmann::json& manifest);

/// "iter_0000020" for 20: zero-padded to 7 digits like Megatron (more digits past 9999999).
/// `iteration` must be non-negative.
std::string IterationDirName(int64_t iteration);

/// The iteration of a name made by IterationDirName ("iter_" and at least 7 digits), or
/// nullopt for anything else (".tmp_iter_0000020", "iter_20", "../iter_0000020").
std::optional<int64_t> ParseIterationDirName(std::string_view name);

/// True for shard names accepted by CheckpointWriter::WriteShard:
/// [A-Za-z0-9_-][A-Za-z0-9_.-]*, at most 128 characters. They become file names, so no
/// separators and no leading dot (hidden files, "." and "..").
bool IsValidShardName(std::string_view name);

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

/// Parses a "tensors" table. `source` (the file it came from) prefixes every error, which
/// is DataLoss naming the tensor and the bad field. File names must be plain names ending in
/// ".safetensors".
absl::StatusOr<TensorTable> ParseTensorTable(const nlohmann::json& table,
                                             const std::string& source);

}  // namespace fulcrum::ckpt
