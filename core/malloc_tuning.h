// How the C library's malloc treats the large, same-sized blocks a training step frees and
// asks for again. LibTorch's CPU allocator is plain malloc, so with glibc's defaults every
// block of the size of the logits ([tokens, vocab] fp32: 31 MiB at gpt_8k) is freed back to
// the OS at the end of a step (munmap, or a heap trim) and faulted in again, page by page,
// the next step. Process-wide: call it once from `main`, before training.
#pragma once

#include <cstddef>

namespace fulcrum {

/// Serves blocks up to `mmap_threshold` bytes from the heap and never trims the heap's top
/// (glibc's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), so freed step memory is reused without page
/// faults. glibc caps the threshold at 32 MiB on 64-bit; larger requests are clamped.
/// Returns false where the C library is not glibc or refused a setting.
bool KeepStepMemoryInHeap(size_t mmap_threshold = size_t{32} << 20);

}  // namespace fulcrum
