// POSIX implementation of core/file_system.h.
#include "core/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"

namespace fulcrum {
namespace {

absl::Status PosixError(const char* what, const std::string& path, int error_number) {
  return absl::ErrnoToStatus(error_number, absl::StrCat(what, " ", path));
}

// Writes all of [data, data + size) to `fd`, retrying short writes and EINTR.
absl::Status WriteAll(int fd, const std::string& path, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("cannot write to", path, errno);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

class PosixWritableFile final : public WritableFile {
 public:
  // Small appends (JSON, headers) are gathered so they do not cost one syscall each;
  // tensor payloads are usually larger than this and bypass the buffer.
  static constexpr size_t kBufferBytes = 256 << 10;

  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {
    buffer_.reserve(kBufferBytes);
  }
  ~PosixWritableFile() override {
    if (fd_ >= 0) {
      absl::Status status = Close();
      if (!status.ok()) FULCRUM_LOG(WARNING) << "closing unclosed file: " << status;
    }
  }

  absl::Status Append(std::string_view data) override {
    FULCRUM_RETURN_IF_ERROR(CheckOpen());
    if (buffer_.size() + data.size() <= kBufferBytes) {
      buffer_.append(data.data(), data.size());
      return absl::OkStatus();
    }
    FULCRUM_RETURN_IF_ERROR(Flush());
    if (data.size() < kBufferBytes) {
      buffer_.append(data.data(), data.size());
      return absl::OkStatus();
    }
    return WriteAll(fd_, path_, data.data(), data.size());
  }

  absl::Status Flush() override {
    FULCRUM_RETURN_IF_ERROR(CheckOpen());
    absl::Status status = WriteAll(fd_, path_, buffer_.data(), buffer_.size());
    buffer_.clear();
    return status;
  }

  absl::Status Sync() override {
    FULCRUM_RETURN_IF_ERROR(Flush());
    if (::fsync(fd_) != 0) return PosixError("cannot fsync", path_, errno);
    return absl::OkStatus();
  }

  absl::Status Close() override {
    FULCRUM_RETURN_IF_ERROR(CheckOpen());
    absl::Status status = Flush();
    // close(2) must not be retried on EINTR on Linux: the descriptor is gone either way.
    if (::close(fd_) != 0 && status.ok()) status = PosixError("cannot close", path_, errno);
    fd_ = -1;
    return status;
  }

  const std::string& path() const override { return path_; }

 private:
  absl::Status CheckOpen() const {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already closed"));
    return absl::OkStatus();
  }

  std::string path_;
  int fd_;
  std::string buffer_;
};

class PosixMemoryRegion final : public ReadOnlyMemoryRegion {
 public:
  PosixMemoryRegion(void* address, uint64_t size) : address_(address), size_(size) {}
  ~PosixMemoryRegion() override {
    if (address_ != nullptr) ::munmap(address_, size_);
  }
  const char* data() const override {
    return address_ != nullptr ? static_cast<const char*>(address_) : "";
  }
  uint64_t size() const override { return size_; }

 private:
  void* address_;  // null for an empty file: mmap(2) refuses zero-length mappings.
  uint64_t size_;
};

// Closes a descriptor on scope exit.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

int OpenRetryingEintr(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

class PosixFileSystem final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    const int fd = OpenRetryingEintr(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return PosixError("cannot create", path, errno);
    return std::unique_ptr<WritableFile>(new PosixWritableFile(path, fd));
  }

  absl::StatusOr<std::unique_ptr<ReadOnlyMemoryRegion>> NewReadOnlyMemoryRegion(
      const std::string& path) override {
    const int fd = OpenRetryingEintr(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError("cannot open", path, errno);
    FdCloser closer(fd);  // The mapping keeps the file alive on its own.
    struct stat st;
    if (::fstat(fd, &st) != 0) return PosixError("cannot stat", path, errno);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size == 0) return std::unique_ptr<ReadOnlyMemoryRegion>(new PosixMemoryRegion(nullptr, 0));
    void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (address == MAP_FAILED) return PosixError("cannot mmap", path, errno);
    return std::unique_ptr<ReadOnlyMemoryRegion>(new PosixMemoryRegion(address, size));
  }

  absl::StatusOr<std::string> ReadFile(const std::string& path) override {
    const int fd = OpenRetryingEintr(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PosixError("cannot open", path, errno);
    FdCloser closer(fd);
    std::string contents;
    char chunk[64 << 10];
    while (true) {
      const ssize_t n = ::read(fd, chunk, sizeof(chunk));
      if (n < 0) {
        if (errno == EINTR) continue;
        return PosixError("cannot read", path, errno);
      }
      if (n == 0) break;
      contents.append(chunk, static_cast<size_t>(n));
    }
    return contents;
  }

  bool FileExists(const std::string& path) override {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0;
  }

  bool IsDirectory(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  }

  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return PosixError("cannot stat", path, errno);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
    }
    return static_cast<uint64_t>(st.st_size);
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return PosixError("cannot list directory", path, errno);
    std::vector<std::string> names;
    errno = 0;
    while (struct dirent* entry = ::readdir(dir)) {
      const std::string_view name = entry->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
    }
    const int read_errno = errno;
    ::closedir(dir);
    if (read_errno != 0) return PosixError("cannot list directory", path, read_errno);
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::Status CreateDir(const std::string& path) override {
    if (path.empty()) return absl::InvalidArgumentError("CreateDir: empty path");
    // Create each prefix that ends at a '/', then the full path.
    for (size_t pos = path.find('/', 1);; pos = path.find('/', pos + 1)) {
      const std::string prefix = path.substr(0, pos);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
        return PosixError("cannot create directory", prefix, errno);
      }
      if (pos == std::string::npos) break;
    }
    if (!IsDirectory(path)) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create directory ", path, ": a non-directory is in the way"));
    }
    return absl::OkStatus();
  }

  absl::Status RenameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot rename ", from, " to ", to));
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& path) override {
    const int fd = OpenRetryingEintr(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return PosixError("cannot open directory", path, errno);
    FdCloser closer(fd);
    if (::fsync(fd) != 0) return PosixError("cannot fsync directory", path, errno);
    return absl::OkStatus();
  }

  absl::Status DeleteRecursively(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return absl::OkStatus();
      return PosixError("cannot stat", path, errno);
    }
    if (S_ISDIR(st.st_mode)) {
      FULCRUM_ASSIGN_OR_RETURN(const std::vector<std::string> names, ListDir(path));
      for (const std::string& name : names) {
        FULCRUM_RETURN_IF_ERROR(DeleteRecursively(JoinPath(path, name)));
      }
      if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
        return PosixError("cannot remove directory", path, errno);
      }
      return absl::OkStatus();
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return PosixError("cannot remove", path, errno);
    }
    return absl::OkStatus();
  }
};

}  // namespace

FileSystem* DefaultFileSystem() {
  static PosixFileSystem* const file_system = new PosixFileSystem();  // Never destroyed.
  return file_system;
}

std::string JoinPath(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  while (!name.empty() && name.front() == '/') name.remove_prefix(1);
  std::string joined(dir);
  if (joined.back() != '/') joined.push_back('/');
  joined.append(name);
  return joined;
}

std::string DirName(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string BaseName(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos || path == "/") return std::string(path);
  return std::string(path.substr(slash + 1));
}

bool IsSameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

absl::Status WriteStringToFile(FileSystem* fs, const std::string& path, std::string_view contents) {
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs->NewWritableFile(path));
  FULCRUM_RETURN_IF_ERROR(file->Append(contents));
  FULCRUM_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path,
                                 std::string_view contents) {
  const std::string temp_path = path + ".tmp";
  FULCRUM_RETURN_IF_ERROR(WriteStringToFile(fs, temp_path, contents));
  FULCRUM_RETURN_IF_ERROR(fs->RenameFile(temp_path, path));
  return fs->SyncDir(DirName(path));
}

}  // namespace fulcrum
