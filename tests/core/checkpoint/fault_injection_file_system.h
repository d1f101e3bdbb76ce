// A FileSystem wrapper for crash-safety tests: counts the mutating operations a save
// performs and, when a chosen trigger fires, either fails that operation (and every later
// one, like a disk that went away) or kills the process with SIGKILL on the spot, as a
// power cut or an OOM kill would. Only mutating operations are counted and faulted:
// creating files, appends, flushes, syncs, closes, mkdir, rename, directory sync, delete.
//
// Thread-safety: none; one save at a time.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/file_system.h"

namespace fulcrum::testing_util {

class FaultInjectionFileSystem : public FileSystemWrapper {
 public:
  enum class Action {
    kFail,  // The operation returns an error and so does every later one.
    kKill,  // raise(SIGKILL) before the operation takes effect.
    kFailOnce,  // Only the operation returns an error (a full disk: the write fails, the
                // delete that follows works).
  };
  /// One mutating operation, as seen by a trigger.
  struct Op {
    int64_t index = 0;  // 0-based count of mutating operations since construction.
    std::string kind;   // "NewWritableFile", "Append", "Sync", "RenameFile", ...
    std::string path;
    std::string to;  // RenameFile's destination.
  };

  explicit FaultInjectionFileSystem(FileSystem* target) : FileSystemWrapper(target) {}

  /// Faults the operation with index `k` (0-based, counting every mutating operation).
  void FaultAtOp(int64_t k, Action action) {
    FaultWhen([k](const Op& op) { return op.index == k; }, action);
  }
  /// Faults the first operation for which `trigger` is true.
  void FaultWhen(std::function<bool(const Op&)> trigger, Action action) {
    trigger_ = std::move(trigger);
    action_ = action;
  }
  /// Lets the first `bytes` bytes of all Appends through (flushed to the kernel, so a
  /// partial file really is on disk), then faults the Append that would exceed them.
  void FaultAfterBytes(uint64_t bytes, Action action) {
    byte_budget_ = bytes;
    action_ = action;
  }

  int64_t op_count() const { return next_index_; }
  const std::vector<Op>& log() const { return log_; }
  bool faulted() const { return faulted_; }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override;
  absl::Status CreateDir(const std::string& path) override {
    if (absl::Status s = Check("CreateDir", path); !s.ok()) return s;
    return target()->CreateDir(path);
  }
  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (absl::Status s = Check("RenameFile", from, to); !s.ok()) return s;
    return target()->RenameFile(from, to);
  }
  absl::Status SyncDir(const std::string& path) override {
    if (absl::Status s = Check("SyncDir", path); !s.ok()) return s;
    return target()->SyncDir(path);
  }
  absl::Status DeleteRecursively(const std::string& path) override {
    if (absl::Status s = Check("DeleteRecursively", path); !s.ok()) return s;
    return target()->DeleteRecursively(path);
  }

  /// Records the operation and decides whether it faults. Public for the file wrapper.
  absl::Status Check(const std::string& kind, const std::string& path, const std::string& to = "") {
    Op op{next_index_++, kind, path, to};
    log_.push_back(op);
    if (faulted_) return Injected(op);
    if (trigger_ && trigger_(op)) return Fire(op);
    return absl::OkStatus();
  }

  /// Appends through `file`, honouring FaultAfterBytes.
  absl::Status Append(WritableFile* file, std::string_view data) {
    if (absl::Status s = Check("Append", file->path()); !s.ok()) return s;
    if (data.size() <= byte_budget_) {
      byte_budget_ -= data.size();
      return file->Append(data);
    }
    // Write exactly the remaining budget and push it to the kernel, then fault.
    const std::string_view prefix = data.substr(0, byte_budget_);
    byte_budget_ = 0;
    if (absl::Status s = file->Append(prefix); !s.ok()) return s;
    if (absl::Status s = file->Flush(); !s.ok()) return s;
    return Fire(log_.back());
  }

 private:
  absl::Status Fire(const Op& op) {
    if (action_ == Action::kKill) {
      ::raise(SIGKILL);
      ::_exit(9);  // Not reached.
    }
    if (action_ == Action::kFailOnce) {
      trigger_ = nullptr;
      byte_budget_ = UINT64_MAX;
    } else {
      faulted_ = true;
    }
    return Injected(op);
  }
  static absl::Status Injected(const Op& op) {
    return absl::UnavailableError(
        absl::StrCat("injected fault at operation ", op.index, ": ", op.kind, " ", op.path));
  }

  std::function<bool(const Op&)> trigger_;
  Action action_ = Action::kFail;
  uint64_t byte_budget_ = UINT64_MAX;
  int64_t next_index_ = 0;
  bool faulted_ = false;
  std::vector<Op> log_;
};

namespace internal {

class FaultInjectionWritableFile : public WritableFile {
 public:
  FaultInjectionWritableFile(FaultInjectionFileSystem* fs, std::unique_ptr<WritableFile> file)
      : fs_(fs), file_(std::move(file)) {}
  absl::Status Append(std::string_view data) override { return fs_->Append(file_.get(), data); }
  absl::Status Flush() override {
    if (absl::Status s = fs_->Check("Flush", path()); !s.ok()) return s;
    return file_->Flush();
  }
  absl::Status Sync() override {
    if (absl::Status s = fs_->Check("Sync", path()); !s.ok()) return s;
    return file_->Sync();
  }
  absl::Status Close() override {
    if (absl::Status s = fs_->Check("Close", path()); !s.ok()) return s;
    return file_->Close();
  }
  const std::string& path() const override { return file_->path(); }

 private:
  FaultInjectionFileSystem* fs_;
  std::unique_ptr<WritableFile> file_;
};

}  // namespace internal

inline absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectionFileSystem::NewWritableFile(
    const std::string& path) {
  if (absl::Status s = Check("NewWritableFile", path); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<WritableFile>> file = target()->NewWritableFile(path);
  if (!file.ok()) return file.status();
  return std::unique_ptr<WritableFile>(
      new internal::FaultInjectionWritableFile(this, std::move(file).value()));
}

}  // namespace fulcrum::testing_util
