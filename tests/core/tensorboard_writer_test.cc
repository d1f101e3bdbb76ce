// core/tensorboard_writer.h: CRC32C against RFC 3720's test vectors, the protobuf encoding
// of events against bytes worked out from the wire-format specification, and the event
// file: first record, flushing, a writer that dies halfway, names that sort after older
// files. The end-to-end reading by TensorBoard itself is in tests/recipes/tensorboard_test.cc.
#include "core/tensorboard_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <ctime>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "tests/core/checkpoint/fault_injection_file_system.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string Bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

uint32_t ReadU32(const std::string& s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

// The payloads of the whole, checksum-correct TFRecords at the start of `file`; stops at
// the first truncated or corrupt one, as TensorBoard's reader does.
std::vector<std::string> ReadRecords(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 12 <= file.size()) {
    uint64_t length;
    std::memcpy(&length, file.data() + at, 8);
    const uint32_t length_crc = tensorboard::MaskCrc(tensorboard::Crc32c(file.substr(at, 8)));
    if (ReadU32(file, at + 8) != length_crc) break;
    if (at + 12 + length + 4 > file.size()) break;
    const std::string data = file.substr(at + 12, length);
    if (ReadU32(file, at + 12 + length) != tensorboard::MaskCrc(tensorboard::Crc32c(data))) break;
    out.push_back(data);
    at += 12 + length + 4;
  }
  return out;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(TensorBoardCrcTest, MatchesRfc3720TestVectors) {
  // RFC 3720, appendix B.4, and the check value of the CRC catalogue ("123456789").
  EXPECT_EQ(tensorboard::Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(tensorboard::Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(tensorboard::Crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(tensorboard::Crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(tensorboard::Crc32c(descending), 0x113FDB5Cu);
  EXPECT_EQ(tensorboard::Crc32c(""), 0u);
}

TEST(TensorBoardCrcTest, MaskRotatesRightBy15AndAddsTheDelta) {
  EXPECT_EQ(tensorboard::MaskCrc(0), 0xa282ead8u);
  EXPECT_EQ(tensorboard::MaskCrc(1u << 15), 1u + 0xa282ead8u);
  EXPECT_EQ(tensorboard::MaskCrc(1), (1u << 17) + 0xa282ead8u);
}

TEST(TensorBoardRecordTest, FramesLengthDataAndTheirMaskedCrcs) {
  const std::string record = tensorboard::FrameRecord("abc");
  ASSERT_EQ(record.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(record.substr(0, 8), Bytes({3, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(ReadU32(record, 8), tensorboard::MaskCrc(tensorboard::Crc32c(record.substr(0, 8))));
  EXPECT_EQ(record.substr(12, 3), "abc");
  EXPECT_EQ(ReadU32(record, 15), tensorboard::MaskCrc(tensorboard::Crc32c("abc")));
}

TEST(TensorBoardEventTest, EncodesScalarsAsTheWireFormatSays) {
  // wall_time 1.5 (field 1, fixed64: 0x3FF8000000000000), step 300 (field 2, varint AC 02),
  // summary (field 5) { value (1) { tag (1) "a", simple_value (2, fixed32) 0.5f = 0x3F000000 },
  //                     value (1) { tag "bc", simple_value -2.0f = 0xC0000000 } }.
  const std::string expected =
      Bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x10, 0xAC, 0x02, 0x2A, 21}) +
      Bytes({0x0A, 8, 0x0A, 1, 'a', 0x15, 0, 0, 0, 0x3F}) +
      Bytes({0x0A, 9, 0x0A, 2, 'b', 'c', 0x15, 0, 0, 0, 0xC0});
  EXPECT_EQ(tensorboard::ScalarsEvent(1.5, 300, {{"a", 0.5}, {"bc", -2.0}}), expected);
}

TEST(TensorBoardEventTest, EncodesFileVersionAndSessionStart) {
  EXPECT_EQ(tensorboard::FileVersionEvent(2.0),
            Bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x1A, 13}) + "brain.Event:2");
  // session_log (field 7) { status (1) START = 1 } at step 5.
  EXPECT_EQ(tensorboard::SessionStartEvent(2.0, 5),
            Bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 5, 0x3A, 2, 0x08, 1}));
}

TEST(TensorBoardWriterTest, WritesFileVersionFirstAndFlushesEveryEvent) {
  const std::string dir = testing::MakeTempDir("tb") + "/runs/a";  // made by Open
  auto writer = TensorBoardWriter::Open(DefaultFileSystem(), dir);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string name = BaseName((*writer)->path());
  EXPECT_THAT(name, StartsWith("events.out.tfevents."));
  EXPECT_THAT(name, HasSubstr(absl::StrCat(".", getpid(), ".0")));
  ASSERT_TRUE((*writer)->WriteStart(1).ok());
  ASSERT_TRUE((*writer)->WriteScalars(1, {{"lm loss", 2.5}}).ok());
  // Read while the writer is still open: nothing waits in a user-space buffer.
  const std::vector<std::string> records = ReadRecords(Slurp((*writer)->path()));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_THAT(records[0], HasSubstr("brain.Event:2"));
  EXPECT_EQ(records[1].substr(9), Bytes({0x10, 1, 0x3A, 2, 0x08, 1}));
  EXPECT_EQ(records[2].substr(9), tensorboard::ScalarsEvent(0, 1, {{"lm loss", 2.5}}).substr(9));
}

TEST(TensorBoardWriterTest, AWriterThatDiesHalfwayLeavesEveryWholeEvent) {
  const std::string dir = testing::MakeTempDir("tb_fault");
  testing_util::FaultInjectionFileSystem fs(DefaultFileSystem());
  const size_t version = tensorboard::FrameRecord(tensorboard::FileVersionEvent(0)).size();
  const size_t scalars =
      tensorboard::FrameRecord(tensorboard::ScalarsEvent(0, 1, {{"x", 1}})).size();
  fs.FaultAfterBytes(version + 2 * scalars + scalars / 2,
                     testing_util::FaultInjectionFileSystem::Action::kFail);
  auto writer = TensorBoardWriter::Open(&fs, dir);
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_TRUE((*writer)->WriteScalars(1, {{"x", 1}}).ok());
  EXPECT_TRUE((*writer)->WriteScalars(2, {{"x", 2}}).ok());
  EXPECT_FALSE((*writer)->WriteScalars(3, {{"x", 3}}).ok());
  const std::string file = Slurp((*writer)->path());
  EXPECT_EQ(file.size(), version + 2 * scalars + scalars / 2);  // the torn third is on disk
  const std::vector<std::string> records = ReadRecords(file);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[2].substr(9), tensorboard::ScalarsEvent(0, 2, {{"x", 2}}).substr(9));
}

TEST(TensorBoardWriterTest, ANewFileSortsAfterTheEventFilesAlreadyThere) {
  const std::string dir = testing::MakeTempDir("tb_order");
  // A file from "the future" (a clock set back since, or a resume within the same second).
  const int64_t later = static_cast<int64_t>(std::time(nullptr)) + 100;
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(),
                                JoinPath(dir, tensorboard::EventFileName(later, "zz", 99, 7)), "")
                  .ok());
  auto first = TensorBoardWriter::Open(DefaultFileSystem(), dir);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_THAT(BaseName((*first)->path()),
              StartsWith(absl::StrCat("events.out.tfevents.", later + 1, ".")));
  auto second = TensorBoardWriter::Open(DefaultFileSystem(), dir);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_GT(BaseName((*second)->path()), BaseName((*first)->path()));
}

TEST(TensorBoardWriterTest, RefusesAFileWhereTheDirectoryBelongs) {
  const std::string file = testing::MakeTempDir("tb_bad") + "/plain";
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), file, "x").ok());
  for (const std::string& dir : {file, file + "/sub"}) {
    const absl::Status check = CheckTensorBoardDirWritable(DefaultFileSystem(), dir);
    EXPECT_EQ(check.code(), absl::StatusCode::kFailedPrecondition) << check;
    EXPECT_THAT(std::string(check.message()),
                StartsWith("--tensorboard_dir: cannot write event files to " + dir + ": "));
    EXPECT_EQ(TensorBoardWriter::Open(DefaultFileSystem(), dir).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(CheckTensorBoardDirWritable(DefaultFileSystem(), file + "_dir/new").ok());
}

}  // namespace
}  // namespace fulcrum
