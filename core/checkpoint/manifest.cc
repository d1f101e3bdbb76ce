#include "core/checkpoint/manifest.h"

#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checksum.h"
#include "core/checkpoint/safetensors.h"

namespace fulcrum::ckpt {

std::string IterationDirName(int64_t iteration) {
  TORCH_CHECK(iteration >= 0, "checkpoint iteration must be non-negative, got ", iteration);
  return absl::StrFormat("iter_%07d", iteration);
}

std::optional<int64_t> ParseIterationDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "iter_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  const std::string_view digits = name.substr(kPrefix.size());
  // 18 digits always fit in int64; nobody trains for 10^18 iterations.
  if (digits.size() < 7 || digits.size() > 18) return std::nullopt;
  int64_t iteration = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    iteration = iteration * 10 + (c - '0');
  }
  // Only the canonical spelling, so that each iteration has exactly one directory name.
  if (IterationDirName(iteration) != name) return std::nullopt;
  return iteration;
}

bool IsValidShardName(std::string_view name) {
  if (name.empty() || name.size() > 128 || name.front() == '.') return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

int64_t ManifestEntry::numel() const {
  int64_t numel = 1;
  for (const int64_t extent : shape) numel *= extent;
  return numel;
}

uint64_t ManifestEntry::byte_size() const {
  return static_cast<uint64_t>(numel()) * c10::elementSize(dtype);
}

std::string ManifestChecksum(const nlohmann::json& manifest) {
  nlohmann::json copy = manifest;
  if (copy.is_object()) copy.erase(kManifestChecksumKey);
  return ChecksumToHex(Xxh3Checksum(copy.dump()));
}

nlohmann::json ManifestEntryToJson(const ManifestEntry& entry) {
  return nlohmann::json{{"file", entry.file},
                        {"dtype", *SafetensorsDtypeName(entry.dtype)},
                        {"shape", entry.shape},
                        {"xxh3", ChecksumToHex(entry.xxh3)}};
}

absl::StatusOr<TensorTable> ParseTensorTable(const nlohmann::json& table,
                                             const std::string& source) {
  if (!table.is_object()) {
    return absl::DataLossError(
        absl::StrCat(source, ": 'tensors' must be an object, found ", table.type_name()));
  }
  TensorTable entries;
  for (const auto& [name, row] : table.items()) {
    auto error = [&, name = name](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(source, ": tensor '", name, "': ", what));
    };
    if (!row.is_object()) return error("expected an object {file, dtype, shape, xxh3}");
    ManifestEntry entry;

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
    absl::StatusOr<at::ScalarType> scalar_type =
        ScalarTypeFromSafetensorsDtype(dtype->get<std::string>());
    if (!scalar_type.ok()) return error(scalar_type.status().message());
    entry.dtype = *scalar_type;

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

    entries.emplace(name, std::move(entry));
  }
  return entries;
}

}  // namespace fulcrum::ckpt
