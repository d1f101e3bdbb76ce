#include "core/checkpoint/manifest.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checksum.h"
#include "core/checkpoint/safetensors.h"
#include "core/status.h"

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

int64_t ManifestEntry::numel() const {
  int64_t numel = 1;
  for (const int64_t extent : shape) numel *= extent;
  return numel;
}

uint64_t ManifestEntry::byte_size() const {
  return static_cast<uint64_t>(numel()) * c10::elementSize(dtype);
}

nlohmann::json ManifestEntryToJson(const ManifestEntry& entry) {
  return nlohmann::json{{"file", entry.file},
                        {"dtype", *SafetensorsDtypeName(entry.dtype)},
                        {"shape", entry.shape},
                        {"xxh3", ChecksumToHex(entry.xxh3)}};
}

TensorTable ToTensorTable(std::map<std::string, TensorRow, std::less<>> rows) {
  TensorTable entries;
  for (auto& [name, row] : rows) {
    ManifestEntry entry;
    entry.file = std::move(row.file);
    // ParseTensorRows accepted the name, and the two dtype tables agree (a test checks).
    entry.dtype = *ScalarTypeFromSafetensorsDtype(row.dtype);
    entry.shape = std::move(row.shape);
    entry.xxh3 = row.xxh3;
    entries.emplace(name, std::move(entry));
  }
  return entries;
}

absl::StatusOr<TensorTable> ParseTensorTable(const nlohmann::json& table,
                                             const std::string& source) {
  FULCRUM_ASSIGN_OR_RETURN(auto rows, ParseTensorRows(table, source));
  return ToTensorTable(std::move(rows));
}

}  // namespace fulcrum::ckpt
