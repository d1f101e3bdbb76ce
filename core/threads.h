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
// LibTorch's intra-op pool is libgomp's, and Debian's OpenBLAS keeps a pthread pool of its
// own. With both at 2 threads on 2 cores, libgomp's workers spin after every parallel
// region (with OMP_WAIT_POLICY unset, 300,000 iterations before they sleep; ACTIVE spins
// far longer), on the cores OpenBLAS's threads need for the next GEMM: the tiny recipe ran 2.2x slower than on one thread, with 9.6 s of system
// time over 30 iterations against 0.2 s (measured 2026-11-25, `time fulcrum_train
// --train_iters=30 --num_threads=1|2`). OMP_WAIT_POLICY=PASSIVE makes the workers sleep
// instead, and the same run is then 1.29x faster than on one thread. libgomp reads the
// variable once, when it is loaded (before main), so a process that computes with more
// than one thread and finds it unset re-executes itself with it set.

/// When `threads` > 1 and $OMP_WAIT_POLICY is unset, sets OMP_WAIT_POLICY=PASSIVE and
/// re-executes this program (/proc/self/exe) with `argv`, the command line as main()
/// received it (before flag parsing removed anything). Returns only when there was nothing
/// to do, or when exec failed (the run then goes on with libgomp's default).
void ReexecWithPassiveOpenMpWait(int threads, const std::vector<std::string>& argv);

/// A program's thread set-up, first thing in main: ReexecWithPassiveOpenMpWait (may not
/// return), then SetComputeThreads(choice.threads).
void SetUpComputeThreads(const ThreadChoice& choice, const std::vector<std::string>& argv);

/// For the log: "2 (--num_threads; LibTorch 2, OMP_WAIT_POLICY PASSIVE)".
std::string DescribeComputeThreads(const ThreadChoice& choice);

}  // namespace fulcrum
