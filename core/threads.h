// How many threads a process computes with. LibTorch 2.11 (torch's wheel) computes its GEMMs
// with MKL and oneDNN under the same OpenMP runtime (libgomp) as its elementwise ops, so
// at::set_num_threads sets them all.
#pragma once

#include <string>
#include <vector>

namespace fulcrum {

/// Sets LibTorch's intra-op threads (OpenMP, MKL, oneDNN) to `n`.
void SetComputeThreads(int n);

/// A thread count and where it came from (a flag, the environment, the cores).
struct ThreadChoice {
  int threads = 1;
  std::string source;  ///< "$OMP_NUM_THREADS" or "all N cores this process may use".
};

/// $OMP_NUM_THREADS when it is a positive integer (fulcrum_launch sets it to the cores per
/// process; ctest sets 1), else every core the process's CPU affinity allows. LibTorch's
/// own default is not used: a single-process run should use the whole machine, and the
/// count should be one the log can name.
ThreadChoice DefaultComputeThreads();

// NOTE [OpenMP wait policy]
// Fulcrum leaves libgomp's wait policy alone. Under Debian's LibTorch 1.13, OpenBLAS kept a
// thread pool of its own beside libgomp's, libgomp's spinning workers took the cores
// OpenBLAS needed, and OMP_WAIT_POLICY=PASSIVE made 2 threads 2.2x faster; Fulcrum then set
// it (fulcrum_launch) or re-executed itself with it. LibTorch 2.11 computes its GEMMs with
// MKL in libgomp's own pool, and the passive wait now costs time: `fulcrum_train
// --train_iters=30 --num_threads=N` (tiny recipe, 2 cores, 3 interleaved rounds,
// 2026-11-25) took 4.78-4.98 s on 1 thread, 2.86-2.93 s on 2 threads with libgomp's
// default, 2.68-2.95 s with ACTIVE and 3.85-4.18 s with PASSIVE.

/// For the log: "2 (--num_threads; LibTorch 2, OMP_WAIT_POLICY unset)".
std::string DescribeComputeThreads(const ThreadChoice& choice);

}  // namespace fulcrum
