// Tests for core/data/default_corpus: the Debian license texts as a ready-made corpus.
#include "core/data/default_corpus.h"
#include "tests/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fulcrum::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(DefaultCorpusTest, FilesAreSortedRegularFilesWithoutSymlinks) {
  auto files = DefaultCorpusFiles();
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_TRUE(std::is_sorted(files->begin(), files->end()));
  for (const std::string& file : *files) {
    EXPECT_FALSE(std::filesystem::is_symlink(file)) << file;
    EXPECT_TRUE(std::filesystem::is_regular_file(file)) << file;
  }
  // GPL is a link to GPL-3 on Debian: only the target is a document.
  if (std::filesystem::is_symlink(std::string(kDefaultCorpusDir) + "/GPL")) {
    EXPECT_EQ(std::count(files->begin(), files->end(), std::string(kDefaultCorpusDir) + "/GPL"), 0);
  }
}

TEST(DefaultCorpusTest, SplitsParagraphsOnBlankLines) {
  const std::string text = "  \n\nFirst line\nsecond line\n\n \t \nThird\n\n\nlast, no newline";
  std::vector<std::string_view> paragraphs = SplitParagraphs(text);
  ASSERT_EQ(paragraphs.size(), 3u);
  EXPECT_EQ(paragraphs[0], "First line\nsecond line\n");
  EXPECT_EQ(paragraphs[1], "Third\n");
  EXPECT_EQ(paragraphs[2], "last, no newline");
  EXPECT_TRUE(SplitParagraphs("\n \n\t\n").empty());
}

TEST(DefaultCorpusTest, BuildsOneDocumentPerParagraph) {
  const ByteTokenizer tokenizer;
  auto corpus = BuildDefaultCorpus(tokenizer);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  auto files = DefaultCorpusFiles();
  ASSERT_TRUE(files.ok());
  const IndexedDataset& dataset = **corpus;

  // The documents are exactly the paragraphs of the files in order, each followed by eod.
  int64_t document = 0;
  for (const std::string& file : *files) {
    std::ifstream in(file, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (std::string_view paragraph : SplitParagraphs(text)) {
      ASSERT_LT(document, dataset.num_sequences());
      std::vector<int64_t> tokens(dataset.sequence_length(document));
      dataset.Read(document, 0, static_cast<int64_t>(tokens.size()), tokens.data());
      ASSERT_EQ(tokens.size(), paragraph.size() + 1) << file;
      EXPECT_EQ(tokens.back(), tokenizer.eod_id());
      tokens.pop_back();
      EXPECT_EQ(tokenizer.Decode(tokens), paragraph);
      ++document;
    }
  }
  EXPECT_EQ(dataset.num_sequences(), document);
  EXPECT_EQ(dataset.num_documents(), document);
  EXPECT_GT(document, 500) << "enough documents for every split of 969,30,1";
  EXPECT_GT(dataset.num_tokens(), 100 * 1000);

  EXPECT_THAT(DefaultCorpusDescription(),
              AllOf(HasSubstr(std::to_string(files->size()) + " files"), HasSubstr(kDefaultCorpusDir)));
}

TEST(DefaultCorpusTest, MissingOrEmptyFolderIsAnError) {
  const ByteTokenizer tokenizer;
  auto missing = BuildDefaultCorpus(tokenizer, "/nonexistent/licenses");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/licenses"));

  const std::string empty = fulcrum::testing::MakeTempDir("corpus");
  auto none = BuildDefaultCorpus(tokenizer, empty);
  EXPECT_THAT(none.status().message(), AllOf(HasSubstr(empty), HasSubstr("no regular files")));
  EXPECT_THAT(DefaultCorpusDescription(empty), HasSubstr("no regular files"));
}

}  // namespace
}  // namespace fulcrum::data
