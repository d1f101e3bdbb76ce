// How many threads a process computes with. LibTorch's intra-op pool and OpenBLAS (Debian's
// libopenblas0-pthread keeps its own pool, which at::set_num_threads does not change) are
// set together, so a GEMM and an elementwise op use the same number of cores.
#pragma once
#include <optional>

namespace fulcrum {

/// The cores this process may run on (its affinity mask), at least 1.
int UsableCores();

/// The thread count a process should use: `requested` when > 0; else OMP_NUM_THREADS
/// (`omp_num_threads`) when set to a positive integer; else the usable cores shared out
/// over the `local_processes` of this node (at least 1).
int ResolveThreadCount(int requested, std::optional<int> omp_num_threads, int usable_cores,
                       int local_processes);

/// Sets LibTorch's intra-op threads and OpenBLAS's to `n`; returns OpenBLAS's count after
/// (-1 when the process has no OpenBLAS).
int SetComputeThreads(int n);

}  // namespace fulcrum
