// How many threads a process computes with. LibTorch's intra-op pool and OpenBLAS (Debian's
// libopenblas0-pthread keeps its own pool, which at::set_num_threads does not change) are
// set together, so a GEMM and an elementwise op use the same number of cores.
#pragma once

namespace fulcrum {

/// Sets LibTorch's intra-op threads and OpenBLAS's to `n`; returns OpenBLAS's count after
/// (-1 when the process has no OpenBLAS).
int SetComputeThreads(int n);

/// OpenBLAS's thread count (-1 when the process has no OpenBLAS).
int BlasThreads();

}  // namespace fulcrum
