#include "core/malloc_tuning.h"

#include <algorithm>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fulcrum {

bool KeepStepMemoryInHeap(size_t mmap_threshold) {
#if defined(__GLIBC__)
  // Setting either value also turns off glibc's own adjustment of both (which raises the
  // threshold only after a block has already gone back to the OS once).
  const int threshold = static_cast<int>(std::min<size_t>(mmap_threshold, size_t{32} << 20));
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, threshold) == 1;
  // The heap's free top is kept: at most a step's peak, which the next step needs again.
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  return mmap_ok && trim_ok;
#else
  (void)mmap_threshold;
  return false;
#endif
}

}  // namespace fulcrum
