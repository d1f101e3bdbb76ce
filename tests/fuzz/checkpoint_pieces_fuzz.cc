// Fuzzes the sharded-tensor half of a checkpoint manifest (NOTE [sharded checkpoints] in
// core/checkpoint/manifest_json.h) directly, without the manifest's checksum in the way:
// the input is a JSON object {"tensors": {...}, "pieces": {...}} that ParseTensorRows,
// ParsePieceRows and AssemblePieces read. Whatever they accept must tile: every piece a
// stored tensor of its box's (or flat range's) shape, one dtype per whole tensor, the boxes'
// elements adding up to the whole's.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/checkpoint/manifest_json.h"
#include "core/json_limits.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

int64_t Count(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (const int64_t d : dims) n *= d;  // bounded by ParsePieceRows (2^62)
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum::ckpt;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (!fulcrum::CheckJsonDepth(text, "input").ok()) return 0;
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object() || !json.contains("tensors") ||
      !json.contains("pieces")) {
    return 0;
  }
  const auto tensors = ParseTensorRows(json["tensors"], "input");
  if (!tensors.ok()) return 0;
  const auto pieces = ParsePieceRows(json["pieces"], "input");
  if (!pieces.ok()) {
    FULCRUM_FUZZ_CHECK(!pieces.status().message().empty());
    return 0;
  }
  for (const auto& [stored, row] : *pieces) {
    FULCRUM_FUZZ_CHECK(row.flat_begin >= 0 && row.flat_begin <= row.flat_end);
    FULCRUM_FUZZ_CHECK(row.flat_end <= Count(row.box));
    // A row written back parses to itself.
    const auto again = ParsePieceRows(nlohmann::json{{stored, PieceRowToJson(row)}}, "again");
    FULCRUM_FUZZ_CHECK(again.ok() && again->at(stored).of == row.of &&
                       again->at(stored).flat_end == row.flat_end);
  }
  const auto table = AssemblePieces(*pieces, *tensors, "input");
  if (!table.ok()) {
    FULCRUM_FUZZ_CHECK(!table.status().message().empty());
    return 0;
  }
  for (const auto& [name, whole] : *table) {
    FULCRUM_FUZZ_CHECK(tensors->count(name) == 0);
    int64_t held = 0;
    for (const auto& box : whole.boxes) {
      held += Count(box.extent);
      int64_t next = 0;
      for (const std::string& stored : box.pieces) {
        const PieceRow& row = pieces->at(stored);
        FULCRUM_FUZZ_CHECK(tensors->at(stored).dtype == whole.dtype);
        FULCRUM_FUZZ_CHECK(row.flat_begin == next);
        next = row.flat_end;
      }
      FULCRUM_FUZZ_CHECK(next == Count(box.extent));
    }
    FULCRUM_FUZZ_CHECK(held == Count(whole.shape));
  }
  return 0;
}
