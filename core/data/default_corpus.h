// A small real-English corpus that needs no download: the license texts every Debian system
// ships in /usr/share/common-licenses (package base-files, which is Essential). Used when a
// run names no corpus of its own, so demos and tests train on text rather than random tokens.
// Nothing from those files is copied into this repository; they are read at run time.
//
// The corpus is the regular files of the folder (symlinks such as GPL -> GPL-3 are skipped
// so no text appears twice) sorted by name. Each paragraph (text between blank lines) is one
// document, tokenized and followed by the tokenizer's end-of-document id: a few thousand
// documents, so the default train/valid/test split (969,30,1) gives every split some.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data/indexed_dataset.h"
#include "core/data/tokenizer.h"

namespace fulcrum::data {

/// Where the default corpus is read from.
inline constexpr char kDefaultCorpusDir[] = "/usr/share/common-licenses";

/// The corpus files of `dir` (regular files only, sorted by name, full paths). Fails when
/// the folder is missing, unreadable or holds no regular file.
absl::StatusOr<std::vector<std::string>> DefaultCorpusFiles(
    const std::string& dir = kDefaultCorpusDir);

/// Tokenizes the corpus files of `dir` into an in-memory dataset: one sequence and one
/// document per paragraph, each ending with `tokenizer.eod_id()`.
/// The paragraphs of `text`: maximal runs of non-blank lines (a blank line is empty or
/// whitespace only), each with its line breaks except the last one's trailing newline kept.
std::vector<std::string_view> SplitParagraphs(std::string_view text);

absl::StatusOr<std::shared_ptr<IndexedDataset>> BuildDefaultCorpus(
    const Tokenizer& tokenizer, const std::string& dir = kDefaultCorpusDir);

/// One line for logs: "17 files, 263470 bytes from /usr/share/common-licenses", or why
/// the corpus is unavailable.
std::string DefaultCorpusDescription(const std::string& dir = kDefaultCorpusDir);

}  // namespace fulcrum::data
