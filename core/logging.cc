// The only translation unit that includes glog (see core/logging.h).
#include "core/logging.h"

#include <glog/logging.h>

#include <atomic>
#include <stdexcept>

#include "core/status.h"

namespace fulcrum {
namespace {
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
}  // namespace

void InitLogging(const char* argv0) {
  static bool initialised = false;
  if (initialised) return;
  initialised = true;
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv0);
}

void SetLogRank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}

void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) throw std::runtime_error(std::string(status.message()));
}

namespace internal {

LogMessage::LogMessage(LogSeverity severity, const char* file, int line)
    : severity_(severity), file_(file), line_(line) {
  const int rank = g_rank.load();
  if (rank >= 0) stream_ << "[rank " << rank << "/" << g_world.load() << "] ";
}

LogMessage::~LogMessage() {
  const int glog_severity = severity_ == LogSeverity::kInfo      ? google::GLOG_INFO
                            : severity_ == LogSeverity::kWarning ? google::GLOG_WARNING
                                                                 : google::GLOG_ERROR;
  google::LogMessage(file_, line_, glog_severity).stream() << stream_.str();
}

}  // namespace internal
}  // namespace fulcrum
