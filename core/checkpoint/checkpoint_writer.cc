// CheckpointWriter: temp directory, shards, manifest, atomic commit. See
// NOTE [checkpoint crash safety] in checkpoint.h for the order of operations.
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/checksum.h"
#include "core/json_limits.h"
#include "core/logging.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

// Keys of manifest.json that the writer owns; "iteration" is owned too but callers may
// repeat it.
constexpr std::string_view kReservedManifestKeys[] = {"format_version", "files", "tensors",
                                                     kPiecesKey, kManifestChecksumKey};

// Puts the save directory back into a state where only committed checkpoints remain:
// deletes the temp directories of interrupted saves and resolves interrupted re-saves.
// Runs on the rank that calls Begin, while no other save is in flight.
absl::Status RecoverSaveDir(FileSystem* fs, const std::string& save_dir) {
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> names, fs->ListDir(save_dir));
  bool changed = false;
  for (const std::string& name : names) {
    const std::string path = JoinPath(save_dir, name);
    if (absl::StartsWith(name, kTempDirPrefix)) {
      FULCRUM_LOG(INFO) << "removing " << path << ", left by an interrupted checkpoint save";
      FULCRUM_RETURN_IF_ERROR(fs->DeleteRecursively(path));
      changed = true;
    } else if (absl::StartsWith(name, kOldDirPrefix)) {
      const std::string final_dir =
          JoinPath(save_dir, name.substr(std::string_view(kOldDirPrefix).size()));
      if (fs->IsDirectory(final_dir)) {
        // The re-save got its new directory in place; the old copy is garbage.
        FULCRUM_RETURN_IF_ERROR(fs->DeleteRecursively(path));
      } else {
        // Crashed between moving the old copy aside and renaming the new one in: the old
        // copy is the one `latest` may name, so it goes back.
        FULCRUM_LOG(WARNING) << "restoring " << final_dir << " from " << path
                             << ", moved aside by an interrupted re-save";
        FULCRUM_RETURN_IF_ERROR(fs->RenameFile(path, final_dir));
      }
      changed = true;
    } else if (name == absl::StrCat(kLatestFileName, ".tmp")) {
      FULCRUM_RETURN_IF_ERROR(fs->DeleteRecursively(path));
      changed = true;
    }
  }
  if (changed) FULCRUM_RETURN_IF_ERROR(fs->SyncDir(save_dir));
  return absl::OkStatus();
}

absl::Status CheckIteration(const std::string& save_dir, int64_t iteration) {
  if (save_dir.empty()) return absl::InvalidArgumentError("checkpoint save directory is empty");
  if (iteration < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot save a checkpoint of iteration ",
                                                   iteration, " to ", save_dir,
                                                   ": iteration must be non-negative"));
  }
  return absl::OkStatus();
}

}  // namespace

CheckpointWriter::CheckpointWriter(FileSystem* fs, std::string save_dir, int64_t iteration)
    : fs_(fs),
      save_dir_(std::move(save_dir)),
      iteration_(iteration),
      temp_dir_(JoinPath(save_dir_, absl::StrCat(kTempDirPrefix, IterationDirName(iteration)))) {}

std::string CheckpointWriter::final_dir() const {
  return JoinPath(save_dir_, IterationDirName(iteration_));
}

absl::StatusOr<CheckpointWriter> CheckpointWriter::Begin(FileSystem* fs,
                                                         const std::string& save_dir,
                                                         int64_t iteration) {
  FULCRUM_RETURN_IF_ERROR(CheckIteration(save_dir, iteration));
  FULCRUM_RETURN_IF_ERROR(fs->CreateDir(save_dir));
  FULCRUM_RETURN_IF_ERROR(RecoverSaveDir(fs, save_dir));
  CheckpointWriter writer(fs, save_dir, iteration);
  FULCRUM_RETURN_IF_ERROR(fs->CreateDir(writer.temp_dir_));
  return writer;
}

absl::StatusOr<CheckpointWriter> CheckpointWriter::Join(FileSystem* fs, const std::string& save_dir,
                                                        int64_t iteration) {
  FULCRUM_RETURN_IF_ERROR(CheckIteration(save_dir, iteration));
  CheckpointWriter writer(fs, save_dir, iteration);
  if (!fs->IsDirectory(writer.temp_dir_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot join the save of iteration ", iteration, ": ", writer.temp_dir_,
                     " does not exist (CheckpointWriter::Begin must run first, on one rank)"));
  }
  return writer;
}

std::string PieceStoredName(const std::string& piece_of, const std::string& shard_name) {
  return absl::StrCat(piece_of, "@", shard_name);
}

absl::Status CheckpointWriter::WriteShard(
    const std::string& shard_name, const std::vector<std::pair<std::string, at::Tensor>>& whole,
    const std::vector<TensorPiece>& pieces) {
  if (committed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("WriteShard('", shard_name, "') after Commit of ", final_dir()));
  }
  if (!IsValidShardName(shard_name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid checkpoint shard name '", shard_name,
                     "': expected [A-Za-z0-9_-][A-Za-z0-9_.-]*, at most 128 characters"));
  }
  if (shards_written_.count(shard_name) > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint shard '", shard_name, "' was already written to ", temp_dir_));
  }

  // The pieces are stored tensors under their stored names, their rows in "pieces".
  std::vector<std::pair<std::string, at::Tensor>> tensors = whole;
  nlohmann::json piece_rows = nlohmann::json::object();
  for (const TensorPiece& piece : pieces) {
    PieceRow row;
    row.of = piece.name;
    row.shape = piece.shape;
    row.offsets = piece.offsets;
    row.box = piece.flat ? piece.box : piece.tensor.sizes().vec();
    row.flat = piece.flat;
    row.flat_begin = piece.flat ? piece.flat_begin : 0;
    row.flat_end = piece.flat ? piece.flat_end : piece.tensor.numel();
    const std::string stored = PieceStoredName(piece.name, shard_name);
    if (piece_rows.contains(stored)) {
      return absl::InvalidArgumentError(absl::StrCat("shard '", shard_name,
                                                     "' has two pieces of '", piece.name, "'"));
    }
    piece_rows[stored] = PieceRowToJson(row);
    tensors.emplace_back(stored, piece.tensor);
  }
  // Rows that do not parse would fail every reader: refuse them here, naming the piece.
  FULCRUM_RETURN_IF_ERROR(ParsePieceRows(piece_rows, absl::StrCat("shard ", shard_name)).status());

  const std::string file_name = absl::StrCat(shard_name, kSafetensorsSuffix);
  const std::string path = JoinPath(temp_dir_, file_name);
  std::map<std::string, uint64_t> checksums;
  // "format": "pt" is what Hugging Face loaders look for in PyTorch-written files.
  FULCRUM_RETURN_IF_ERROR(WriteSafetensors(
      fs_, path, tensors, {{"format", "pt"}, {"fulcrum_iteration", std::to_string(iteration_)}},
      &checksums));
  FULCRUM_ASSIGN_OR_RETURN(const uint64_t file_bytes, fs_->FileSize(path));

  nlohmann::json table = nlohmann::json::object();
  for (const auto& [name, tensor] : tensors) {
    ManifestEntry entry;
    entry.file = file_name;
    entry.dtype = tensor.scalar_type();
    entry.shape = tensor.sizes().vec();
    entry.xxh3 = checksums.at(name);
    table[name] = ManifestEntryToJson(entry);
  }
  // The index is how a committing rank learns this shard's tensors without opening it.
  const nlohmann::json index = {
      {"format_version", kManifestFormatVersion},
      {"shard", shard_name},
      {"files", {{file_name, {{"bytes", file_bytes}}}}},
      {"tensors", std::move(table)},
      {kPiecesKey, std::move(piece_rows)},
  };
  FULCRUM_RETURN_IF_ERROR(WriteStringToFile(
      fs_, JoinPath(temp_dir_, absl::StrCat(shard_name, kShardIndexSuffix)), index.dump(1) + "\n"));
  // Recorded only on success, so a shard whose write failed can be written again.
  shards_written_.insert(shard_name);
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Commit(const nlohmann::json& manifest_fields) {
  if (committed_) {
    return absl::FailedPreconditionError(absl::StrCat(final_dir(), " was already committed"));
  }
  if (!manifest_fields.is_object() && !manifest_fields.is_null()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint manifest fields must be a JSON object, got ", manifest_fields.type_name()));
  }
  nlohmann::json manifest = manifest_fields.is_null() ? nlohmann::json::object() : manifest_fields;
  for (const std::string_view key : kReservedManifestKeys) {
    if (manifest.contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint manifest field '", std::string(key), "' is reserved (set by the writer)"));
    }
  }
  if (manifest.contains("iteration") && manifest["iteration"] != iteration_) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest field 'iteration' is ", manifest["iteration"].dump(),
                     " but the checkpoint is of iteration ", iteration_));
  }

  // Merge the indexes of every shard in the temp dir: this rank's and other ranks'.
  nlohmann::json files = nlohmann::json::object();
  nlohmann::json tensors = nlohmann::json::object();
  nlohmann::json pieces = nlohmann::json::object();
  std::map<std::string, std::string> owner;  // Tensor name -> index file, for errors.
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> names, fs_->ListDir(temp_dir_));
  for (const std::string& name : names) {
    if (!absl::EndsWith(name, kShardIndexSuffix)) continue;
    const std::string index_path = JoinPath(temp_dir_, name);
    FULCRUM_ASSIGN_OR_RETURN(const std::string text, fs_->ReadFile(index_path));
    FULCRUM_RETURN_IF_ERROR(CheckJsonDepth(text, index_path));  // NOTE [JSON nesting limit]
    nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("files") ||
        !index["files"].is_object() || !index.contains("tensors")) {
      return absl::DataLossError(
          absl::StrCat(index_path, ": not a shard index (expected {files, tensors} JSON)"));
    }
    // Parsing validates the rows written by (possibly) another process.
    FULCRUM_ASSIGN_OR_RETURN(const TensorTable table,
                             ParseTensorTable(index["tensors"], index_path));
    for (const auto& [file_name, file_info] : index["files"].items()) {
      const std::string shard_path = JoinPath(temp_dir_, file_name);
      FULCRUM_ASSIGN_OR_RETURN(const uint64_t bytes, fs_->FileSize(shard_path));
      if (!file_info.contains("bytes") || file_info["bytes"] != bytes) {
        return absl::DataLossError(absl::StrCat(shard_path, " has ", bytes, " bytes but ",
                                                index_path, " recorded ", file_info.dump()));
      }
      files[file_name] = file_info;
    }
    for (const auto& [tensor_name, entry] : table) {
      const auto [it, inserted] = owner.emplace(tensor_name, index_path);
      if (!inserted) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", tensor_name, "' is in two checkpoint shards: ", it->second,
                         " and ", index_path));
      }
      tensors[tensor_name] = ManifestEntryToJson(entry);
    }
    if (const auto rows = index.find(kPiecesKey); rows != index.end()) {
      FULCRUM_ASSIGN_OR_RETURN(const PieceRows parsed, ParsePieceRows(*rows, index_path));
      for (const auto& [stored, row] : parsed) pieces[stored] = PieceRowToJson(row);
    }
  }
  // The pieces of every sharded tensor, from all shards, must tile it: a save that lost a
  // piece is refused here, before anything is visible (NOTE [sharded checkpoints]).
  if (!pieces.empty()) {
    FULCRUM_ASSIGN_OR_RETURN(const auto rows, ParseTensorRows(tensors, temp_dir_));
    FULCRUM_ASSIGN_OR_RETURN(const PieceRows parsed, ParsePieceRows(pieces, temp_dir_));
    const absl::Status tiled = AssemblePieces(parsed, rows, temp_dir_).status();
    if (!tiled.ok()) return absl::FailedPreconditionError(tiled.message());
  }
  if (files.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot commit ", temp_dir_, ": no shard was written to it"));
  }

  // Without pieces the manifest is what format 2 was: builds before sharded checkpoints
  // read it.
  manifest["format_version"] = pieces.empty() ? int64_t{2} : kManifestFormatVersion;
  manifest["iteration"] = iteration_;
  manifest["files"] = std::move(files);
  manifest["tensors"] = std::move(tensors);
  if (!pieces.empty()) manifest[kPiecesKey] = std::move(pieces);
  manifest[kManifestChecksumKey] = ManifestChecksum(manifest);  // NOTE [manifest checksum]
  FULCRUM_RETURN_IF_ERROR(
      WriteStringToFile(fs_, JoinPath(temp_dir_, kManifestFileName), manifest.dump(1) + "\n"));
  // Every file in the temp dir is fsync'ed; this makes their directory entries durable
  // before the directory becomes visible under its final name.
  FULCRUM_RETURN_IF_ERROR(fs_->SyncDir(temp_dir_));
  FULCRUM_RETURN_IF_ERROR(MoveIntoPlace());
  FULCRUM_RETURN_IF_ERROR(WriteFileAtomically(fs_, JoinPath(save_dir_, kLatestFileName),
                                              IterationDirName(iteration_) + "\n"));
  committed_ = true;
  // Only now is the moved-aside copy unreachable: `latest` no longer depends on it. A
  // failure to delete it is harmless (the next Begin retries), so it is only logged.
  const std::string old_dir =
      JoinPath(save_dir_, absl::StrCat(kOldDirPrefix, IterationDirName(iteration_)));
  if (fs_->FileExists(old_dir)) {
    absl::Status deleted = fs_->DeleteRecursively(old_dir);
    if (!deleted.ok()) FULCRUM_LOG(WARNING) << "cannot remove " << old_dir << ": " << deleted;
  }
  FULCRUM_LOG(INFO) << "saved checkpoint " << final_dir() << " (" << manifest["tensors"].size()
                    << " tensors in " << manifest["files"].size() << " files)";
  return absl::OkStatus();
}

absl::Status CheckpointWriter::Abort() {
  if (committed_) {
    return absl::FailedPreconditionError(absl::StrCat("Abort after Commit of ", final_dir()));
  }
  if (!fs_->FileExists(temp_dir_)) return absl::OkStatus();
  FULCRUM_RETURN_IF_ERROR(fs_->DeleteRecursively(temp_dir_));
  return fs_->SyncDir(save_dir_);
}

absl::Status CheckSaveDirWritable(FileSystem* fs, const std::string& save_dir) {
  auto refuse = [&](const absl::Status& cause) {
    return absl::FailedPreconditionError(absl::StrCat("cannot save checkpoints to ", save_dir,
                                                      " (--save): ", cause.message()));
  };
  if (save_dir.empty()) return absl::InvalidArgumentError("checkpoint save directory is empty");
  if (absl::Status s = fs->CreateDir(save_dir); !s.ok()) return refuse(s);
  if (!fs->IsDirectory(save_dir)) return refuse(absl::NotFoundError("not a directory"));
  // One probe per process: the ranks of a job check the same directory at once. The temp
  // prefix makes a probe left by a killed process garbage the next Begin removes.
  const std::string probe =
      JoinPath(save_dir, absl::StrCat(kTempDirPrefix, "write_probe_", getpid()));
  // A write that fails (a full disk fails the sync, not the creation) must not leave the
  // probe behind: it is removed whatever the write did.
  const absl::Status written = WriteStringToFile(fs, probe, "fulcrum\n");
  const absl::Status removed = fs->DeleteRecursively(probe);
  if (!written.ok()) return refuse(written);
  if (!removed.ok()) return refuse(removed);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RemoveOldCheckpoints(FileSystem* fs,
                                                              const std::string& save_dir,
                                                              int64_t keep) {
  if (keep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("keep must be ≥ 1, got ", keep));
  }
  std::string latest;
  if (auto text = fs->ReadFile(JoinPath(save_dir, kLatestFileName)); text.ok()) {
    latest = std::string(absl::StripAsciiWhitespace(*text));
  }
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> names, fs->ListDir(save_dir));
  std::vector<std::pair<int64_t, std::string>> committed;
  for (const std::string& name : names) {
    if (auto iteration = ParseIterationDirName(name); iteration.has_value()) {
      committed.emplace_back(*iteration, name);
    }
  }
  std::sort(committed.rbegin(), committed.rend());  // newest first
  std::vector<std::string> removed;
  for (size_t i = static_cast<size_t>(keep); i < committed.size(); ++i) {
    if (committed[i].second == latest) continue;
    FULCRUM_RETURN_IF_ERROR(fs->DeleteRecursively(JoinPath(save_dir, committed[i].second)));
    removed.push_back(committed[i].second);
  }
  if (!removed.empty()) FULCRUM_RETURN_IF_ERROR(fs->SyncDir(save_dir));
  return removed;
}

absl::Status CheckpointWriter::MoveIntoPlace() {
  const std::string target = final_dir();
  if (fs_->FileExists(target)) {
    // Re-saving an iteration (e.g. after resuming from it). rename(2) cannot replace a
    // non-empty directory, so the old one goes aside first; it stays a complete checkpoint
    // there until the new one is in place (NOTE [checkpoint crash safety]).
    const std::string old_dir =
        JoinPath(save_dir_, absl::StrCat(kOldDirPrefix, IterationDirName(iteration_)));
    FULCRUM_RETURN_IF_ERROR(fs_->DeleteRecursively(old_dir));
    FULCRUM_RETURN_IF_ERROR(fs_->RenameFile(target, old_dir));
  }
  FULCRUM_RETURN_IF_ERROR(fs_->RenameFile(temp_dir_, target));
  return fs_->SyncDir(save_dir_);
}

}  // namespace fulcrum::ckpt
