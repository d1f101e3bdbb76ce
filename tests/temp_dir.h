// Temporary directories of the tests, one door for every test binary (header-only: it needs
// only GoogleTest, so targets that do not link fulcrum_test_util use it too).
//
// A test run must leave the disk as it found it: a test that writes checkpoints or a
// corpus into /tmp and walks away fills a machine within a few dozen runs (it did: CI's
// disk ran out installing torch). So every directory made here is removed, with its
// contents, when the test process that made it exits normally with every test passed. A
// failed test keeps its directories and names them on stderr, for a look; so does any
// process with FULCRUM_KEEP_TEST_DIRS set.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"

namespace fulcrum::testing {

namespace temp_dir_internal {

/// The directories this process made; removed when the process's statics are destroyed.
class Registry {
 public:
  static Registry& Get() {
    static Registry registry;
    return registry;
  }

  void Add(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(dir);
  }

  ~Registry() {
    // A fork()ed child shares the parent's statics: only the maker removes.
    if (getpid() != maker_) return;
    const bool keep = std::getenv("FULCRUM_KEEP_TEST_DIRS") != nullptr ||
                      !::testing::UnitTest::GetInstance()->Passed();
    for (const std::string& dir : dirs_) {
      if (keep) {
        std::fprintf(stderr, "fulcrum test: kept %s\n", dir.c_str());
        continue;
      }
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  }

 private:
  Registry() : maker_(getpid()) {}

  const pid_t maker_;
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

}  // namespace temp_dir_internal

/// A fresh empty directory fulcrum_<tag>_XXXXXX under GoogleTest's TempDir() ($TEST_TMPDIR,
/// else /tmp/; tools/test.sh points it into the build directory). Removed at exit as the
/// file comment says.
inline std::string MakeTempDir(const std::string& tag) {
  std::string pattern = ::testing::TempDir() + "fulcrum_" + tag + "_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed for " + pattern);
  }
  temp_dir_internal::Registry::Get().Add(pattern);
  return pattern;
}

/// The whole content of the file at `path`, byte for byte ("" if it cannot be read).
inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace fulcrum::testing
