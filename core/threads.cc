#include "core/threads.h"

#include <dlfcn.h>

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

}  // namespace fulcrum
