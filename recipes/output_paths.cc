#include "recipes/output_paths.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/file_system.h"

namespace fulcrum {
namespace {

absl::Status Refuse(const char* flag, const std::string& path, absl::string_view cause) {
  return absl::FailedPreconditionError(
      absl::StrCat("--", flag, "=", path, " cannot be written: ", cause));
}

// What MetricsWriter::Open (fopen "a") will do, without leaving a file that was not there.
// Exclusive creation tells whether the file is ours to remove; a file another rank is
// probing at the same moment may vanish between the two opens, so that is tried again.
absl::Status CheckAppendable(const char* flag, const std::string& path) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(path.c_str());
      return absl::OkStatus();
    }
    if (errno != EEXIST) return Refuse(flag, path, std::strerror(errno));
    fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      return absl::OkStatus();
    }
    if (errno != ENOENT) return Refuse(flag, path, std::strerror(errno));
  }
  return Refuse(flag, path, "it keeps appearing and disappearing");
}

// What TimelineRecorder::Flush will do: create the directory, then write a file there and
// rename it over `path` (WriteFileAtomically).
absl::Status CheckReplaceable(const char* flag, const std::string& path) {
  FileSystem* fs = DefaultFileSystem();
  const std::string dir = DirName(path);
  if (absl::Status s = fs->CreateDir(dir); !s.ok()) return Refuse(flag, path, s.message());
  if (fs->IsDirectory(path)) return Refuse(flag, path, "it is a directory");
  const std::string probe =
      JoinPath(dir, absl::StrCat(".", BaseName(path), ".write_probe_", ::getpid()));
  const absl::Status written = WriteStringToFile(fs, probe, "fulcrum\n");
  const absl::Status removed = fs->DeleteRecursively(probe);
  if (!written.ok()) return Refuse(flag, path, written.message());
  if (!removed.ok()) return Refuse(flag, path, removed.message());
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckOutputsWritable(const TrainOptions& train, const std::string& timeline) {
  if (!train.save.empty()) {
    if (absl::Status s = ckpt::CheckSaveDirWritable(DefaultFileSystem(), train.save); !s.ok()) {
      return s;
    }
  }
  if (!train.metrics_file.empty()) {
    if (absl::Status s = CheckAppendable("metrics_file", train.metrics_file); !s.ok()) return s;
  }
  if (!train.load_trace.empty()) {
    if (absl::Status s = CheckAppendable("load_trace", train.load_trace); !s.ok()) return s;
  }
  if (!timeline.empty()) {
    if (absl::Status s = CheckReplaceable("timeline", timeline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
