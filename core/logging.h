// The project's one logging header. Only core/logging.cc includes glog, so glog's macros
// never meet LibTorch's own logging macros in a translation unit.
//
//   FULCRUM_LOG(INFO) << "iteration " << it;
//   FULCRUM_LOG(WARNING) << ...;   FULCRUM_LOG(ERROR) << ...;
//
// Every line is prefixed with the process's rank once SetLogRank() was called.
// Thread-safe: each message is assembled in its own stream and handed to glog whole.
#pragma once

#include <sstream>
#include <string>

namespace fulcrum {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2 };

/// Initialises glog for this process (stderr output, no log files). Call once from main.
void InitLogging(const char* argv0);

/// Sets the rank (and world size) shown at the start of every log line; -1 hides it.
void SetLogRank(int rank, int world_size);

namespace internal {

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

}  // namespace internal
}  // namespace fulcrum

#define FULCRUM_LOG_SEVERITY_INFO ::fulcrum::LogSeverity::kInfo
#define FULCRUM_LOG_SEVERITY_WARNING ::fulcrum::LogSeverity::kWarning
#define FULCRUM_LOG_SEVERITY_ERROR ::fulcrum::LogSeverity::kError

#define FULCRUM_LOG(severity) \
  ::fulcrum::internal::LogMessage(FULCRUM_LOG_SEVERITY_##severity, __FILE__, __LINE__).stream()
