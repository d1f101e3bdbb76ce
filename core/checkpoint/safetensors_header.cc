#include "core/checkpoint/safetensors_header.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/json_limits.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeSize {
  std::string_view name;
  size_t size;
};
constexpr DtypeSize kDtypeSizes[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
    {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1},
};

uint64_t DecodeLittleEndian64(const char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

// Parses one "<name>": {...} header entry; `data_size` is the size of the data buffer.
absl::StatusOr<SafetensorsHeaderEntry> ParseEntry(const std::string& path, const std::string& name,
                                                  const nlohmann::json& entry, uint64_t data_size) {
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "': ", what));
  };
  if (!entry.is_object()) {
    return error(
        absl::StrCat("expected a JSON object {dtype, shape, data_offsets}, found ", entry.dump()));
  }
  SafetensorsHeaderEntry info;
  info.name = name;

  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) return error("missing string field 'dtype'");
  info.dtype = dtype->get<std::string>();
  const size_t itemsize = SafetensorsDtypeSize(info.dtype);
  if (itemsize == 0) {
    return error(absl::StrCat("unknown dtype '", info.dtype,
                              "'; expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
  }

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) return error("missing array field 'shape'");
  // numel * itemsize, checked for overflow: a corrupt shape must not wrap around to a
  // small size that happens to match the byte range.
  uint64_t expected_bytes = itemsize;
  for (const nlohmann::json& dim : *shape) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return error(absl::StrCat("shape ", shape->dump(), " must hold non-negative integers, found ",
                                dim.dump()));
    }
    const uint64_t extent = dim.get<uint64_t>();
    if (__builtin_mul_overflow(expected_bytes, extent, &expected_bytes)) {
      return error(absl::StrCat("shape ", shape->dump(), " overflows 64 bits"));
    }
    info.shape.push_back(static_cast<int64_t>(extent));
  }

  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return error("missing field 'data_offsets': [begin, end] with non-negative integers");
  }
  info.begin = (*offsets)[0].get<uint64_t>();
  info.end = (*offsets)[1].get<uint64_t>();
  if (info.end < info.begin) {
    return error(absl::StrCat("data_offsets ", offsets->dump(), " end before they begin"));
  }
  if (info.end > data_size) {
    return error(absl::StrCat("data_offsets ", offsets->dump(), " reach past the data buffer, ",
                              "which holds only ", data_size, " bytes (file truncated?)"));
  }
  if (info.end - info.begin != expected_bytes) {
    return error(absl::StrCat("data_offsets ", offsets->dump(), " span ", info.end - info.begin,
                              " bytes but dtype ", info.dtype, " and shape ", shape->dump(),
                              " need ", expected_bytes));
  }
  return info;
}

}  // namespace

size_t SafetensorsDtypeSize(std::string_view name) {
  for (const DtypeSize& entry : kDtypeSizes) {
    if (entry.name == name) return entry.size;
  }
  return 0;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& path,
                                                         std::string_view file) {
  auto error = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": ", what));
  };
  if (file.size() < 8) {
    return error(
        absl::StrCat("file has ", file.size(), " bytes, too short for the 8-byte header length"));
  }
  const uint64_t header_size = DecodeLittleEndian64(file.data());
  if (header_size > kMaxSafetensorsHeaderBytes) {
    return error(absl::StrCat("header length field says ", header_size,
                              " bytes, more than the limit of ", kMaxSafetensorsHeaderBytes,
                              " (not a safetensors file, or a corrupt length)"));
  }
  if (header_size > file.size() - 8) {
    return error(absl::StrCat("header length field says ", header_size, " bytes but only ",
                              file.size() - 8, " bytes follow it (file truncated?)"));
  }
  SafetensorsHeader parsed;
  parsed.data_start = 8 + header_size;
  const uint64_t data_size = file.size() - parsed.data_start;

  const std::string_view text = file.substr(8, header_size);
  FULCRUM_RETURN_IF_ERROR(CheckJsonDepth(text, path));  // NOTE [JSON nesting limit]
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // Syntax, or a number beyond a double.
    return error(absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return error(absl::StrCat("header must be a JSON object, found a ", header.type_name()));
  }

  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) return error("'__metadata__' must be an object of strings");
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          return error(absl::StrCat("'__metadata__' value for '", meta_key,
                                    "' must be a string, found ", meta_value.dump()));
        }
        parsed.metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    FULCRUM_ASSIGN_OR_RETURN(SafetensorsHeaderEntry entry, ParseEntry(path, key, value, data_size));
    parsed.entries.push_back(std::move(entry));
  }

  // The ranges must tile [0, data_size): each tensor starts where the previous one ended.
  // Zero-byte tensors share their offset with a neighbour, so ties order by end, then name.
  std::vector<SafetensorsHeaderEntry>& entries = parsed.entries;
  std::sort(entries.begin(), entries.end(),
            [](const SafetensorsHeaderEntry& a, const SafetensorsHeaderEntry& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  uint64_t covered = 0;
  const SafetensorsHeaderEntry* previous = nullptr;
  for (const SafetensorsHeaderEntry& entry : entries) {
    if (entry.begin < covered) {
      return error(absl::StrCat("tensor '", entry.name, "' bytes [", entry.begin, ", ", entry.end,
                                ") overlap tensor '", previous->name, "' bytes [", previous->begin,
                                ", ", previous->end, ")"));
    }
    if (entry.begin > covered) {
      return error(absl::StrCat("data bytes [", covered, ", ", entry.begin,
                                ") belong to no tensor (gap before tensor '", entry.name, "')"));
    }
    covered = entry.end;
    previous = &entry;
  }
  if (covered != data_size) {
    return error(absl::StrCat("the tensors cover ", covered, " data bytes but the file holds ",
                              data_size, " (", data_size - covered, " trailing bytes)"));
  }
  return parsed;
}

}  // namespace fulcrum::ckpt
