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
/// Version 2 added the manifest's own checksum (kManifestChecksumKey); version 3 the
/// sharded tensors (kPiecesKey, NOTE [sharded checkpoints]).
inline constexpr int64_t kManifestFormatVersion = 3;
/// The manifest's (and a shard index's) table of pieces (NOTE [sharded checkpoints]).
inline constexpr char kPiecesKey[] = "pieces";
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

// NOTE [sharded checkpoints]
// A tensor no rank holds whole (a tensor-parallel shard, a distributed optimizer's slice of
// the moments) is saved as pieces, each written by the rank that owns it, never gathered.
// A piece is an ordinary stored tensor (in the "tensors" table, checksummed, in its
// writer's shard file) named "<whole name>@<shard>", plus a row in the "pieces" table
// saying where it lies in the whole:
//   "pieces": {
//     "layers.0.mlp.fc1.weight@stage_000_tp_001": {
//       "of": "layers.0.mlp.fc1.weight", "shape": [256, 64],   the whole tensor
//       "offsets": [128, 0], "box": [128, 64],                  a box of the whole
//       "flat": [0, 4096]}                                      optional: part of the box
//   }
// The box is a rectangle of the whole (a tp shard: offset along its split dimension); the
// stored tensor is the box, or with "flat" [b, e) the elements b..e−1 of the box in
// row-major order, 1-D (a data-parallel rank's slice of a flattened shard). The pieces of
// one whole tensor must tile it exactly: the boxes disjoint and covering every element,
// the flat ranges of a box covering it without gap or overlap, one dtype. The writer checks
// that at Commit, the reader at Open (AssemblePieces), so a checkpoint is complete or
// refused. A reader reads the whole tensor by its whole name, or only the boxes a slice
// overlaps (CheckpointReader::ReadSlice): a rank loading its tp shard reads those bytes.

/// Where one stored tensor lies in the whole tensor it is a piece of.
struct PieceRow {
  std::string of;                // The whole tensor's name.
  std::vector<int64_t> shape;    // The whole tensor's shape.
  std::vector<int64_t> offsets;  // The box's first index along each dimension.
  std::vector<int64_t> box;      // The box's extent along each dimension.
  int64_t flat_begin = 0;        // The box's row-major elements [flat_begin, flat_end) are
  int64_t flat_end = 0;          // stored; the whole box: 0 and its element count.
  bool flat = false;             // Written with "flat" (stored 1-D) rather than as the box.
};
/// By stored name.
using PieceRows = std::map<std::string, PieceRow, std::less<>>;

/// `row` as its JSON.
nlohmann::json PieceRowToJson(const PieceRow& row);

/// Parses a "pieces" table: every row an object with a non-empty 'of', integer arrays
/// 'shape', 'offsets' and 'box' of one length with the box inside the shape, and an
/// optional 'flat' [b, e) with 0 ≤ b < e ≤ the box's element count. DataLoss naming
/// `source`, the piece and the field otherwise.
absl::StatusOr<PieceRows> ParsePieceRows(const nlohmann::json& table, const std::string& source);

/// A whole tensor that is stored as pieces, checked to be complete.
struct ShardedTensorRows {
  std::string dtype;           // The pieces' dtype (a safetensors name).
  std::vector<int64_t> shape;  // The whole shape.
  struct Box {
    std::vector<int64_t> offsets;
    std::vector<int64_t> extent;
    std::vector<std::string> pieces;  // Stored names, by flat_begin.
  };
  std::vector<Box> boxes;
};
using ShardedTensorTable = std::map<std::string, ShardedTensorRows, std::less<>>;

/// Groups `pieces` by whole tensor and checks that they tile it (NOTE [sharded
/// checkpoints]): each piece a stored tensor of `tensors` whose shape is its box (or its
/// flat length), one dtype and one whole shape per whole tensor, disjoint boxes covering it,
/// flat ranges covering each box, and no whole name that is also a stored tensor.
/// DataLoss naming `source` and the tensor otherwise.
absl::StatusOr<ShardedTensorTable> AssemblePieces(
    const PieceRows& pieces, const std::map<std::string, TensorRow, std::less<>>& tensors,
    const std::string& source);

/// A manifest.json whose structure was checked.
struct ManifestJson {
  nlohmann::json json;  // The whole manifest, an object.
  int64_t format_version = 0;
  bool verified = false;  // Its checksum matched; false only for format 1, which has none.
  int64_t iteration = 0;
  std::map<std::string, TensorRow, std::less<>> tensors;  // Every stored tensor.
  PieceRows pieces;             // Which stored tensors are pieces, and of what.
  ShardedTensorTable sharded;   // The whole tensors they make (AssemblePieces).
};

/// Parses the text of a manifest.json (`path` names it in errors) and checks what needs
/// no shard: nesting (NOTE [JSON nesting limit]), a JSON object, an integer format_version
/// this build reads, its checksum (NOTE [manifest checksum]) from format 2 on, an integer
/// iteration, an object 'files' of plain file names, the tensor table (ParseTensorRows) and,
/// from format 3, the pieces (ParsePieceRows, AssemblePieces). DataLoss naming the file and
/// the field otherwise.
absl::StatusOr<ManifestJson> ParseManifestJson(std::string_view text, const std::string& path);

}  // namespace fulcrum::ckpt
