#include "core/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"

namespace fulcrum {

// Looked up at run time: the symbols exist only when OpenBLAS is the BLAS LibTorch loaded.
int BlasThreads() {
  using GetFn = int (*)();
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}

int SetComputeThreads(int n) {
  at::set_num_threads(n);
  using SetFn = void (*)(int);
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set != nullptr) set(n);
  return BlasThreads();
}

ThreadChoice DefaultComputeThreads() {
  int from_env = 0;
  if (const char* env = std::getenv("OMP_NUM_THREADS");
      env != nullptr && absl::SimpleAtoi(env, &from_env) && from_env > 0) {
    return {from_env, "$OMP_NUM_THREADS"};
  }
  int cores = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores <= 0) cores = 1;
  return {cores, absl::StrCat("all ", cores, " cores this process may use")};
}

void ReexecWithPassiveOpenMpWait(int threads, const std::vector<std::string>& argv) {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (threads <= 1 || (policy != nullptr && *policy != '\0') || argv.empty()) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  unsetenv("OMP_WAIT_POLICY");  // not in effect: the log must not say it is
  FULCRUM_LOG(WARNING) << "could not re-execute with OMP_WAIT_POLICY=PASSIVE (NOTE [OpenMP "
                          "wait policy] in core/threads.h); set it in the environment";
}

void SetUpComputeThreads(const ThreadChoice& choice, const std::vector<std::string>& argv) {
  ReexecWithPassiveOpenMpWait(choice.threads, argv);
  SetComputeThreads(choice.threads);
}

std::string DescribeComputeThreads(const ThreadChoice& choice) {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return absl::StrCat(choice.threads, " (", choice.source, "; LibTorch ", at::get_num_threads(),
                      ", OpenBLAS ", BlasThreads(), ", OMP_WAIT_POLICY ",
                      policy != nullptr && *policy != '\0' ? policy : "unset", ")");
}

}  // namespace fulcrum
