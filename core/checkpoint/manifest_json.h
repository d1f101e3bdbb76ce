// The JSON of a checkpoint's manifest.json, without LibTorch: its file names and format
// constants, its own checksum, and the checks of its text and of its tensor table that
// need no tensor (core/checkpoint/manifest.h maps the table's dtypes to LibTorch types;
// CheckpointReader then opens the shards). The fuzz target tests/fuzz/
// checkpoint_manifest_fuzz.cc calls ParseManifestJson directly.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
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

/// True for shard names accepted by CheckpointWriter::WriteShard:
/// [A-Za-z0-9_-][A-Za-z0-9_.-]*, at most 128 characters. They become file names, so no
/// separators and no leading dot (hidden files, "." and "..").
bool IsValidShardName(std::string_view name);

/// One row of a tensor table, as written (ManifestEntry holds the LibTorch dtype).
struct TensorRow {
  std::string file;   // "<shard>.safetensors", a plain file name.
  std::string dtype;  // A safetensors dtype name (SafetensorsDtypeSize knows it).
  std::vector<int64_t> shape;
  uint64_t xxh3 = 0;
};

/// Parses a "tensors" table: each row an object with a plain "<shard>.safetensors" file
/// name, a known dtype, a shape of non-negative integers and 16 hex digits of xxh3.
/// DataLoss naming `source` (the file it came from), the tensor and the bad field otherwise.
absl::StatusOr<std::map<std::string, TensorRow, std::less<>>> ParseTensorRows(
    const nlohmann::json& table, const std::string& source);

/// A manifest.json whose structure was checked.
struct ManifestJson {
  nlohmann::json json;  // The whole manifest, an object.
  int64_t format_version = 0;
  bool verified = false;  // Its checksum matched; false only for format 1, which has none.
  int64_t iteration = 0;
  std::map<std::string, TensorRow, std::less<>> tensors;
};

/// Parses the text of a manifest.json (`path` names it in errors) and checks what needs
/// no shard: nesting (NOTE [JSON nesting limit]), a JSON object, an integer format_version
/// this build reads, its checksum (NOTE [manifest checksum]) from format 2 on, an integer
/// iteration, an object 'files' of plain file names, and the tensor table
/// (ParseTensorRows). DataLoss naming the file and the field otherwise.
absl::StatusOr<ManifestJson> ParseManifestJson(std::string_view text, const std::string& path);

}  // namespace fulcrum::ckpt
