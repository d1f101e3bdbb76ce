#include "core/data/default_corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fulcrum::data {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return std::move(contents).str();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> DefaultCorpusFiles(const std::string& dir) {
  std::error_code error;
  fs::directory_iterator it(dir, error);
  if (error) {
    return absl::NotFoundError(absl::StrCat(
        "default corpus: cannot read the folder ", dir, ": ", error.message(),
        " (it comes with Debian's base-files package; without it, preprocess a corpus of your "
        "own with fulcrum_preprocess)"));
  }
  std::vector<std::string> files;
  for (const fs::directory_entry& entry : it) {
    // symlink_status: a link to a license (GPL -> GPL-3) would repeat its target's text.
    if (fs::is_regular_file(entry.symlink_status(error))) files.push_back(entry.path().string());
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat("default corpus: ", dir,
                                            " holds no regular files (expected the license "
                                            "texts of Debian's base-files package)"));
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string_view> SplitParagraphs(std::string_view text) {
  std::vector<std::string_view> paragraphs;
  size_t pos = 0;
  while (pos < text.size()) {
    // Skip blank lines (empty or whitespace only) before the paragraph.
    while (pos < text.size()) {
      size_t eol = text.find('\n', pos);
      if (eol == std::string_view::npos) eol = text.size();
      if (text.substr(pos, eol - pos).find_first_not_of(" \t\r\f\v") != std::string_view::npos) break;
      pos = eol + 1;
    }
    if (pos >= text.size()) break;
    // The paragraph runs up to the next blank line.
    size_t end = pos;
    while (end < text.size()) {
      size_t eol = text.find('\n', end);
      if (eol == std::string_view::npos) eol = text.size();
      if (text.substr(end, eol - end).find_first_not_of(" \t\r\f\v") == std::string_view::npos) break;
      end = eol + 1;
    }
    end = std::min(end, text.size());
    paragraphs.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return paragraphs;
}

absl::StatusOr<std::shared_ptr<IndexedDataset>> BuildDefaultCorpus(const Tokenizer& tokenizer,
                                                                   const std::string& dir) {
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> files, DefaultCorpusFiles(dir));
  std::vector<int64_t> tokens;
  std::vector<int32_t> sequence_lengths;
  std::vector<int64_t> document_indices = {0};
  for (const std::string& file : files) {
    FULCRUM_ASSIGN_OR_RETURN(const std::string text, ReadFile(file));
    for (std::string_view paragraph : SplitParagraphs(text)) {
      std::vector<int64_t> ids = tokenizer.Encode(paragraph);
      ids.push_back(tokenizer.eod_id());
      if (ids.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "default corpus: a paragraph of ", file, " has more tokens than a sequence can hold"));
      }
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      sequence_lengths.push_back(static_cast<int32_t>(ids.size()));
      document_indices.push_back(static_cast<int64_t>(sequence_lengths.size()));
    }
  }
  return IndexedDataset::FromMemory(absl::StrCat("default corpus ", dir), std::move(tokens),
                                    std::move(sequence_lengths), std::move(document_indices));
}

std::string DefaultCorpusDescription(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> files = DefaultCorpusFiles(dir);
  if (!files.ok()) return std::string(files.status().message());
  uintmax_t bytes = 0;
  for (const std::string& file : *files) {
    std::error_code error;
    const uintmax_t size = fs::file_size(file, error);
    if (!error) bytes += size;
  }
  return absl::StrCat(files->size(), " files, ", bytes, " bytes from ", dir);
}

}  // namespace fulcrum::data
