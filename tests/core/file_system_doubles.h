// File systems for the save tests that refuse, or hold back, the creation of chosen files:
// a shard write that fails on one rank, or one that is slow while training goes on (NOTE
// [background saves] in core/distributed_checkpoint.h). The crash-safety tests' wrapper,
// which counts and faults every mutating operation, is
// tests/core/checkpoint/fault_injection_file_system.h.
//
// Thread-safety: both may be used from many threads at once (a job's ranks played by
// threads, a background save's writer).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/file_system.h"

namespace fulcrum::testing_util {

/// Fails the creation of every file whose path contains `needle`, with a message that
/// starts "injected:".
class RefusingFileSystem : public FileSystemWrapper {
 public:
  RefusingFileSystem(FileSystem* target, std::string needle)
      : FileSystemWrapper(target), needle_(std::move(needle)) {}
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    if (path.find(needle_) != std::string::npos) {
      return absl::UnavailableError(absl::StrCat("injected: cannot create ", path));
    }
    return target()->NewWritableFile(path);
  }

 private:
  const std::string needle_;
};

/// Holds the creation of every file whose path contains `needle` until Open(); fails it if
/// Open() does not come within a minute (a save that blocked its caller would never let
/// the caller open the gate).
class GatedFileSystem : public FileSystemWrapper {
 public:
  GatedFileSystem(FileSystem* target, std::string needle)
      : FileSystemWrapper(target), needle_(std::move(needle)) {}
  void Open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    opened_.notify_all();
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    if (path.find(needle_) != std::string::npos) {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!opened_.wait_for(lock, std::chrono::minutes(1), [this] { return open_; })) {
        return absl::DeadlineExceededError(absl::StrCat("the gate before ", path, " never opened"));
      }
    }
    return target()->NewWritableFile(path);
  }

 private:
  const std::string needle_;
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

}  // namespace fulcrum::testing_util
