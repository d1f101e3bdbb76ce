// CheckpointReader: finds the checkpoint a path refers to, validates its structure on
// Open, and checks checksums on every read.
#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/checksum.h"
#include "core/logging.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// How many bad tensors VerifyAll lists before summarising the rest as a count.
constexpr size_t kMaxListedErrors = 10;

// The checkpoint directory that `latest` in `save_dir` names. If that directory is missing
// but a moved-aside copy exists, a re-save was interrupted between its two renames and the
// copy is the checkpoint `latest` means (NOTE [checkpoint crash safety]).
absl::StatusOr<std::string> FollowLatest(FileSystem* fs, const std::string& save_dir) {
  const std::string latest_path = JoinPath(save_dir, kLatestFileName);
  FULCRUM_ASSIGN_OR_RETURN(const std::string contents, fs->ReadFile(latest_path));
  const std::string name(absl::StripAsciiWhitespace(contents));
  if (!ParseIterationDirName(name).has_value()) {
    return absl::DataLossError(absl::StrCat(latest_path, ": expected a directory name like ",
                                            IterationDirName(20), ", found '", name, "'"));
  }
  const std::string dir = JoinPath(save_dir, name);
  if (fs->IsDirectory(dir)) return dir;
  const std::string old_dir = JoinPath(save_dir, absl::StrCat(kOldDirPrefix, name));
  if (fs->FileExists(JoinPath(old_dir, kManifestFileName))) {
    FULCRUM_LOG(WARNING) << latest_path << " names " << name << ", which a re-save had moved "
                         << "aside when it was interrupted; reading " << old_dir;
    return old_dir;
  }
  return absl::NotFoundError(
      absl::StrCat(latest_path, " names ", name, " but ", dir, " does not exist"));
}

// The newest iter_* directory of `save_dir` that holds a manifest, for a save dir whose
// `latest` is missing (a crash between the first commit's directory rename and its
// `latest` write).
absl::StatusOr<std::string> NewestCheckpointDir(FileSystem* fs, const std::string& save_dir) {
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> names, fs->ListDir(save_dir));
  std::optional<int64_t> newest;
  for (const std::string& name : names) {
    const std::optional<int64_t> iteration = ParseIterationDirName(name);
    if (iteration.has_value() && (!newest.has_value() || *iteration > *newest) &&
        fs->FileExists(JoinPath(JoinPath(save_dir, name), kManifestFileName))) {
      newest = iteration;
    }
  }
  if (!newest.has_value()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint in ", save_dir, ": ",
                                            JoinPath(save_dir, kLatestFileName),
                                            " is missing and there is no iter_* directory"));
  }
  const std::string dir = JoinPath(save_dir, IterationDirName(*newest));
  FULCRUM_LOG(WARNING) << JoinPath(save_dir, kLatestFileName) << " is missing; reading the "
                       << "newest complete checkpoint, " << dir;
  return dir;
}

}  // namespace

absl::StatusOr<CheckpointReader> CheckpointReader::Open(const std::string& path,
                                                        const CheckpointReadOptions& options) {
  return Open(DefaultFileSystem(), path, options);
}

absl::StatusOr<CheckpointReader> CheckpointReader::Open(FileSystem* fs, const std::string& path,
                                                        const CheckpointReadOptions& options) {
  if (fs->FileExists(JoinPath(path, kManifestFileName))) return OpenDir(fs, path, options);
  if (!fs->IsDirectory(path)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at ", path, ": no such directory"));
  }
  if (ParseIterationDirName(BaseName(path)).has_value()) {
    return absl::DataLossError(absl::StrCat(
        path, " is not a complete checkpoint: ", JoinPath(path, kManifestFileName), " is missing"));
  }
  if (fs->FileExists(JoinPath(path, kLatestFileName))) {
    FULCRUM_ASSIGN_OR_RETURN(const std::string dir, FollowLatest(fs, path));
    return OpenDir(fs, dir, options);
  }
  FULCRUM_ASSIGN_OR_RETURN(const std::string dir, NewestCheckpointDir(fs, path));
  return OpenDir(fs, dir, options);
}

absl::StatusOr<CheckpointReader> CheckpointReader::OpenDir(FileSystem* fs, const std::string& dir,
                                                           const CheckpointReadOptions& options) {
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  FULCRUM_ASSIGN_OR_RETURN(const std::string text, fs->ReadFile(manifest_path));
  FULCRUM_ASSIGN_OR_RETURN(ManifestJson parsed, ParseManifestJson(text, manifest_path));
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": ", what));
  };
  // NOTE [manifest checksum]
  if (!parsed.verified && !options.allow_unchecksummed_manifest) {
    return error(absl::StrCat("format_version ", parsed.format_version,
                              " predates manifest checksums, so an edited field (iteration, "
                              "data position) would go unnoticed; pass "
                              "--allow_unchecksummed_manifest to read it anyway"));
  }
  if (!parsed.verified) {
    FULCRUM_LOG(WARNING) << manifest_path << ": format_version " << parsed.format_version
                         << " predates manifest checksums; its fields are not verified "
                            "(--allow_unchecksummed_manifest)";
  }
  auto manifest = std::make_shared<nlohmann::json>(std::move(parsed.json));
  const nlohmann::json& files = manifest->at("files");

  auto state = std::make_shared<State>();
  state->dir = dir;
  state->iteration = parsed.iteration;
  state->manifest_checksummed = parsed.verified;
  state->entries = ToTensorTable(std::move(parsed.tensors));
  state->pieces = std::move(parsed.pieces);
  state->sharded = std::move(parsed.sharded);

  // Open every shard: a missing, truncated or corrupt file is reported here, naming it,
  // before any tensor is handed out.
  for (const auto& [file_name, file_info] : files.items()) {
    const std::string path = JoinPath(dir, file_name);
    if (!fs->FileExists(path)) {
      return absl::DataLossError(absl::StrCat(path, " is missing (listed in ", manifest_path, ")"));
    }
    FULCRUM_ASSIGN_OR_RETURN(const uint64_t bytes, fs->FileSize(path));
    if (!file_info.contains("bytes") || file_info["bytes"] != bytes) {
      return absl::DataLossError(absl::StrCat(path, " has ", bytes, " bytes but ", manifest_path,
                                              " recorded ", file_info.dump(),
                                              " (truncated or rewritten?)"));
    }
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                             SafetensorsReader::Open(fs, path));
    state->files.emplace(file_name, std::move(reader));
  }

  for (const auto& [name, entry] : state->entries) {
    const auto file = state->files.find(entry.file);
    if (file == state->files.end()) {
      return error(absl::StrCat("tensor '", name, "' is in '", entry.file,
                                "', which is not listed in 'files'"));
    }
    const SafetensorsTensorInfo* info = file->second->info(name);
    if (info == nullptr) {
      return absl::DataLossError(absl::StrCat(file->second->path(), " has no tensor '", name,
                                              "' (listed in ", manifest_path, ")"));
    }
    if (info->dtype != entry.dtype || info->shape != entry.shape) {
      return absl::DataLossError(absl::StrCat(
          file->second->path(), ": tensor '", name, "' is ", c10::toString(info->dtype), " ",
          ShapeString(info->shape), " but ", manifest_path, " recorded ",
          c10::toString(entry.dtype), " ", ShapeString(entry.shape)));
    }
  }
  state->manifest = std::move(manifest);
  return CheckpointReader(std::move(state));
}

const nlohmann::json& CheckpointReader::manifest() const { return *state_->manifest; }

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> names;
  names.reserve(state_->entries.size());
  for (const auto& [name, entry] : state_->entries) {
    if (state_->pieces.count(name) == 0) names.push_back(name);
  }
  for (const auto& [name, whole] : state_->sharded) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

bool CheckpointReader::Has(std::string_view name) const {
  return state_->sharded.count(name) > 0 ||
         (state_->entries.count(name) > 0 && state_->pieces.count(name) == 0);
}

absl::StatusOr<std::pair<at::ScalarType, std::vector<int64_t>>> CheckpointReader::Describe(
    std::string_view name) const {
  if (const auto it = state_->sharded.find(name); it != state_->sharded.end()) {
    return std::pair{*ScalarTypeFromSafetensorsDtype(it->second.dtype), it->second.shape};
  }
  if (!Has(name)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", state_->dir, " has no tensor '", std::string(name), "'"));
  }
  const ManifestEntry& entry = state_->entries.find(name)->second;
  return std::pair{entry.dtype, entry.shape};
}

absl::StatusOr<std::string_view> CheckpointReader::VerifiedBytes(const std::string& name,
                                                                 const ManifestEntry& entry) const {
  const SafetensorsReader& file = *state_->files.at(entry.file);
  FULCRUM_ASSIGN_OR_RETURN(const std::string_view bytes, file.RawBytes(name));
  const uint64_t checksum = Xxh3Checksum(bytes);
  if (checksum != entry.xxh3) {
    return absl::DataLossError(absl::StrCat(
        "checksum mismatch for tensor '", name, "' in ", file.path(), ": manifest says ",
        ChecksumToHex(entry.xxh3), ", the stored bytes hash to ", ChecksumToHex(checksum)));
  }
  return bytes;
}

absl::StatusOr<at::Tensor> CheckpointReader::ReadStored(std::string_view name) const {
  const auto it = state_->entries.find(name);
  if (it == state_->entries.end()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", state_->dir, " has no tensor '", std::string(name), "'"));
  }
  FULCRUM_RETURN_IF_ERROR(VerifiedBytes(it->first, it->second).status());
  // Verified bytes, decoded by the shard reader (one copy into a fresh tensor).
  return state_->files.at(it->second.file)->Read(name);
}

absl::StatusOr<at::Tensor> CheckpointReader::ReadBox(const ShardedTensorRows::Box& box,
                                                     at::ScalarType dtype) const {
  if (box.pieces.size() == 1 && !state_->pieces.at(box.pieces[0]).flat) {
    return ReadStored(box.pieces[0]);
  }
  // Flat pieces: the box's row-major elements, range by range (AssemblePieces checked
  // that the ranges tile it).
  at::Tensor flat = at::empty({std::accumulate(box.extent.begin(), box.extent.end(), int64_t{1},
                                               std::multiplies<int64_t>())},
                              at::TensorOptions().dtype(dtype));
  for (const std::string& stored : box.pieces) {
    const PieceRow& row = state_->pieces.at(stored);
    FULCRUM_ASSIGN_OR_RETURN(const at::Tensor piece, ReadStored(stored));
    flat.narrow(0, row.flat_begin, row.flat_end - row.flat_begin).copy_(piece.reshape({-1}));
  }
  return flat.view(box.extent);
}

absl::StatusOr<at::Tensor> CheckpointReader::Read(std::string_view name) const {
  const auto it = state_->sharded.find(name);
  if (it == state_->sharded.end()) return ReadStored(name);
  const at::ScalarType dtype = *ScalarTypeFromSafetensorsDtype(it->second.dtype);
  at::Tensor whole = at::empty(it->second.shape, at::TensorOptions().dtype(dtype));
  for (const ShardedTensorRows::Box& box : it->second.boxes) {
    FULCRUM_ASSIGN_OR_RETURN(const at::Tensor values, ReadBox(box, dtype));
    at::Tensor target = whole;
    for (size_t d = 0; d < box.offsets.size(); ++d) {
      target = target.narrow(static_cast<int64_t>(d), box.offsets[d], box.extent[d]);
    }
    target.copy_(values);
  }
  return whole;
}

absl::StatusOr<at::Tensor> CheckpointReader::ReadSlice(std::string_view name, int64_t dim,
                                                       int64_t start, int64_t length) const {
  FULCRUM_ASSIGN_OR_RETURN(const auto described, Describe(name));
  const auto& [dtype, shape] = described;
  if (dim < 0 || dim >= static_cast<int64_t>(shape.size()) || start < 0 || length < 0 ||
      start + length > shape[dim]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read elements [", start, ", ", start + length, ") along dimension ", dim, " of '",
        std::string(name), "', of shape [", absl::StrJoin(shape, ", "), "]"));
  }
  const auto it = state_->sharded.find(name);
  if (it == state_->sharded.end()) {
    FULCRUM_ASSIGN_OR_RETURN(const at::Tensor whole, ReadStored(name));
    return whole.narrow(dim, start, length).clone();
  }
  std::vector<int64_t> slice_shape = shape;
  slice_shape[dim] = length;
  at::Tensor slice = at::empty(slice_shape, at::TensorOptions().dtype(dtype));
  for (const ShardedTensorRows::Box& box : it->second.boxes) {
    // The overlap of the box with [start, start + length) along `dim`; no overlap: unread.
    const int64_t lo = std::max(start, box.offsets[dim]);
    const int64_t hi = std::min(start + length, box.offsets[dim] + box.extent[dim]);
    if (lo >= hi) continue;
    FULCRUM_ASSIGN_OR_RETURN(const at::Tensor values, ReadBox(box, dtype));
    at::Tensor target = slice;
    for (size_t d = 0; d < box.offsets.size(); ++d) {
      const int64_t axis = static_cast<int64_t>(d);
      target = axis == dim ? target.narrow(axis, lo - start, hi - lo)
                           : target.narrow(axis, box.offsets[d], box.extent[d]);
    }
    target.copy_(values.narrow(dim, lo - box.offsets[dim], hi - lo));
  }
  return slice;
}

absl::Status CheckpointReader::VerifyAll() const {
  std::vector<std::string> errors;
  size_t failed = 0;
  for (const auto& [name, entry] : state_->entries) {
    const absl::Status status = VerifiedBytes(name, entry).status();
    if (status.ok()) continue;
    ++failed;
    if (errors.size() < kMaxListedErrors) errors.emplace_back(status.message());
  }
  if (failed == 0) return absl::OkStatus();
  std::string message =
      absl::StrCat(failed, " of ", state_->entries.size(), " tensors in ", state_->dir,
                   " failed verification:\n  ", absl::StrJoin(errors, "\n  "));
  if (failed > errors.size())
    absl::StrAppend(&message, "\n  ... and ", failed - errors.size(), " more");
  return absl::DataLossError(message);
}

}  // namespace fulcrum::ckpt
