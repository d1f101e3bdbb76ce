// Tests for core/data/indexed_dataset: byte-exact Megatron .idx/.bin layout, round trips,
// and a clear error (naming the file) for every kind of corruption.
#include "core/data/indexed_dataset.h"
#include "tests/temp_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fulcrum::data {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string IndexedTempDir() { return fulcrum::testing::MakeTempDir("indexed"); }

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Two documents: {[1, 2, 3], [4]} and {[65535, 0]}, as uint16.
void WriteSmallDataset(const std::string& prefix) {
  auto writer = IndexedDatasetWriter::Create(prefix, DType::kUInt16);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::vector<int64_t> a = {1, 2, 3}, b = {4}, c = {65535, 0};
  ASSERT_TRUE((*writer)->AddSequence(a).ok());
  ASSERT_TRUE((*writer)->AddSequence(b).ok());
  (*writer)->EndDocument();
  ASSERT_TRUE((*writer)->AddSequence(c).ok());
  (*writer)->EndDocument();
  ASSERT_TRUE((*writer)->Finalize().ok());
}

TEST(IndexedDatasetTest, WriterMatchesMegatronBytes) {
  const std::string prefix = IndexedTempDir() + "/small";
  WriteSmallDataset(prefix);

  // The layout of megatron/core/datasets/indexed_dataset.py (_IndexWriter), little-endian.
  // clang-format off
  const unsigned char expected_idx[] = {
      'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0,  // magic
      1, 0, 0, 0, 0, 0, 0, 0,                   // u64 version 1
      8,                                        // u8 dtype code 8 = uint16
      3, 0, 0, 0, 0, 0, 0, 0,                   // u64 sequence count
      3, 0, 0, 0, 0, 0, 0, 0,                   // u64 document count = len([0, 2, 3])
      3, 0, 0, 0,                               // i32 sequence_lengths: 3, 1, 2
      1, 0, 0, 0,                               //
      2, 0, 0, 0,                               //
      0, 0, 0, 0, 0, 0, 0, 0,                   // i64 sequence_pointers (bytes): 0, 6, 8
      6, 0, 0, 0, 0, 0, 0, 0,                   //
      8, 0, 0, 0, 0, 0, 0, 0,                   //
      0, 0, 0, 0, 0, 0, 0, 0,                   // i64 document_indices: 0, 2, 3
      2, 0, 0, 0, 0, 0, 0, 0,                   //
      3, 0, 0, 0, 0, 0, 0, 0,                   //
  };
  // clang-format on
  const unsigned char expected_bin[] = {1, 0, 2, 0, 3, 0, 4, 0, 0xff, 0xff, 0, 0};
  EXPECT_EQ(testing::ReadFileBytes(prefix + ".idx"),
            std::string(reinterpret_cast<const char*>(expected_idx), sizeof(expected_idx)));
  EXPECT_EQ(testing::ReadFileBytes(prefix + ".bin"),
            std::string(reinterpret_cast<const char*>(expected_bin), sizeof(expected_bin)));
}

void ExpectRoundTrip(DType dtype, int64_t max_token) {
  const std::string prefix = IndexedTempDir() + "/round_trip";
  // Deterministic pseudo-random documents of 1-3 sequences of 0-40 tokens.
  uint64_t state = 42;
  auto next = [&state](uint64_t n) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int64_t>((state >> 33) % n);
  };
  std::vector<std::vector<int64_t>> sequences;
  std::vector<int64_t> document_indices = {0};
  {
    auto writer = IndexedDatasetWriter::Create(prefix, dtype);
    ASSERT_TRUE(writer.ok()) << writer.status();
    for (int document = 0; document < 50; ++document) {
      for (int64_t s = 0, n = 1 + next(3); s < n; ++s) {
        std::vector<int64_t> tokens(next(41));
        for (int64_t& token : tokens) token = next(max_token + 1);
        ASSERT_TRUE((*writer)->AddSequence(tokens).ok());
        sequences.push_back(tokens);
      }
      (*writer)->EndDocument();
      document_indices.push_back(static_cast<int64_t>(sequences.size()));
    }
    sequences.push_back({max_token});  // The largest value the dtype must hold.
    ASSERT_TRUE((*writer)->AddSequence(sequences.back()).ok());
    document_indices.push_back(static_cast<int64_t>(sequences.size()));
    ASSERT_TRUE((*writer)->Finalize().ok());  // Ends the open last document.
  }

  auto dataset = IndexedDataset::Open(prefix);
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  const IndexedDataset& d = **dataset;
  EXPECT_EQ(d.dtype(), dtype);
  ASSERT_EQ(d.num_sequences(), static_cast<int64_t>(sequences.size()));
  EXPECT_EQ(d.num_documents(), 51);
  EXPECT_EQ(std::vector<int64_t>(d.document_indices().begin(), d.document_indices().end()),
            document_indices);
  int64_t total = 0;
  for (int64_t s = 0; s < d.num_sequences(); ++s) {
    ASSERT_EQ(d.sequence_length(s), static_cast<int64_t>(sequences[s].size()));
    std::vector<int64_t> read(sequences[s].size());
    d.Read(s, 0, static_cast<int64_t>(read.size()), read.data());
    EXPECT_EQ(read, sequences[s]) << "sequence " << s;
    total += static_cast<int64_t>(read.size());
  }
  EXPECT_EQ(d.num_tokens(), total);
  EXPECT_EQ(d.MaxToken(), max_token);
  // A read from the middle of a sequence: the first of 3 tokens or more (lengths are drawn
  // from 0..40, so sequence 3 may be shorter and the read would not happen).
  int64_t s = 0;
  while (s < d.num_sequences() && d.sequence_length(s) < 3) ++s;
  ASSERT_LT(s, d.num_sequences()) << "no sequence of 3 tokens to read the middle of";
  int64_t middle[2];
  d.Read(s, 1, 2, middle);
  EXPECT_EQ(middle[0], sequences[s][1]);
  EXPECT_EQ(middle[1], sequences[s][2]);
}

TEST(IndexedDatasetTest, RoundTripUInt16) { ExpectRoundTrip(DType::kUInt16, 65535); }

TEST(IndexedDatasetTest, RoundTripInt32) { ExpectRoundTrip(DType::kInt32, 2147483647); }

TEST(IndexedDatasetTest, BestTokenDTypeFollowsMegatron) {
  EXPECT_EQ(BestTokenDType(257), DType::kUInt16);
  EXPECT_EQ(BestTokenDType(65499), DType::kUInt16);
  EXPECT_EQ(BestTokenDType(65500), DType::kInt32);
  EXPECT_EQ(DTypeSize(DType::kUInt16), 2);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8);
  EXPECT_STREQ(DTypeName(DType::kInt32), "int32");
}

TEST(IndexedDatasetTest, WriterRejectsTokensOutsideTheDType) {
  const std::string prefix = IndexedTempDir() + "/range";
  auto writer = IndexedDatasetWriter::Create(prefix, DType::kUInt16);
  ASSERT_TRUE(writer.ok());
  const std::vector<int64_t> too_big = {1, 65536};
  const absl::Status status = (*writer)->AddSequence(too_big);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("65536"), HasSubstr("position 1"),
                                      HasSubstr("uint16"), HasSubstr(prefix)));
  const std::vector<int64_t> negative = {-1};
  EXPECT_FALSE((*writer)->AddSequence(negative).ok());
  EXPECT_EQ((*writer)->num_sequences(), 0);  // Rejected sequences write nothing.

  EXPECT_FALSE(IndexedDatasetWriter::Create(prefix, DType::kFloat32).ok());
}

TEST(IndexedDatasetTest, UnfinishedWriterLeavesNoFiles) {
  const std::string prefix = IndexedTempDir() + "/unfinished";
  {
    auto writer = IndexedDatasetWriter::Create(prefix, DType::kInt32);
    ASSERT_TRUE(writer.ok());
    const std::vector<int64_t> tokens = {1, 2, 3};
    ASSERT_TRUE((*writer)->AddDocument(tokens).ok());
  }
  for (const char* suffix : {".bin", ".idx", ".bin.partial", ".idx.partial"}) {
    EXPECT_FALSE(std::ifstream(prefix + suffix).is_open()) << suffix;
  }
  EXPECT_EQ(IndexedDataset::Open(prefix).status().code(), absl::StatusCode::kNotFound);
}

TEST(IndexedDatasetTest, CreateFailsInMissingFolder) {
  const auto writer = IndexedDatasetWriter::Create("/nonexistent/folder/x", DType::kUInt16);
  ASSERT_FALSE(writer.ok());
  EXPECT_THAT(writer.status().message(), HasSubstr("/nonexistent/folder/x.bin"));
}

// The torch-free parser the fuzz target calls (core/data/megatron_index.h) reads what the
// writer wrote, and encodes it back byte for byte; an empty index too (its zero-length
// arrays were copied from null pointers, which UBSan reports; the fuzz corpus keeps it).
TEST(MegatronIndexTest, ParsesAndEncodesBackTheWritersBytes) {
  const std::string prefix = IndexedTempDir() + "/parse";
  WriteSmallDataset(prefix);
  const std::string idx = testing::ReadFileBytes(prefix + ".idx");
  const absl::StatusOr<MegatronIndex> index = ParseMegatronIndex(prefix + ".idx", idx);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->sequence_lengths.size(), 3u);
  EXPECT_EQ(EncodeMegatronIndex(*index), idx);

  MegatronIndex empty;
  empty.dtype = DType::kUInt16;
  empty.document_indices = {0};
  const std::string empty_idx = EncodeMegatronIndex(empty);
  EXPECT_EQ(empty_idx.size(), 34u + 8u);
  const absl::StatusOr<MegatronIndex> parsed = ParseMegatronIndex("empty.idx", empty_idx);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->num_tokens, 0);
  EXPECT_TRUE(parsed->sequence_lengths.empty());
  EXPECT_EQ(parsed->document_indices, std::vector<int64_t>{0});
}

// Each corruption of a valid pair gives an error naming the damaged file and what is wrong.
class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = IndexedTempDir() + "/corrupt";
    WriteSmallDataset(prefix_);
    idx_ = testing::ReadFileBytes(prefix_ + ".idx");
    bin_ = testing::ReadFileBytes(prefix_ + ".bin");
    ASSERT_TRUE(IndexedDataset::Open(prefix_).ok());
  }

  std::string OpenError() {
    const auto dataset = IndexedDataset::Open(prefix_);
    EXPECT_FALSE(dataset.ok());
    return dataset.ok() ? "" : std::string(dataset.status().message());
  }

  // Overwrites the 8 bytes at `offset` of the .idx with `value`.
  void PatchIdx(size_t offset, int64_t value) {
    std::string idx = idx_;
    std::memcpy(idx.data() + offset, &value, sizeof(value));
    WriteBytes(prefix_ + ".idx", idx);
  }

  std::string prefix_;
  std::string idx_;
  std::string bin_;
};

TEST_F(CorruptionTest, BadMagic) {
  std::string idx = idx_;
  idx[0] = 'X';
  WriteBytes(prefix_ + ".idx", idx);
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("bad magic")));
}

TEST_F(CorruptionTest, WrongVersion) {
  PatchIdx(9, 2);
  EXPECT_THAT(OpenError(),
              AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("version 2"), HasSubstr("expected 1")));
}

TEST_F(CorruptionTest, UnknownDType) {
  std::string idx = idx_;
  idx[17] = 9;
  WriteBytes(prefix_ + ".idx", idx);
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("dtype code 9")));
}

TEST_F(CorruptionTest, TruncatedIdx) {
  WriteBytes(prefix_ + ".idx", idx_.substr(0, idx_.size() - 5));
  EXPECT_THAT(OpenError(),
              AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("truncated"), HasSubstr("3 sequences")));
  WriteBytes(prefix_ + ".idx", idx_.substr(0, 20));
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("34-byte header")));
}

TEST_F(CorruptionTest, HugeCountsDoNotOverflow) {
  PatchIdx(18, int64_t{1} << 62);  // sequence_count
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("truncated")));
  PatchIdx(26, int64_t{1} << 62);  // document_count: 8 times it wraps to 0 in 64 bits.
  EXPECT_THAT(OpenError(), AllOf(HasSubstr("truncated"), HasSubstr("(room for 0 sequences)")));
}

TEST_F(CorruptionTest, TrailingBytes) {
  WriteBytes(prefix_ + ".idx", idx_ + std::string(3, '\0'));
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("3 unexpected bytes"),
                                 HasSubstr("multimodal")));
}

TEST_F(CorruptionTest, TruncatedBin) {
  WriteBytes(prefix_ + ".bin", bin_.substr(0, bin_.size() - 2));
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".bin"), HasSubstr("size 10 bytes"),
                                 HasSubstr("expects 12")));
}

TEST_F(CorruptionTest, InconsistentPointers) {
  PatchIdx(34 + 3 * 4 + 8, 7);  // sequence_pointers[1]: 6 -> 7
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("sequence_pointers[1]"),
                                 HasSubstr("is 7, expected 6")));
}

TEST_F(CorruptionTest, NegativeLength) {
  std::string idx = idx_;
  const int32_t negative = -1;
  std::memcpy(idx.data() + 34, &negative, 4);
  WriteBytes(prefix_ + ".idx", idx);
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("sequence_lengths[0]")));
}

TEST_F(CorruptionTest, DocumentIndicesMustEndAtSequenceCount) {
  PatchIdx(34 + 3 * 12 + 2 * 8, 2);  // document_indices: 0, 2, 2
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("last document index")));
  PatchIdx(34 + 3 * 12 + 1 * 8, 4);  // document_indices: 0, 4, 3
  EXPECT_THAT(OpenError(), AllOf(HasSubstr(prefix_ + ".idx"), HasSubstr("document_indices[1]")));
}

TEST_F(CorruptionTest, MissingBin) {
  std::remove((prefix_ + ".bin").c_str());
  const auto dataset = IndexedDataset::Open(prefix_);
  EXPECT_EQ(dataset.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(dataset.status().message(), HasSubstr(prefix_ + ".bin"));
}

TEST(IndexedDatasetTest, FromMemory) {
  auto dataset = IndexedDataset::FromMemory("mem", {5, 6, 7, 8, 9}, {2, 0, 3}, {0, 2, 3});
  EXPECT_EQ(dataset->path_prefix(), "mem");
  EXPECT_EQ(dataset->num_sequences(), 3);
  EXPECT_EQ(dataset->num_documents(), 2);
  EXPECT_EQ(dataset->num_tokens(), 5);
  EXPECT_EQ(dataset->MaxToken(), 9);
  int64_t out[3];
  dataset->Read(2, 0, 3, out);
  EXPECT_EQ(std::vector<int64_t>(out, out + 3), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_THROW(IndexedDataset::FromMemory("bad", {1, 2}, {3}, {0, 1}), c10::Error);
  EXPECT_THROW(dataset->Read(0, 1, 2, out), c10::Error);
}

}  // namespace
}  // namespace fulcrum::data
