// Limits on the JSON files Fulcrum reads (checkpoint manifests, shard indexes, safetensors
// headers), checked on the text before nlohmann_json parses it.
//
// NOTE [JSON nesting limit]
// nlohmann_json parses without recursion, but copying, comparing and printing a value
// recurse once per level: a file of a million '[' parses fine and then overflows the stack
// when its manifest checksum copies it, or when an error message prints it. Fulcrum's own
// files nest a few levels deep, so deeper text is refused as damaged before it is parsed.
//
// NOTE [JSON integers]
// nlohmann_json's get<Integer>() converts a JSON float by a plain cast, which is undefined
// behaviour past the integer's range (a load trace with 1e54 where a byte count belongs:
// found by tests/fuzz load_trace under UBSan), and narrows a large integer silently.
// JsonInteger accepts only a JSON integer that fits.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fulcrum {

/// The deepest nesting of arrays and objects accepted in a JSON file we read.
inline constexpr int kMaxJsonDepth = 64;

/// OK when `text` nests arrays and objects at most `max_depth` deep (brackets inside
/// strings do not count; malformed text is left for the parser to report), else
/// DataLoss "<source>: JSON nests more than <max_depth> levels deep ...".
absl::Status CheckJsonDepth(std::string_view text, absl::string_view source,
                            int max_depth = kMaxJsonDepth);

/// `value` as a T: a JSON integer within T's range (NOTE [JSON integers]); InvalidArgument
/// saying what it is otherwise.
template <typename T>
absl::StatusOr<T> JsonInteger(const nlohmann::json& value) {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
  if (value.is_number_unsigned()) {
    if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(value.dump(), " is out of range"));
    }
    return static_cast<T>(value.get<uint64_t>());
  }
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(value.dump(), " is not an integer"));
  }
  const int64_t v = value.get<int64_t>();
  if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(value.dump(), " is out of range"));
  }
  return static_cast<T>(v);
}

}  // namespace fulcrum
