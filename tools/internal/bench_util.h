// Helpers the benchmark tools share (their command line is recipes/cli.h's, as every
// tool's): the usage-error exit code, parsing of list flags, the machine's state
// that every benchmark prints beside its numbers (usable cores, load average), medians,
// alternated timing rounds, and running the real binaries (fulcrum_launch, fulcrum_train)
// that sit next to the tool.
//
// Header-only: each tool is one executable built from its own main file.
// Thread-safety: none needed; these run on the tool's main thread.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/usable_cores.h"

extern char** environ;

namespace fulcrum::bench {

/// Exit code of a tool given bad flags (gflags' own is 1, the code of a failed run).
constexpr int kUsageError = 2;

/// The median of `v`; NaN for an empty `v`.
inline double Median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// Per-round times (ms) of two implementations and their ratios a / b.
struct PairedRounds {
  std::vector<double> a, b, ratio;
};

/// Runs `a` and `b` (each returns its milliseconds) `rounds` times, alternating which goes
/// first so drift in the machine's load hits both alike.
inline PairedRounds AlternateRounds(int rounds, const std::function<double()>& a,
                                    const std::function<double()>& b) {
  PairedRounds out;
  for (int r = 0; r < rounds; ++r) {
    double ta, tb;
    if (r % 2 == 0) {
      ta = a();
      tb = b();
    } else {
      tb = b();
      ta = a();
    }
    out.a.push_back(ta);
    out.b.push_back(tb);
    out.ratio.push_back(ta / tb);
  }
  return out;
}

/// The cores this process may run on (core/usable_cores.h).
using ::fulcrum::UsableCores;

/// The 1-minute load average (/proc/loadavg); false where there is none.
inline bool ReadLoadAverage(double* load) {
  std::ifstream in("/proc/loadavg");
  return static_cast<bool>(in >> *load);
}

/// The directory of this executable (where fulcrum_launch and fulcrum_train are built).
inline std::string BinDir(const char* argv0) {
  std::string self(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", self.data(), self.size());
  self = n > 0 ? self.substr(0, n) : std::string(argv0);
  const size_t slash = self.find_last_of('/');
  return slash == std::string::npos ? "." : self.substr(0, slash);
}

/// Empty when every one of `tools` is an executable in `bin_dir`; else the message.
inline std::string MissingTools(const std::string& bin_dir, const std::vector<std::string>& tools) {
  for (const std::string& tool : tools) {
    const std::string path = bin_dir + "/" + tool;
    if (access(path.c_str(), X_OK) != 0) {
      return absl::StrCat(path, " not found (build it next to this tool)");
    }
  }
  return "";
}

/// The last `max_chars` characters of a file (a failed run's log).
inline std::string FileTail(const std::string& path, size_t max_chars = 2000) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string all = text.str();
  return all.size() > max_chars ? all.substr(all.size() - max_chars) : all;
}

/// `args` as one line a POSIX shell would run unchanged (for the printed command lines).
inline std::string ShellCommand(const std::vector<std::string>& args) {
  std::string line;
  for (const std::string& arg : args) {
    if (!line.empty()) line += ' ';
    const bool plain =
        !arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                              "0123456789_-+=./,:@%") == std::string::npos;
    if (plain) {
      line += arg;
    } else {
      line += '\'';
      for (char c : arg) line += c == '\'' ? std::string("'\\''") : std::string(1, c);
      line += '\'';
    }
  }
  return line;
}

/// Runs `args` (args[0] a path) with this process's environment, stdout and stderr to
/// `log_path`, and waits. Returns its exit code (128 + signal when killed), or -1 with
/// `error` set when it could not be started. No shell: arguments reach it as given.
inline int RunLogged(const std::vector<std::string>& args, const std::string& log_path,
                     std::string* error) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    *error = absl::StrCat("cannot start ", args[0], ": ", std::strerror(spawned));
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *error = absl::StrCat("waitpid(", args[0], "): ", std::strerror(errno));
      return -1;
    }
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1;
}

/// "2,4" -> {2, 4}, each >= `min`; nullopt (with `error`) otherwise.
inline std::optional<std::vector<int>> ParseInts(const std::string& flag, const std::string& text,
                                                 int min, std::string* error) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int value;
    if (!absl::SimpleAtoi(part, &value) || value < min) {
      *error = absl::StrCat("--", flag, "='", text, "': '", part, "' is not an integer >= ", min);
      return std::nullopt;
    }
    out.push_back(value);
  }
  if (out.empty()) {
    *error = absl::StrCat("--", flag, " is empty");
    return std::nullopt;
  }
  return out;
}

}  // namespace fulcrum::bench
