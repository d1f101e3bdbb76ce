// Where fulcrum_train's --timeline goes on after a live shrink (recipes/elastic.h): a pure
// rule on the path, header-only so that tests/recipes can check it without the binary.
#pragma once

#include <string>

namespace fulcrum {

/// `path` with ".ppN" (N = `num_stages`) before the extension of its file name
/// (run.json → run.pp2.json), or at the end when the file name has none (a dot in a
/// directory name is no extension); empty stays empty (no timeline).
inline std::string TimelinePathAfterShrink(const std::string& path, int num_stages) {
  if (path.empty()) return path;
  const std::string suffix = ".pp" + std::to_string(num_stages);
  const size_t dot = path.rfind('.');
  const size_t slash = path.rfind('/');
  const size_t name_start = slash == std::string::npos ? 0 : slash + 1;
  if (dot == std::string::npos || dot < name_start) return path + suffix;
  return path.substr(0, dot) + suffix + path.substr(dot);
}

}  // namespace fulcrum
