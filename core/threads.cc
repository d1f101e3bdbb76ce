#include "core/threads.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>

namespace fulcrum {

int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

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

}  // namespace fulcrum
