#include "core/threads.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/usable_cores.h"

namespace fulcrum {

void SetComputeThreads(int n) { at::set_num_threads(n); }

namespace {

// $OMP_WAIT_POLICY, or null when it is unset or empty (libgomp's default then).
const char* WaitPolicy() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return policy != nullptr && *policy != '\0' ? policy : nullptr;
}

}  // namespace

ThreadChoice DefaultComputeThreads() {
  int from_env = 0;
  if (const char* env = std::getenv("OMP_NUM_THREADS");
      env != nullptr && absl::SimpleAtoi(env, &from_env) && from_env > 0) {
    return {from_env, "$OMP_NUM_THREADS"};
  }
  const int cores = UsableCores();
  return {cores, absl::StrCat("all ", cores, " cores this process may use")};
}

std::string DescribeComputeThreads(const ThreadChoice& choice) {
  const char* policy = WaitPolicy();
  return absl::StrCat(choice.threads, " (", choice.source, "; LibTorch ", at::get_num_threads(),
                      ", OMP_WAIT_POLICY ",
                      policy != nullptr ? policy : "unset", ")");
}

}  // namespace fulcrum
