#include "core/checkpoint/manifest_json.h"

#include <limits>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/checkpoint/checksum.h"
#include "core/checkpoint/safetensors_header.h"
#include "core/json_limits.h"
#include "core/status.h"

namespace fulcrum::ckpt {

bool IsValidShardName(std::string_view name) {
  if (name.empty() || name.size() > 128 || name.front() == '.') return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

std::string ManifestChecksum(const nlohmann::json& manifest) {
  nlohmann::json copy = manifest;
  if (copy.is_object()) copy.erase(kManifestChecksumKey);
  return ChecksumToHex(Xxh3Checksum(copy.dump()));
}

absl::StatusOr<std::map<std::string, TensorRow, std::less<>>> ParseTensorRows(
    const nlohmann::json& table, const std::string& source) {
  if (!table.is_object()) {
    return absl::DataLossError(
        absl::StrCat(source, ": 'tensors' must be an object, found ", table.type_name()));
  }
  std::map<std::string, TensorRow, std::less<>> rows;
  for (const auto& [name, row] : table.items()) {
    auto error = [&, name = name](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(source, ": tensor '", name, "': ", what));
    };
    if (!row.is_object()) return error("expected an object {file, dtype, shape, xxh3}");
    TensorRow entry;

    const auto file = row.find("file");
    if (file == row.end() || !file->is_string()) return error("missing string field 'file'");
    entry.file = file->get<std::string>();
    if (!absl::EndsWith(entry.file, kSafetensorsSuffix) ||
        !IsValidShardName(
            entry.file.substr(0, entry.file.size() - (sizeof(kSafetensorsSuffix) - 1)))) {
      return error(
          absl::StrCat("file '", entry.file, "' is not a plain <shard>.safetensors file name"));
    }

    const auto dtype = row.find("dtype");
    if (dtype == row.end() || !dtype->is_string()) return error("missing string field 'dtype'");
    entry.dtype = dtype->get<std::string>();
    if (SafetensorsDtypeSize(entry.dtype) == 0) {
      return error(absl::StrCat("unknown dtype '", entry.dtype,
                                "'; expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
    }

    const auto shape = row.find("shape");
    if (shape == row.end() || !shape->is_array()) return error("missing array field 'shape'");
    for (const nlohmann::json& dim : *shape) {
      if (!dim.is_number_unsigned() ||
          dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return error(absl::StrCat("shape ", shape->dump(), " must hold non-negative integers"));
      }
      entry.shape.push_back(dim.get<int64_t>());
    }

    const auto xxh3 = row.find("xxh3");
    std::optional<uint64_t> checksum;
    if (xxh3 != row.end() && xxh3->is_string())
      checksum = ChecksumFromHex(xxh3->get<std::string>());
    if (!checksum.has_value()) return error("field 'xxh3' must be 16 hex digits");
    entry.xxh3 = *checksum;

    rows.emplace(name, std::move(entry));
  }
  return rows;
}

absl::StatusOr<ManifestJson> ParseManifestJson(std::string_view text, const std::string& path) {
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  // Copying it for its checksum recurses per level (NOTE [JSON nesting limit]).
  FULCRUM_RETURN_IF_ERROR(CheckJsonDepth(text, path));
  ManifestJson parsed;
  parsed.json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json& manifest = parsed.json;
  if (manifest.is_discarded()) return error("not valid JSON");
  if (!manifest.is_object()) return error("expected a JSON object");
  const auto version = manifest.find("format_version");
  if (version == manifest.end() || !version->is_number_integer()) {
    return error("missing integer field 'format_version'");
  }
  // Compared as written: an unsigned value past int64 must not wrap around to an old one.
  const bool newer = version->is_number_unsigned()
                         ? version->get<uint64_t>() > uint64_t{kManifestFormatVersion}
                         : version->get<int64_t>() > kManifestFormatVersion;
  if (newer) {
    return error(absl::StrCat("format_version ", version->dump(),
                              " is newer than this build understands (", kManifestFormatVersion,
                              ")"));
  }
  parsed.format_version = version->get<int64_t>();
  if (parsed.format_version < 1) {
    return error(absl::StrCat("format_version ", parsed.format_version,
                              " is not a format version (1 or more)"));
  }
  // NOTE [manifest checksum]
  if (parsed.format_version >= 2) {
    const auto checksum = manifest.find(kManifestChecksumKey);
    if (checksum == manifest.end() || !checksum->is_string()) {
      return error(absl::StrCat("missing string field '", kManifestChecksumKey,
                                "' (the manifest's own checksum)"));
    }
    const std::string actual = ManifestChecksum(manifest);
    if (checksum->get<std::string>() != actual) {
      return error(absl::StrCat("the manifest was changed after it was written: its fields hash "
                                "to ", actual, " but '", kManifestChecksumKey, "' records ",
                                checksum->get<std::string>(),
                                " (an edited or damaged manifest is not trusted)"));
    }
    parsed.verified = true;
  }
  const auto iteration = manifest.find("iteration");
  if (iteration == manifest.end() || !iteration->is_number_integer()) {
    return error("missing integer field 'iteration'");
  }
  parsed.iteration = iteration->get<int64_t>();
  const auto files = manifest.find("files");
  if (files == manifest.end() || !files->is_object()) return error("missing object 'files'");
  for (const auto& [file_name, file_info] : files->items()) {
    if (file_name.empty() || file_name[0] == '.' || file_name.find('/') != std::string::npos) {
      return error(absl::StrCat("'files' entry '", file_name, "' is not a plain file name"));
    }
  }
  const auto tensors = manifest.find("tensors");
  if (tensors == manifest.end()) return error("missing object 'tensors'");
  FULCRUM_ASSIGN_OR_RETURN(parsed.tensors, ParseTensorRows(*tensors, path));
  return parsed;
}

}  // namespace fulcrum::ckpt
