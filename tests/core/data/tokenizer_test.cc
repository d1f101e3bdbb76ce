// Tests for core/data/tokenizer: byte round trips, sentencepiece training (reproducible,
// exact round trip thanks to byte fallback and identity normalisation), and the factory.
#include "core/data/tokenizer.h"
#include "tests/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fulcrum::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TokenizerTempDir() { return fulcrum::testing::MakeTempDir("tokenizer"); }

// A few hundred lines of English-like text, generated so the test needs no data files.
std::string WriteTrainingText(const std::string& dir) {
  const std::vector<std::string> subjects = {"The model",     "A pipeline stage", "Each layer",
                                             "The optimizer", "Every rank",       "The scheduler"};
  const std::vector<std::string> verbs = {"moves", "computes", "balances", "stores",
                                          "sends", "receives", "measures"};
  const std::vector<std::string> objects = {"the gradients", "its parameters", "the activations",
                                            "a checkpoint",  "the loss",       "twelve tokens"};
  const std::string path = dir + "/train.txt";
  std::ofstream out(path);
  for (int i = 0; i < 600; ++i) {
    out << subjects[i % subjects.size()] << " " << verbs[(i / 3) % verbs.size()] << " "
        << objects[(i / 7) % objects.size()] << " in step " << i << ".\n";
    if (i % 50 == 0) out << "\n";
  }
  return path;
}

TEST(ByteTokenizerTest, RoundTripsAnyBytes) {
  const ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.vocab_size(), 257);
  EXPECT_EQ(tokenizer.eod_id(), 256);
  EXPECT_EQ(tokenizer.name(), "byte");
  const std::string text =
      std::string("h\xc3\xa9llo \xf0\x9f\x99\x82\n", 11) + std::string(1, '\0') + "\xff";
  const std::vector<int64_t> ids = tokenizer.Encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'h');
  EXPECT_EQ(ids[1], 0xc3);
  EXPECT_EQ(ids.back(), 0xff);
  EXPECT_EQ(tokenizer.Decode(ids), text);

  std::vector<int64_t> with_eod = ids;
  with_eod.push_back(tokenizer.eod_id());
  EXPECT_EQ(tokenizer.Decode(with_eod), text);  // eod decodes to nothing.
  const std::vector<int64_t> out_of_range = {257};
  EXPECT_THROW(tokenizer.Decode(out_of_range), c10::Error);
}

TEST(SentencePieceTokenizerTest, TrainLoadEncodeDecode) {
  const std::string dir = TokenizerTempDir();
  const std::string text_file = WriteTrainingText(dir);
  ASSERT_TRUE(SentencePieceTokenizer::Train({text_file}, 400, dir + "/spm").ok());

  auto tokenizer = SentencePieceTokenizer::Load(dir + "/spm.model");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->vocab_size(), 400);
  EXPECT_EQ((*tokenizer)->eod_id(), 2);
  EXPECT_THAT((*tokenizer)->name(), HasSubstr("spm.model"));

  // Seen words compress well; unseen characters fall back to bytes; all round-trips exactly.
  const std::string seen = "The optimizer balances the gradients in step 12.";
  EXPECT_LT((*tokenizer)->Encode(seen).size(), seen.size() / 2);
  for (const std::string& text :
       {seen, std::string("  two  spaces,\ttabs\nand newlines\n"),
        std::string(u8"unseen: ünïcödé 日本 🙂"), std::string("")}) {
    const std::vector<int64_t> ids = (*tokenizer)->Encode(text);
    for (int64_t id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 400);
      EXPECT_NE(id, 0) << "no <unk> with byte fallback";
    }
    EXPECT_EQ((*tokenizer)->Decode(ids), text);
    std::vector<int64_t> with_eod = ids;
    with_eod.push_back((*tokenizer)->eod_id());
    EXPECT_EQ((*tokenizer)->Decode(with_eod), text);
  }
}

TEST(SentencePieceTokenizerTest, TrainingIsReproducible) {
  const std::string dir = TokenizerTempDir();
  const std::string text_file = WriteTrainingText(dir);
  ASSERT_TRUE(SentencePieceTokenizer::Train({text_file}, 350, dir + "/a").ok());
  ASSERT_TRUE(SentencePieceTokenizer::Train({text_file}, 350, dir + "/b").ok());
  // The .model files differ only in the model_prefix they record; the pieces and their
  // scores (the .vocab listing) must be identical.
  const std::string a = testing::ReadFileBytes(dir + "/a.vocab");
  EXPECT_EQ(std::count(a.begin(), a.end(), '\n'), 350);
  EXPECT_EQ(a, testing::ReadFileBytes(dir + "/b.vocab"));
}

TEST(SentencePieceTokenizerTest, TrainErrorsNameTheProblem) {
  const std::string dir = TokenizerTempDir();
  const std::string text_file = WriteTrainingText(dir);
  absl::Status status = SentencePieceTokenizer::Train({text_file}, 100, dir + "/small");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("--vocab_size=100"), HasSubstr("259")));

  status = SentencePieceTokenizer::Train({dir + "/missing.txt"}, 400, dir + "/m");
  EXPECT_THAT(status.message(), HasSubstr(dir + "/missing.txt"));

  // More pieces than the text can fill: sentencepiece's own message, with our context.
  status = SentencePieceTokenizer::Train({text_file}, 100000, dir + "/huge");
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), AllOf(HasSubstr("--vocab_size=100000"), HasSubstr("too high")));
}

TEST(SentencePieceTokenizerTest, LoadErrors) {
  const std::string dir = TokenizerTempDir();
  auto missing = SentencePieceTokenizer::Load(dir + "/none.model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir + "/none.model"));

  std::ofstream(dir + "/junk.model") << "not a model";
  auto junk = SentencePieceTokenizer::Load(dir + "/junk.model");
  EXPECT_FALSE(junk.ok());
  EXPECT_THAT(junk.status().message(), HasSubstr(dir + "/junk.model"));
}

TEST(MakeTokenizerTest, ChoosesByName) {
  auto byte = MakeTokenizer("byte", "");
  ASSERT_TRUE(byte.ok());
  EXPECT_EQ((*byte)->name(), "byte");

  EXPECT_THAT(MakeTokenizer("gpt2", "").status().message(), HasSubstr("--tokenizer_type=gpt2"));
  EXPECT_THAT(MakeTokenizer("byte", "x.model").status().message(),
              HasSubstr("--tokenizer_model=x.model"));
  EXPECT_THAT(MakeTokenizer("sentencepiece", "").status().message(),
              HasSubstr("--tokenizer_model"));

  const std::string dir = TokenizerTempDir();
  ASSERT_TRUE(SentencePieceTokenizer::Train({WriteTrainingText(dir)}, 300, dir + "/t").ok());
  auto spm = MakeTokenizer("sentencepiece", dir + "/t.model");
  ASSERT_TRUE(spm.ok()) << spm.status();
  EXPECT_EQ((*spm)->vocab_size(), 300);
}

}  // namespace
}  // namespace fulcrum::data
