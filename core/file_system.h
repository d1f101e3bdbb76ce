// The file-system layer under checkpointing and anything else that must write files
// durably. A narrow virtual interface (in the style of leveldb's Env) so that tests can
// wrap the real implementation with one that fails or kills the process at a chosen
// operation, instead of sprinkling #ifdefs through the writers.
//
// Every operation returns absl::Status / StatusOr; messages name the path and the errno
// text. Paths are plain POSIX paths; nothing here interprets "~" or URLs.
//
// Thread-safety: DefaultFileSystem() and its methods are thread-safe (each call is a few
// syscalls on its own descriptors). A WritableFile or ReadOnlyMemoryRegion object is not:
// use one from one thread at a time. A region's bytes may be read from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum {

/// A file opened for sequential writing. Data reaches the kernel on Flush() and the disk
/// on Sync(); Close() flushes but does not sync. Destroying an unclosed file closes it and
/// drops any error, so writers that care call Close() themselves.
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  /// Appends `data` at the end of the file (possibly buffered in user space).
  virtual absl::Status Append(std::string_view data) = 0;
  /// Hands buffered bytes to the kernel (write(2)); no durability promise.
  virtual absl::Status Flush() = 0;
  /// Flushes and fsyncs, so the contents survive a power loss once this returns.
  virtual absl::Status Sync() = 0;
  /// Flushes and closes. Any later call fails.
  virtual absl::Status Close() = 0;
  /// The path the file was opened with.
  virtual const std::string& path() const = 0;
};

/// Read-only bytes of a whole file (an mmap on POSIX). The bytes stay valid for the
/// lifetime of this object. If another process truncates the file while it is mapped,
/// touching the lost pages raises SIGBUS: only map files that nobody rewrites in place
/// (checkpoint files are written once into a temporary directory, then renamed).
class ReadOnlyMemoryRegion {
 public:
  virtual ~ReadOnlyMemoryRegion() = default;
  virtual const char* data() const = 0;
  virtual uint64_t size() const = 0;
  std::string_view bytes() const { return std::string_view(data(), size()); }
};

/// The operations Fulcrum needs from a file system. All methods are virtual so a wrapper
/// (see FileSystemWrapper) can intercept any of them.
class FileSystem {
 public:
  virtual ~FileSystem() = default;

  /// Creates (or truncates) `path` for writing. The parent directory must exist.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  /// Maps the whole of `path` read-only. An empty file gives an empty region.
  virtual absl::StatusOr<std::unique_ptr<ReadOnlyMemoryRegion>> NewReadOnlyMemoryRegion(
      const std::string& path) = 0;
  /// Reads the whole of `path` into memory; meant for small files (manifests, indexes).
  virtual absl::StatusOr<std::string> ReadFile(const std::string& path) = 0;

  /// True if `path` exists (file, directory or anything else). Errors other than
  /// "not found" (e.g. permission denied on a parent) also read as false.
  virtual bool FileExists(const std::string& path) = 0;
  /// True if `path` exists and is a directory.
  virtual bool IsDirectory(const std::string& path) = 0;
  /// Size of the regular file `path` in bytes.
  virtual absl::StatusOr<uint64_t> FileSize(const std::string& path) = 0;
  /// Names of the entries of directory `path` (no "." or ".."), sorted bytewise.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;

  /// Creates `path` and any missing parents (mkdir -p). OK if it already is a directory.
  virtual absl::Status CreateDir(const std::string& path) = 0;
  /// rename(2): atomically replaces `to` if it is a file (or an empty directory). Works
  /// for directories. Both paths must be on the same file system.
  virtual absl::Status RenameFile(const std::string& from, const std::string& to) = 0;
  /// fsyncs directory `path`, making creations, renames and deletions of its entries
  /// durable. Without it a crash may undo a rename that already returned.
  virtual absl::Status SyncDir(const std::string& path) = 0;
  /// Deletes `path` and, if it is a directory, everything under it (rm -rf). OK if
  /// `path` does not exist. Symlinks are removed, never followed.
  virtual absl::Status DeleteRecursively(const std::string& path) = 0;
};

/// The POSIX file system. Never null; lives for the whole process.
FileSystem* DefaultFileSystem();

/// Forwards every call to `target`. Subclass it and override only what a test needs to
/// intercept (leveldb's EnvWrapper).
class FileSystemWrapper : public FileSystem {
 public:
  explicit FileSystemWrapper(FileSystem* target) : target_(target) {}
  FileSystem* target() const { return target_; }

  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    return target_->NewWritableFile(path);
  }
  absl::StatusOr<std::unique_ptr<ReadOnlyMemoryRegion>> NewReadOnlyMemoryRegion(
      const std::string& path) override {
    return target_->NewReadOnlyMemoryRegion(path);
  }
  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    return target_->ReadFile(path);
  }
  bool FileExists(const std::string& path) override { return target_->FileExists(path); }
  bool IsDirectory(const std::string& path) override { return target_->IsDirectory(path); }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    return target_->FileSize(path);
  }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    return target_->ListDir(path);
  }
  absl::Status CreateDir(const std::string& path) override { return target_->CreateDir(path); }
  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    return target_->RenameFile(from, to);
  }
  absl::Status SyncDir(const std::string& path) override { return target_->SyncDir(path); }
  absl::Status DeleteRecursively(const std::string& path) override {
    return target_->DeleteRecursively(path);
  }

 private:
  FileSystem* target_;
};

/// Joins two path components with exactly one '/' between them ("a/" + "b" -> "a/b").
/// An empty `dir` gives `name`.
std::string JoinPath(std::string_view dir, std::string_view name);

/// The directory part of `path` ("a/b/c" -> "a/b", "c" -> ".", "/c" -> "/").
std::string DirName(std::string_view path);

/// The last component of `path`, ignoring trailing slashes ("a/b/" -> "b").
std::string BaseName(std::string_view path);

/// True when `a` and `b` both exist and name the same file (same device and inode), however
/// they are spelled ("t.jsonl", "./t.jsonl", a hard or symbolic link): a tool refuses to
/// write its output onto one of its inputs.
bool IsSameFile(const std::string& a, const std::string& b);

/// Writes `contents` to `path`, fsyncs and closes it. Not atomic: a crash can leave a
/// partial file. Use WriteFileAtomically when readers may look at `path` at any time.
absl::Status WriteStringToFile(FileSystem* fs, const std::string& path, std::string_view contents);

/// Replaces `path` with `contents` so that a reader (or a crash) sees either the old
/// file or the complete new one: writes `path`.tmp, fsyncs it, renames it over `path`,
/// then fsyncs the parent directory so the rename itself is durable.
absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path,
                                 std::string_view contents);

}  // namespace fulcrum
