// Layout-independent training checkpoints (DESIGN.md invariant 4): tensors stored by
// global name in safetensors shard files, beside a manifest.json, committed atomically.
//
// NOTE [checkpoint directory layout]
//   <save>/latest                      "iter_0000020\n": the newest committed checkpoint
//   <save>/iter_0000020/manifest.json  caller's fields + format_version, iteration,
//                                      files {name: {bytes}}, and the tensor table
//                                      tensors {global name: {file, dtype, shape, xxh3}}
//   <save>/iter_0000020/<shard>.safetensors     tensors written by one writer (rank)
//   <save>/iter_0000020/<shard>.index.json      that shard's tensor table (see below)
//   <save>/.tmp_iter_0000020/          a save in progress; never read
//   <save>/.old_iter_0000020/          an older iter_0000020 moved aside while the same
//                                      iteration is re-saved; removed once the new one is in
// Tensors are keyed by global name ("layers.3.attention.qkv.weight",
// "optimizer.layers.3.attention.qkv.weight.exp_avg"), never by rank, so a checkpoint can be
// loaded under any tp/pp/ep/dp layout: which shard holds a tensor is only a lookup.
//
// NOTE [checkpoint crash safety] A save writes everything into .tmp_iter_N, fsyncs it,
// renames it to iter_N, fsyncs <save>, and only then atomically replaces `latest` (write
// latest.tmp, fsync, rename, fsync <save>). A crash at any point therefore leaves `latest`
// naming a complete checkpoint (or absent if none was ever committed). Re-saving an
// existing iteration moves the old directory aside to .old_iter_N before the new one is
// renamed in; a crash between those two renames leaves `latest` naming a missing iter_N,
// which CheckpointReader resolves to .old_iter_N and the next Begin() renames back.
//
// Multi-rank saving: one rank calls CheckpointWriter::Begin, then (after a barrier) every
// other rank calls Join; each rank WriteShard()s its own shard with a distinct name; after
// a second barrier one rank calls Commit, which merges every <shard>.index.json found in
// the temporary directory into the manifest. The file system must be shared by the ranks.
// Only one save per save directory may be in flight at a time.
//
// Thread-safety: a CheckpointWriter is used from one thread. A CheckpointReader is
// immutable after Open; its const methods may be called from many threads at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/manifest.h"
#include "core/checkpoint/safetensors.h"
#include "core/file_system.h"

namespace fulcrum::ckpt {

/// A rank's piece of a tensor that no rank holds whole (NOTE [sharded checkpoints] in
/// core/checkpoint/manifest_json.h): a box of the whole tensor, or a range of a box's
/// row-major elements.
struct TensorPiece {
  std::string name;              // The whole tensor's global name.
  std::vector<int64_t> shape;    // The whole tensor's shape.
  std::vector<int64_t> offsets;  // The box's first index along each dimension.
  /// With a flat range, the box's extent (empty for a 0-dim whole); without, unused: the
  /// box is `tensor`'s shape.
  std::vector<int64_t> box;
  /// With a flat range: `tensor` is 1-D, the box's elements [flat_begin, flat_end).
  bool flat = false;
  int64_t flat_begin = 0;
  int64_t flat_end = 0;
  at::Tensor tensor;
};

/// The stored name of `piece_of`'s piece written by shard `shard_name`: "<name>@<shard>".
std::string PieceStoredName(const std::string& piece_of, const std::string& shard_name);

/// Writes one checkpoint directory. Movable, not copyable.
class CheckpointWriter {
 public:
  /// Starts the save of `iteration` into `save_dir` (created if missing): finishes or
  /// undoes whatever an interrupted earlier save left (stale .tmp_iter_* directories are
  /// deleted, a moved-aside .old_iter_* is restored or deleted) and creates an empty
  /// <save_dir>/.tmp_iter_NNNNNNN. Call on one rank only.
  static absl::StatusOr<CheckpointWriter> Begin(FileSystem* fs, const std::string& save_dir,
                                                int64_t iteration);
  /// Attaches to the temporary directory that Begin created (possibly on another rank),
  /// without cleaning anything. FailedPrecondition if it does not exist yet.
  static absl::StatusOr<CheckpointWriter> Join(FileSystem* fs, const std::string& save_dir,
                                               int64_t iteration);

  /// Writes `tensors` (global names) to <temp dir>/<shard_name>.safetensors and their table
  /// (dtype, shape, xxh3 of the stored bytes) to <shard_name>.index.json, both fsync'ed.
  /// `shard_name` must match [A-Za-z0-9_-][A-Za-z0-9_.-]* (e.g. "model", "pp1_tp0") and be
  /// unique within the checkpoint.
  /// `pieces` are stored too, under PieceStoredName, with their rows in the index's
  /// "pieces" table; Commit checks that every sharded tensor's pieces, from all shards,
  /// tile it.
  absl::Status WriteShard(const std::string& shard_name,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::vector<TensorPiece>& pieces = {});

  /// Makes the checkpoint visible: merges every shard's index (a tensor name in two shards
  /// is an error), writes manifest.json with `manifest_fields` (a JSON object; its keys
  /// "format_version", "files" and "tensors" are reserved, and "iteration" must match if
  /// given) plus the tensor table, renames the temp dir to iter_NNNNNNN and points `latest`
  /// at it, with the fsyncs that make each step durable (NOTE [checkpoint crash safety]).
  absl::Status Commit(const nlohmann::json& manifest_fields);

  /// Gives up a save that failed before Commit: deletes the temporary directory (the next
  /// Begin would too, but a failed save should not leave its partial files behind).
  absl::Status Abort();

  int64_t iteration() const { return iteration_; }
  const std::string& save_dir() const { return save_dir_; }
  /// <save_dir>/.tmp_iter_NNNNNNN, where shards are written.
  const std::string& temp_dir() const { return temp_dir_; }
  /// <save_dir>/iter_NNNNNNN, where the checkpoint lives once committed.
  std::string final_dir() const;

 private:
  CheckpointWriter(FileSystem* fs, std::string save_dir, int64_t iteration);

  // Renames the temp dir to final_dir(), moving an existing final_dir() aside first.
  absl::Status MoveIntoPlace();

  FileSystem* fs_;
  std::string save_dir_;
  int64_t iteration_;
  std::string temp_dir_;
  std::set<std::string> shards_written_;  // By this writer; other ranks' are found on disk.
  bool committed_ = false;
};

/// Creates `save_dir` if it is missing and checks that a file can be written, synced and
/// deleted in it — before training, so an unwritable --save is reported before the work it
/// was meant to keep. FailedPrecondition naming the directory and the cause otherwise.
absl::Status CheckSaveDirWritable(FileSystem* fs, const std::string& save_dir);

/// Deletes the committed checkpoints (iter_* directories) of `save_dir` except the newest
/// `keep` and the one `latest` names; `keep` ≥ 1. Returns the deleted directories' names.
absl::StatusOr<std::vector<std::string>> RemoveOldCheckpoints(FileSystem* fs,
                                                              const std::string& save_dir,
                                                              int64_t keep);

/// How CheckpointReader::Open treats what it cannot verify.
struct CheckpointReadOptions {
  /// Default: false. Read a manifest of format_version 1, which predates the manifest's
  /// own checksum, so nothing catches an edited field (iteration, data position) in it;
  /// without this such a checkpoint is DataLoss (NOTE [manifest checksum]).
  bool allow_unchecksummed_manifest = false;
};

/// A committed checkpoint, opened for reading. Cheap to copy (shares its state).
class CheckpointReader {
 public:
  /// `path` is a save directory (follows `latest`; if `latest` is missing, the newest
  /// complete iter_* directory is used with a warning) or a checkpoint directory
  /// (iter_NNNNNNN). Open parses the manifest, checks each shard file's size against the
  /// manifest, validates every shard header and checks that every tensor in the manifest
  /// is in its file with the recorded dtype and shape; only checksums are left to Read and
  /// VerifyAll. Errors name the file: NotFound if there is no checkpoint, DataLoss if one is
  /// damaged (or its manifest has no checksum and `options` does not allow that).
  static absl::StatusOr<CheckpointReader> Open(FileSystem* fs, const std::string& path,
                                               const CheckpointReadOptions& options = {});
  /// Open() on DefaultFileSystem().
  static absl::StatusOr<CheckpointReader> Open(const std::string& path,
                                               const CheckpointReadOptions& options = {});

  /// The checkpoint directory actually read (e.g. /save/iter_0000020).
  const std::string& dir() const { return state_->dir; }
  /// The whole manifest, caller fields included.
  const nlohmann::json& manifest() const;
  int64_t iteration() const { return state_->iteration; }
  /// The names of the tensors Read gives — stored whole, or as pieces (NOTE [sharded
  /// checkpoints]) — sorted; never a piece's stored name.
  std::vector<std::string> names() const;
  /// The stored tensors (pieces among them, under their stored names), by name.
  const TensorTable& entries() const { return state_->entries; }
  /// The tensors stored as pieces, by whole name.
  const ShardedTensorTable& sharded() const { return state_->sharded; }
  /// The dtype and whole shape of `name` (stored whole or as pieces); NotFound otherwise.
  absl::StatusOr<std::pair<at::ScalarType, std::vector<int64_t>>> Describe(
      std::string_view name) const;
  /// False for a manifest of format_version 1 (read only with
  /// CheckpointReadOptions::allow_unchecksummed_manifest): its fields were not verified.
  bool manifest_checksummed() const { return state_->manifest_checksummed; }
  /// Whether Read(name) finds a tensor (not a piece's stored name).
  bool Has(std::string_view name) const;

  /// Reads `name` into a new CPU tensor after checking its checksum; a mismatch is
  /// DataLoss naming the tensor and its file. NotFound if the checkpoint has no `name`.
  /// A sharded tensor is assembled from its pieces, each checked.
  absl::StatusOr<at::Tensor> Read(std::string_view name) const;

  /// Reads elements [start, start + length) of `name` along `dim` (a tensor-parallel
  /// rank's shard). Of a sharded tensor only the pieces whose boxes overlap the slice are
  /// read and checked; a tensor stored whole is read whole and narrowed.
  absl::StatusOr<at::Tensor> ReadSlice(std::string_view name, int64_t dim, int64_t start,
                                       int64_t length) const;

  /// Checks every tensor's checksum. (That every file is present with its recorded size
  /// and every tensor is in its file with the recorded dtype and shape was checked by Open:
  /// a reader exists only for a structurally sound checkpoint.) On failure, DataLoss listing
  /// the first few bad tensors with their files, and how many there are in all.
  absl::Status VerifyAll() const;

 private:
  struct State {
    std::string dir;
    std::shared_ptr<const nlohmann::json> manifest;
    int64_t iteration = 0;
    bool manifest_checksummed = true;
    TensorTable entries;
    PieceRows pieces;
    ShardedTensorTable sharded;
    std::map<std::string, std::unique_ptr<SafetensorsReader>> files;  // By file name.
  };
  explicit CheckpointReader(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  static absl::StatusOr<CheckpointReader> OpenDir(FileSystem* fs, const std::string& dir,
                                                  const CheckpointReadOptions& options);
  // The bytes of `name` after checking them against the manifest's checksum.
  absl::StatusOr<std::string_view> VerifiedBytes(const std::string& name,
                                                 const ManifestEntry& entry) const;
  // A stored tensor (whole, or a piece) after checking its checksum.
  absl::StatusOr<at::Tensor> ReadStored(std::string_view name) const;
  // One box of a sharded tensor, assembled from its pieces, in the box's shape.
  absl::StatusOr<at::Tensor> ReadBox(const ShardedTensorRows::Box& box, at::ScalarType dtype) const;

  std::shared_ptr<const State> state_;
};

}  // namespace fulcrum::ckpt
