#include "core/checkpoint/manifest_json.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checksum.h"
#include "core/checkpoint/safetensors_header.h"
#include "core/json_limits.h"
#include "core/status.h"

namespace fulcrum::ckpt {

namespace {

// A non-negative integer array field of `row`, or an error message.
std::optional<std::string> ReadIntArray(const nlohmann::json& row, const char* key,
                                        std::vector<int64_t>* out) {
  const auto field = row.find(key);
  if (field == row.end() || !field->is_array()) {
    return absl::StrCat("missing array field '", key, "'");
  }
  for (const nlohmann::json& v : *field) {
    // Parsed text holds non-negative integers as unsigned, a table built in memory as signed.
    const bool ok = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}
                        : v.is_number_integer() && v.get<int64_t>() >= 0;
    if (!ok) return absl::StrCat(key, " ", field->dump(), " must hold non-negative integers");
    out->push_back(v.get<int64_t>());
  }
  return std::nullopt;
}

}  // namespace

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

    if (auto message = ReadIntArray(row, "shape", &entry.shape)) return error(*message);

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

namespace {

// At most this many boxes per sharded tensor (AssemblePieces compares them pairwise).
constexpr size_t kMaxBoxesPerTensor = 4096;

// The product of `dims`, or nullopt past 2^62 (no real tensor has that many elements).
std::optional<int64_t> ElementCount(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (const int64_t d : dims) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n) || n > (int64_t{1} << 62)) return std::nullopt;
  }
  return n;
}


}  // namespace

nlohmann::json PieceRowToJson(const PieceRow& row) {
  nlohmann::json json = {
      {"of", row.of}, {"shape", row.shape}, {"offsets", row.offsets}, {"box", row.box}};
  if (row.flat) json["flat"] = {row.flat_begin, row.flat_end};
  return json;
}

absl::StatusOr<PieceRows> ParsePieceRows(const nlohmann::json& table, const std::string& source) {
  if (!table.is_object()) {
    return absl::DataLossError(absl::StrCat(source, ": '", kPiecesKey,
                                            "' must be an object, found ", table.type_name()));
  }
  PieceRows rows;
  for (const auto& [name, json] : table.items()) {
    auto error = [&, name = name](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(source, ": piece '", name, "': ", what));
    };
    if (!json.is_object()) return error("expected an object {of, shape, offsets, box[, flat]}");
    PieceRow row;
    const auto of = json.find("of");
    if (of == json.end() || !of->is_string() || of->get<std::string>().empty()) {
      return error("missing non-empty string field 'of'");
    }
    row.of = of->get<std::string>();
    for (const auto& [key, out] : {std::pair{"shape", &row.shape}, std::pair{"offsets", &row.offsets},
                                   std::pair{"box", &row.box}}) {
      if (auto message = ReadIntArray(json, key, out)) return error(*message);
    }
    if (row.offsets.size() != row.shape.size() || row.box.size() != row.shape.size()) {
      return error(absl::StrCat("'shape', 'offsets' and 'box' must have one length, got ",
                                row.shape.size(), ", ", row.offsets.size(), " and ",
                                row.box.size()));
    }
    for (size_t d = 0; d < row.shape.size(); ++d) {
      if (row.offsets[d] > row.shape[d] || row.box[d] > row.shape[d] - row.offsets[d]) {
        return error(absl::StrCat("the box at ", json["offsets"].dump(), " of extent ",
                                  json["box"].dump(), " leaves the shape ",
                                  json["shape"].dump(), " along dimension ", d));
      }
    }
    const std::optional<int64_t> whole = ElementCount(row.shape);
    const std::optional<int64_t> volume = ElementCount(row.box);
    if (!whole.has_value() || !volume.has_value()) return error("the shape is too large");
    row.flat_begin = 0;
    row.flat_end = *volume;
    if (const auto flat = json.find("flat"); flat != json.end()) {
      std::vector<int64_t> range;
      if (auto message = ReadIntArray(json, "flat", &range)) return error(*message);
      if (range.size() != 2 || range[0] >= range[1] || range[1] > *volume) {
        return error(absl::StrCat("'flat' ", flat->dump(), " must be [b, e) with 0 <= b < e <= ",
                                  *volume, " (the box's elements)"));
      }
      row.flat = true;
      row.flat_begin = range[0];
      row.flat_end = range[1];
    }
    rows.emplace(name, std::move(row));
  }
  return rows;
}

absl::StatusOr<ShardedTensorTable> AssemblePieces(
    const PieceRows& pieces, const std::map<std::string, TensorRow, std::less<>>& tensors,
    const std::string& source) {
  ShardedTensorTable table;
  // Each whole tensor's boxes by (offsets, extent), to find a piece's box in log time.
  std::map<std::string, std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, size_t>,
           std::less<>>
      box_index;
  for (const auto& entry : pieces) {
    const std::string& stored = entry.first;
    const PieceRow& row = entry.second;
    auto error = [&](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(source, ": piece '", stored, "' of '", row.of,
                                              "': ", what));
    };
    const auto tensor = tensors.find(stored);
    if (tensor == tensors.end()) return error("no stored tensor of that name");
    const std::vector<int64_t> stored_shape =
        row.flat ? std::vector<int64_t>{row.flat_end - row.flat_begin} : row.box;
    if (tensor->second.shape != stored_shape) {
      return error(absl::StrCat("stored as shape [", absl::StrJoin(tensor->second.shape, ", "),
                                "] but the piece is [", absl::StrJoin(stored_shape, ", "), "]"));
    }
    if (tensors.count(row.of) > 0) {
      return error("the whole tensor is also stored whole");
    }
    ShardedTensorRows& whole = table[row.of];
    if (whole.boxes.empty()) {
      whole.dtype = tensor->second.dtype;
      whole.shape = row.shape;
    } else if (whole.dtype != tensor->second.dtype || whole.shape != row.shape) {
      return error(absl::StrCat("its dtype ", tensor->second.dtype, " or whole shape [",
                                absl::StrJoin(row.shape, ", "), "] differs from another piece's (",
                                whole.dtype, " [", absl::StrJoin(whole.shape, ", "), "])"));
    }
    auto [where, added] =
        box_index[row.of].emplace(std::pair{row.offsets, row.box}, whole.boxes.size());
    if (added) {
      // The disjointness check below compares boxes pairwise: bound it (a real layout
      // cuts a tensor into a box per tensor-parallel rank).
      if (whole.boxes.size() >= kMaxBoxesPerTensor) {
        return error(absl::StrCat("the whole tensor is cut into more than ", kMaxBoxesPerTensor,
                                  " boxes"));
      }
      whole.boxes.push_back({row.offsets, row.box, {}});
    }
    whole.boxes[where->second].pieces.push_back(stored);
  }
  for (auto& [name, whole] : table) {
    auto error = [&, name = name](absl::string_view what) {
      return absl::DataLossError(absl::StrCat(source, ": sharded tensor '", name, "': ", what));
    };
    // Disjoint boxes whose volumes add up to the whole cover it exactly.
    int64_t covered = 0;
    for (size_t i = 0; i < whole.boxes.size(); ++i) {
      const ShardedTensorRows::Box& a = whole.boxes[i];
      if (__builtin_add_overflow(covered, *ElementCount(a.extent), &covered)) {
        return error("its boxes hold more elements than any tensor has");
      }
      for (size_t j = 0; j < i; ++j) {
        const ShardedTensorRows::Box& b = whole.boxes[j];
        bool overlap = true;
        for (size_t d = 0; d < a.offsets.size() && overlap; ++d) {
          overlap = a.offsets[d] < b.offsets[d] + b.extent[d] &&
                    b.offsets[d] < a.offsets[d] + a.extent[d];
        }
        if (overlap && *ElementCount(a.extent) > 0 && *ElementCount(b.extent) > 0) {
          return error(absl::StrCat("the boxes at [", absl::StrJoin(a.offsets, ", "), "] and [",
                                    absl::StrJoin(b.offsets, ", "), "] overlap"));
        }
      }
      // The flat ranges of a box, in order, must run 0, ..., volume without gap or overlap.
      std::vector<std::string>& names = whole.boxes[i].pieces;
      std::sort(names.begin(), names.end(), [&](const std::string& x, const std::string& y) {
        return pieces.at(x).flat_begin < pieces.at(y).flat_begin;
      });
      int64_t next = 0;
      for (const std::string& piece : names) {
        const PieceRow& row = pieces.at(piece);
        if (row.flat_begin != next) {
          return error(absl::StrCat("the box at [", absl::StrJoin(a.offsets, ", "), "] has ",
                                    row.flat_begin > next ? "no piece for" : "two pieces of",
                                    " its elements from ", std::min(next, row.flat_begin),
                                    " (at piece '", piece, "')"));
        }
        next = row.flat_end;
      }
      if (next != *ElementCount(a.extent)) {
        return error(absl::StrCat("the box at [", absl::StrJoin(a.offsets, ", "),
                                  "] has no piece for its elements from ", next));
      }
    }
    if (covered != *ElementCount(whole.shape)) {
      return error(absl::StrCat("its pieces hold ", covered, " of its ",
                                *ElementCount(whole.shape), " elements (a piece is missing)"));
    }
  }
  return table;
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
  if (const auto pieces = manifest.find(kPiecesKey); pieces != manifest.end()) {
    if (parsed.format_version < 3) {
      return error(absl::StrCat("'", kPiecesKey, "' in a manifest of format_version ",
                                parsed.format_version, " (sharded tensors came with 3)"));
    }
    FULCRUM_ASSIGN_OR_RETURN(parsed.pieces, ParsePieceRows(*pieces, path));
    FULCRUM_ASSIGN_OR_RETURN(parsed.sharded, AssemblePieces(parsed.pieces, parsed.tensors, path));
  }
  return parsed;
}

}  // namespace fulcrum::ckpt
