// Who this process is in the job: rank, world size, local rank and where the rendezvous
// master listens, read from the environment the way torchrun (and fulcrum_launch), SLURM
// (srun) and Open MPI (mpirun) set it.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace fulcrum::parallel {

struct WorldInfo {
  int rank = 0;                    // Global rank, 0..world_size-1.
  int world_size = 1;
  int local_rank = 0;              // Rank among the processes of this node.
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // Rank 0's host: the rendezvous store listens here.
  int master_port = 29500;
  std::string source = "single";   // Which environment supplied it: "torchrun", "slurm",
                                   // "openmpi" or "single" (no launcher: one process).
  // Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True) the agent already
  // hosts a c10d TCPStore at MASTER_ADDR:MASTER_PORT: the ranks join it as clients instead
  // of rank 0 hosting one (parallel/rendezvous.h).
  bool agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT: each restart keys the store afresh.
};

/// Reads who this process is from the first launcher whose variables are present (a
/// variable set to the empty string counts as unset):
///  - torchrun / fulcrum_launch: RANK and WORLD_SIZE (both required), LOCAL_RANK and
///    LOCAL_WORLD_SIZE (default: one node, local_rank = rank); torchrun's
///    TORCHELASTIC_USE_AGENT_STORE ("True") and TORCHELASTIC_RESTART_COUNT.
///  - srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; tasks on this node from
///    SLURM_STEP_TASKS_PER_NODE, else SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE
///    ("4" or "4(x2),3", indexed by SLURM_NODEID); master address from the first host of
///    SLURM_STEP_NODELIST / SLURM_NODELIST ("node[03-05,7]" -> "node03"), else
///    SLURM_LAUNCH_NODE_IPADDR.
///  - mpirun (Open MPI): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE.
///  - none of them: a single process (rank 0 of 1).
/// MASTER_ADDR and MASTER_PORT (default 29500) override what the launcher implies; without
/// MASTER_ADDR a torchrun/MPI job on one node uses 127.0.0.1 and one spanning several nodes
/// is an error. Inconsistent values (rank >= world size, a non-numeric variable, a port
/// outside 1..65535, ...) are InvalidArgument naming the variable and its value.
/// Thread-safety: reads the environment; do not call while another thread runs setenv().
absl::StatusOr<WorldInfo> WorldInfoFromEnvironment();

}  // namespace fulcrum::parallel
