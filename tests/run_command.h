// Running a command line from a test (the project's binaries, fulcrum_launch): one helper
// for every test binary, with no dependencies beyond the C library.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace fulcrum::testing {

/// Runs `command` through /bin/sh with stderr joined to stdout. Returns the exit code,
/// 128 + the signal when it was killed, or -1 when it could not start; `output` gets what
/// it printed (or why it could not start).
inline int RunCommand(const std::string& command, std::string* output) {
  output->clear();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) {
    *output = "popen failed for: " + command;
    return -1;
  }
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output->append(buffer.data(), n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace fulcrum::testing
