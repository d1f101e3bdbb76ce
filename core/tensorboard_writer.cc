#include "core/tensorboard_writer.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"

namespace fulcrum {
namespace tensorboard {
namespace {

// Abseil's CRC32C (absl/crc) is newer than Debian 12's abseil and zlib's crc32 is the
// other polynomial, so the table-driven CRC is written here (RFC 3720, appendix B.4).
constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;

constexpr std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? kCastagnoliReflected : 0);
    table[i] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrcTable = MakeCrcTable();

// Protobuf wire types (protobuf.dev/programming-guides/encoding).
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void PutVarint(std::string* out, uint64_t value) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

template <typename T>
void PutLittleEndian(std::string* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  }
}

void PutKey(std::string* out, uint32_t field, WireType type) {
  PutVarint(out, (field << 3) | type);
}

void PutBytes(std::string* out, uint32_t field, std::string_view bytes) {
  PutKey(out, field, kLengthDelimited);
  PutVarint(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

// Event fields (tensorflow/core/util/event.proto).
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
// Summary.value, Summary.Value.{tag, simple_value}, SessionLog.status and its START.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;
constexpr uint32_t kSessionLogStatus = 1, kSessionStart = 1;

// wall_time and step, the fields every event starts with.
std::string EventHeader(double wall_time, int64_t step) {
  std::string out;
  uint64_t bits;
  std::memcpy(&bits, &wall_time, sizeof(bits));
  PutKey(&out, kWallTime, kFixed64);
  PutLittleEndian(&out, bits);
  if (step != 0) {  // proto3: a zero scalar is not written
    PutKey(&out, kStep, kVarint);
    PutVarint(&out, static_cast<uint64_t>(step));
  }
  return out;
}

}  // namespace

uint32_t Crc32c(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) crc = kCrcTable[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskCrc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

std::string FrameRecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  PutLittleEndian<uint64_t>(&out, data.size());
  PutLittleEndian<uint32_t>(&out, MaskCrc(Crc32c(out)));
  out.append(data.data(), data.size());
  PutLittleEndian<uint32_t>(&out, MaskCrc(Crc32c(data)));
  return out;
}

std::string FileVersionEvent(double wall_time) {
  std::string out = EventHeader(wall_time, 0);
  PutBytes(&out, kFileVersion, "brain.Event:2");
  return out;
}

std::string SessionStartEvent(double wall_time, int64_t step) {
  std::string log;
  PutKey(&log, kSessionLogStatus, kVarint);
  PutVarint(&log, kSessionStart);
  std::string out = EventHeader(wall_time, step);
  PutBytes(&out, kSessionLog, log);
  return out;
}

std::string ScalarsEvent(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string entry;
    PutBytes(&entry, kValueTag, tag);
    const float single = static_cast<float>(value);
    uint32_t bits;
    std::memcpy(&bits, &single, sizeof(bits));
    PutKey(&entry, kValueSimpleValue, kFixed32);
    PutLittleEndian(&entry, bits);
    PutBytes(&summary, kSummaryValue, entry);
  }
  std::string out = EventHeader(wall_time, step);
  PutBytes(&out, kSummary, summary);
  return out;
}

std::string EventFileName(int64_t seconds, std::string_view host, int64_t pid, int64_t n) {
  return absl::StrFormat("events.out.tfevents.%010d.%s.%d.%d", seconds, host, pid, n);
}

}  // namespace tensorboard

namespace {

constexpr absl::string_view kEventFilePrefix = "events.out.tfevents.";

double WallTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

absl::Status Refuse(const std::string& dir, const absl::Status& cause) {
  return absl::FailedPreconditionError(
      absl::StrCat("--tensorboard_dir: cannot write event files to ", dir, ": ", cause.message()));
}

absl::Status MakeDir(FileSystem* fs, const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("--tensorboard_dir is empty");
  if (absl::Status s = fs->CreateDir(dir); !s.ok()) return Refuse(dir, s);
  if (!fs->IsDirectory(dir)) return Refuse(dir, absl::NotFoundError("not a directory"));
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTensorBoardDirWritable(FileSystem* fs, const std::string& dir) {
  FULCRUM_RETURN_IF_ERROR(MakeDir(fs, dir));
  // One probe per process (the ranks of a job may check at once); its name has no
  // "tfevents", so TensorBoard never reads a probe a killed process left.
  const std::string probe = JoinPath(dir, absl::StrCat(".fulcrum_write_probe_", getpid()));
  if (absl::Status s = WriteStringToFile(fs, probe, "fulcrum\n"); !s.ok()) return Refuse(dir, s);
  if (absl::Status s = fs->DeleteRecursively(probe); !s.ok()) return Refuse(dir, s);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::Open(FileSystem* fs,
                                                                           const std::string& dir) {
  FULCRUM_RETURN_IF_ERROR(MakeDir(fs, dir));
  auto names = fs->ListDir(dir);
  if (!names.ok()) return Refuse(dir, names.status());
  // NOTE [tensorboard resume]: later than every event file there.
  const double now = WallTime();
  int64_t seconds = static_cast<int64_t>(now);
  for (const std::string& name : *names) {
    int64_t theirs;
    if (absl::StartsWith(name, kEventFilePrefix) && name.size() >= kEventFilePrefix.size() + 10 &&
        absl::SimpleAtoi(absl::string_view(name).substr(kEventFilePrefix.size(), 10), &theirs)) {
      seconds = std::max(seconds, theirs + 1);
    }
  }
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0 || host[0] == '\0') {
    std::strcpy(host.data(), "localhost");
  }
  std::string path;
  for (int64_t n = 0; path.empty() || fs->FileExists(path); ++n) {
    path = JoinPath(dir, tensorboard::EventFileName(seconds, host.data(), getpid(), n));
  }
  auto file = fs->NewWritableFile(path);
  if (!file.ok()) return Refuse(dir, file.status());
  std::unique_ptr<TensorBoardWriter> writer(new TensorBoardWriter(std::move(*file)));
  if (absl::Status s = writer->WriteRecord(tensorboard::FileVersionEvent(now)); !s.ok()) {
    return Refuse(dir, s);
  }
  return writer;
}

TensorBoardWriter::~TensorBoardWriter() { file_->Close().IgnoreError(); }

absl::Status TensorBoardWriter::WriteRecord(const std::string& event) {
  FULCRUM_RETURN_IF_ERROR(file_->Append(tensorboard::FrameRecord(event)));
  return file_->Flush();
}

absl::Status TensorBoardWriter::WriteStart(int64_t step) {
  return WriteRecord(tensorboard::SessionStartEvent(WallTime(), step));
}

absl::Status TensorBoardWriter::WriteScalars(int64_t step, const Scalars& scalars) {
  return WriteRecord(tensorboard::ScalarsEvent(WallTime(), step, scalars));
}

}  // namespace fulcrum
