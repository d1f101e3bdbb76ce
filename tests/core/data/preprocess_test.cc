// End-to-end tests of the fulcrum_preprocess binary (tools/preprocess_main.cc): JSONL in,
// a Megatron dataset out that IndexedDataset opens; bad input exits with status 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/data/indexed_dataset.h"
#include "core/data/tokenizer.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

const std::string kBinary = std::string(FULCRUM_BIN_DIR) + "/fulcrum_preprocess";

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr.
};

RunResult RunPreprocess(const std::string& arguments) {
  RunResult result;
  result.exit_code = fulcrum::testing::RunCommand(kBinary + " " + arguments, &result.output);
  return result;
}

class PreprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::ifstream(kBinary).is_open())
        << kBinary << " is missing; build the fulcrum_preprocess target";
    dir_ = fulcrum::testing::MakeTempDir("preprocess");
  }

  std::string dir_;
};

TEST_F(PreprocessTest, JsonlToIndexedDataset) {
  const std::string input = dir_ + "/docs.jsonl";
  std::ofstream(input) << R"({"text": "hello world", "id": 1})"
                       << "\n"
                       << "\n"  // Blank lines are skipped.
                       << R"({"text": ["one. ", "", "two"]})"
                       << "\n"
                       << R"({"text": ""})"
                       << "\n";
  const RunResult run = RunPreprocess("--input=" + input + " --output_prefix=" + dir_ +
                                      "/out --tokenizer_type=byte --log_interval=1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("processed 3 documents"));

  auto dataset = IndexedDataset::Open(dir_ + "/out_text_document");
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  const IndexedDataset& d = **dataset;
  EXPECT_EQ(d.dtype(), DType::kUInt16);
  // As Megatron: a list gives one sequence per non-empty string, eod joins the last one,
  // and the empty document keeps its index entry without a sequence.
  EXPECT_EQ(d.num_documents(), 3);
  EXPECT_EQ(std::vector<int64_t>(d.document_indices().begin(), d.document_indices().end()),
            (std::vector<int64_t>{0, 1, 3, 3}));
  const ByteTokenizer tokenizer;
  const std::vector<std::string> expected = {"hello world", "one. ", "two"};
  ASSERT_EQ(d.num_sequences(), 3);
  for (int64_t s = 0; s < 3; ++s) {
    std::vector<int64_t> tokens(d.sequence_length(s));
    d.Read(s, 0, static_cast<int64_t>(tokens.size()), tokens.data());
    EXPECT_EQ(tokenizer.Decode(tokens), expected[s]);
    EXPECT_EQ(tokens.back() == tokenizer.eod_id(), s != 1) << "sequence " << s;
  }
}

TEST_F(PreprocessTest, MalformedJsonExitsWithStatus2AndNoOutput) {
  const std::string input = dir_ + "/bad.jsonl";
  std::ofstream(input) << R"({"text": "fine"})"
                       << "\n"
                       << R"({"text": oops})"
                       << "\n";
  const RunResult run =
      RunPreprocess("--input=" + input + " --output_prefix=" + dir_ + "/out --tokenizer_type=byte");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_THAT(run.output, AllOf(HasSubstr(input + ":2"), HasSubstr("malformed JSON")));
  EXPECT_FALSE(std::ifstream(dir_ + "/out_text_document.idx").is_open());
  EXPECT_FALSE(std::ifstream(dir_ + "/out_text_document.bin").is_open());
}

TEST_F(PreprocessTest, MissingFlagsExitWithStatus2) {
  const RunResult no_input = RunPreprocess("--output_prefix=" + dir_ + "/out");
  EXPECT_EQ(no_input.exit_code, 2);
  EXPECT_THAT(no_input.output, HasSubstr("--input is required"));

  const RunResult missing_file =
      RunPreprocess("--input=" + dir_ + "/none.jsonl --output_prefix=" + dir_ + "/out");
  EXPECT_EQ(missing_file.exit_code, 2);
  EXPECT_THAT(missing_file.output, HasSubstr(dir_ + "/none.jsonl"));
}

}  // namespace
}  // namespace fulcrum::data
