// Limits on the JSON files Fulcrum reads (checkpoint manifests, shard indexes, safetensors
// headers), checked on the text before nlohmann_json parses it.
//
// NOTE [JSON nesting limit]
// nlohmann_json parses without recursion, but copying, comparing and printing a value
// recurse once per level: a file of a million '[' parses fine and then overflows the stack
// when its manifest checksum copies it, or when an error message prints it. Fulcrum's own
// files nest a few levels deep, so deeper text is refused as damaged before it is parsed.
//
// Thread-safety: pure functions.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace fulcrum {

/// The deepest nesting of arrays and objects accepted in a JSON file we read.
inline constexpr int kMaxJsonDepth = 64;

/// OK when `text` nests arrays and objects at most `max_depth` deep (brackets inside
/// strings do not count; malformed text is left for the parser to report), else
/// DataLoss "<source>: JSON nests more than <max_depth> levels deep ...".
absl::Status CheckJsonDepth(std::string_view text, absl::string_view source,
                            int max_depth = kMaxJsonDepth);

}  // namespace fulcrum
