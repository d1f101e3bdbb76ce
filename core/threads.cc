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

int ResolveThreadCount(int requested, std::optional<int> omp_num_threads, int usable_cores,
                       int local_processes) {
  if (requested > 0) return requested;
  if (omp_num_threads.has_value() && *omp_num_threads > 0) return *omp_num_threads;
  return std::max(1, usable_cores / std::max(1, local_processes));
}

int SetComputeThreads(int n) {
  at::set_num_threads(n);
  // Looked up at run time: the symbols exist only when OpenBLAS is the BLAS LibTorch loaded.
  using SetFn = void (*)(int);
  using GetFn = int (*)();
  auto set = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  auto get = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (set != nullptr) set(n);
  return get != nullptr ? get() : -1;
}

}  // namespace fulcrum
