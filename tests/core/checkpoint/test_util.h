// Helpers shared by the checkpoint tests: a self-deleting temporary directory and raw
// byte edits for corrupting files the way disks and crashes do.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "core/file_system.h"

namespace fulcrum::testing_util {

/// A fresh directory under the gtest temp dir, deleted with everything in it on scope exit.
class ScopedTempDir {
 public:
  ScopedTempDir() {
    std::string pattern = ::testing::TempDir() + "fulcrum_ckpt_test_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = pattern;
  }
  ~ScopedTempDir() { (void)DefaultFileSystem()->DeleteRecursively(path_); }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return JoinPath(path_, name); }

 private:
  std::string path_;
};

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// Inverts every bit of the byte at `offset` (negative: from the end of the file).
inline void FlipByte(const std::string& path, int64_t offset) {
  std::string bytes = ReadBytes(path);
  ASSERT_FALSE(bytes.empty()) << path;
  const size_t at = offset >= 0 ? static_cast<size_t>(offset) : bytes.size() + offset;
  bytes.at(at) = static_cast<char>(~bytes.at(at));
  WriteBytes(path, bytes);
}

/// Cuts `path` down to `size` bytes.
inline void TruncateTo(const std::string& path, uint64_t size) {
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(size)), 0) << path;
}

/// `value` as 8 little-endian bytes (the safetensors header length).
inline std::string LittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

}  // namespace fulcrum::testing_util
