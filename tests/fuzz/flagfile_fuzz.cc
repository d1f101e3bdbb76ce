// Fuzzes the command line of Fulcrum's programs (recipes/cli.h) with the contents of a
// --flagfile: cli::ParseCommandLine checks every line with gflags' own value parser, then
// lets gflags parse, which "can no longer fail". So an input either is refused with
// exit code 2 or is parsed by gflags; gflags exiting the process (its reaction to a flag
// it rejects) is a bug, which libFuzzer reports as "fuzz target exited".
#include <gflags/gflags.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <streambuf>
#include <string>

#include "recipes/cli.h"
#include "tests/fuzz/fuzz_check.h"

// A flag of each type gflags has, as a program of ours defines them.
DEFINE_bool(fuzz_bool, false, "a bool");
DEFINE_int32(fuzz_int32, 0, "an int32");
DEFINE_uint32(fuzz_uint32, 0, "a uint32");
DEFINE_int64(fuzz_int64, 0, "an int64");
DEFINE_uint64(fuzz_uint64, 0, "a uint64");
DEFINE_double(fuzz_double, 0, "a double");
DEFINE_string(fuzz_string, "", "a string");

namespace {

// Swallows what it is given.
class NullBuffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
};

const std::string& FlagfilePath() {
  static const std::string path = [] {
    char pattern[] = "/tmp/fulcrum_flagfile_fuzz_XXXXXX";
    const int fd = mkstemp(pattern);
    FULCRUM_FUZZ_CHECK(fd >= 0);
    close(fd);
    return std::string(pattern);
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // ParseCommandLine prints help and errors; thousands of lines a second only slow us down.
  static NullBuffer sink;
  std::cout.rdbuf(&sink);
  std::cerr.rdbuf(&sink);
  std::atexit([] { std::remove(FlagfilePath().c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Each input starts from the defaults: the checks set flags as they go, and a program
  // refusing its flags exits, so what one input set must not carry over to the next.
  gflags::FlagSaver saver;
  {
    std::ofstream out(FlagfilePath(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  // A flag file naming another file (or itself) is followed, as users' files are.
  std::string flagfile = "--flagfile=" + FlagfilePath();
  std::string program = "fulcrum_fuzz";
  char* args[] = {program.data(), flagfile.data(), nullptr};
  int argc = 2;
  char** argv = args;
  fulcrum::cli::HelpSpec spec;
  spec.program = "fulcrum_fuzz";
  const std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, spec);
  FULCRUM_FUZZ_CHECK(!exit_code.has_value() || *exit_code == 0 || *exit_code == 2);
  return 0;
}
