// The cores this process may run on: its CPU affinity mask (what taskset, cgroups cpusets or
// SLURM's --cpus-per-task grant), which can be far fewer than the machine has; thread pools
// and per-process thread counts are sized from it.
// Header-only and free of LibTorch, so the launcher and the benchmark tools use it too.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>

namespace fulcrum {

/// At least 1: the affinity mask's count, else the online processors.
inline int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

}  // namespace fulcrum
