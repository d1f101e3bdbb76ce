#include "core/json_limits.h"

#include "absl/strings/str_cat.h"

namespace fulcrum {

absl::Status CheckJsonDepth(std::string_view text, absl::string_view source, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // The escaped character cannot end the string.
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return absl::DataLossError(absl::StrCat(
            source, ": JSON nests more than ", max_depth, " levels deep (at byte ", i,
            "); no Fulcrum file does, so the file is damaged or not what it claims to be"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
