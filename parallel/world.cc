#include "parallel/world.h"

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "core/status.h"

namespace fulcrum::parallel {
namespace {

constexpr int kDefaultMasterPort = 29500;
constexpr char kLocalHost[] = "127.0.0.1";

// An environment variable's value; unset and empty are the same (an exported but blank
// variable from a job script means "not given").
std::optional<std::string> GetEnv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

absl::StatusOr<int> ParseInt(const char* name, const std::string& value) {
  int result = 0;
  if (!absl::SimpleAtoi(value, &result)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s=\"%s\" is not an integer", name, value));
  }
  return result;
}

// Reads `name` as an integer >= `min`; `fallback` when unset.
absl::StatusOr<int> IntFromEnv(const char* name, int min, std::optional<int> fallback) {
  std::optional<std::string> value = GetEnv(name);
  if (!value) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(absl::StrFormat("%s is not set", name));
  }
  FULCRUM_ASSIGN_OR_RETURN(int result, ParseInt(name, *value));
  if (result < min) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s=%d must be at least %d", name, result, min));
  }
  return result;
}

// Checks 0 <= rank < size for a (rank, size) pair of variables.
absl::Status CheckBelow(const char* rank_name, int rank, const char* size_name, int size) {
  if (rank >= size) {
    return absl::InvalidArgumentError(absl::StrFormat("%s=%d must be less than %s=%d",
                                                      rank_name, rank, size_name, size));
  }
  return absl::OkStatus();
}

// Tasks on each node from SLURM's compressed per-node counts, e.g. "4" or "4(x2),3"
// (two nodes with 4 tasks, then one with 3), indexed by node.
absl::StatusOr<std::vector<int>> ExpandSlurmTaskCounts(const char* name,
                                                       const std::string& value) {
  std::vector<int> counts;
  for (absl::string_view item : absl::StrSplit(value, ',')) {
    absl::string_view count_text = item;
    int repeat = 1;
    if (size_t open = item.find("(x"); open != absl::string_view::npos) {
      absl::string_view repeat_text = item.substr(open + 2);
      if (!absl::ConsumeSuffix(&repeat_text, ")") || !absl::SimpleAtoi(repeat_text, &repeat) ||
          repeat < 1) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s=\"%s\" is not a task count list like \"4\" or \"4(x2),3\"", name, value));
      }
      count_text = item.substr(0, open);
    }
    int count = 0;
    if (!absl::SimpleAtoi(count_text, &count) || count < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s=\"%s\" is not a task count list like \"4\" or \"4(x2),3\"", name, value));
    }
    counts.insert(counts.end(), repeat, count);
  }
  return counts;
}

// The first host of a SLURM node list: "node[03-05,7],gpu1" -> "node03". Each bracket
// group contributes its first entry (a range's start keeps its zero padding), so
// "rack[1-2]-n[08-09]" -> "rack1-n08". Hand-written because neither libslurm nor
// `scontrol show hostnames` can be assumed on the machine running the job.
absl::StatusOr<std::string> FirstSlurmHost(const char* name, const std::string& node_list) {
  const auto malformed = [&] {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s=\"%s\" is not a SLURM node list like \"node[03-05,7]\"", name, node_list));
  };
  std::string host;
  size_t i = 0;
  while (i < node_list.size() && node_list[i] != ',') {
    if (node_list[i] == ']') return malformed();
    if (node_list[i] != '[') {
      host += node_list[i++];
      continue;
    }
    const size_t close = node_list.find(']', i);
    // A bracket group needs a host name prefix before it ("node[1-2]", not "[1-2]").
    if (close == std::string::npos || host.empty()) return malformed();
    absl::string_view group(node_list.data() + i + 1, close - i - 1);
    absl::string_view first = group.substr(0, group.find_first_of(",-"));
    if (first.empty() || first.find('[') != absl::string_view::npos) return malformed();
    host.append(first.data(), first.size());
    i = close + 1;
  }
  if (host.empty()) return malformed();
  return host;
}

absl::StatusOr<WorldInfo> FromTorchrun() {
  WorldInfo info;
  info.source = "torchrun";
  if (!GetEnv("RANK") || !GetEnv("WORLD_SIZE")) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is set but %s is not; torchrun and fulcrum_launch set both",
        GetEnv("RANK") ? "RANK" : "WORLD_SIZE", GetEnv("RANK") ? "WORLD_SIZE" : "RANK"));
  }
  FULCRUM_ASSIGN_OR_RETURN(info.world_size, IntFromEnv("WORLD_SIZE", 1, std::nullopt));
  FULCRUM_ASSIGN_OR_RETURN(info.rank, IntFromEnv("RANK", 0, std::nullopt));
  FULCRUM_RETURN_IF_ERROR(CheckBelow("RANK", info.rank, "WORLD_SIZE", info.world_size));
  // Without the local variables (a hand-written launcher), assume one node.
  FULCRUM_ASSIGN_OR_RETURN(info.local_world_size,
                           IntFromEnv("LOCAL_WORLD_SIZE", 1, info.world_size));
  FULCRUM_ASSIGN_OR_RETURN(info.local_rank,
                           IntFromEnv("LOCAL_RANK", 0, info.rank % info.local_world_size));
  FULCRUM_RETURN_IF_ERROR(
      CheckBelow("LOCAL_RANK", info.local_rank, "LOCAL_WORLD_SIZE", info.local_world_size));
  if (info.local_world_size > info.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LOCAL_WORLD_SIZE=%d must not exceed WORLD_SIZE=%d",
                        info.local_world_size, info.world_size));
  }
  // torchrun's elastic agent writes Python's str(True).
  if (std::optional<std::string> agent = GetEnv("TORCHELASTIC_USE_AGENT_STORE")) {
    info.agent_store = *agent == "True" || *agent == "true" || *agent == "1";
  }
  FULCRUM_ASSIGN_OR_RETURN(info.restart_count,
                           IntFromEnv("TORCHELASTIC_RESTART_COUNT", 0, 0));
  return info;
}

absl::StatusOr<WorldInfo> FromSlurm() {
  WorldInfo info;
  info.source = "slurm";
  FULCRUM_ASSIGN_OR_RETURN(info.world_size, IntFromEnv("SLURM_NTASKS", 1, std::nullopt));
  FULCRUM_ASSIGN_OR_RETURN(info.rank, IntFromEnv("SLURM_PROCID", 0, std::nullopt));
  FULCRUM_RETURN_IF_ERROR(CheckBelow("SLURM_PROCID", info.rank, "SLURM_NTASKS", info.world_size));
  FULCRUM_ASSIGN_OR_RETURN(info.local_rank, IntFromEnv("SLURM_LOCALID", 0, 0));

  // srun sets SLURM_STEP_TASKS_PER_NODE for the step this process belongs to; the others
  // describe the allocation (SLURM_NTASKS_PER_NODE only with --ntasks-per-node, and then as
  // an upper bound), so they are fallbacks. All may list several nodes.
  const char* counts_name = nullptr;
  std::optional<std::string> counts_value;
  for (const char* name :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    counts_name = name;
    if ((counts_value = GetEnv(name))) break;
  }
  if (counts_value) {
    FULCRUM_ASSIGN_OR_RETURN(std::vector<int> counts,
                             ExpandSlurmTaskCounts(counts_name, *counts_value));
    FULCRUM_ASSIGN_OR_RETURN(int node, IntFromEnv("SLURM_NODEID", 0, 0));
    // A single count applies to every node ("4" with --ntasks-per-node=4 on 8 nodes).
    if (counts.size() == 1) node = 0;
    if (node >= static_cast<int>(counts.size())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("SLURM_NODEID=%d has no entry in %s=\"%s\"", node, counts_name,
                          *counts_value));
    }
    info.local_world_size = counts[node];
    if (info.local_world_size > info.world_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s=\"%s\" puts %d tasks on this node but SLURM_NTASKS=%d",
                          counts_name, *counts_value, info.local_world_size, info.world_size));
    }
  } else {
    FULCRUM_ASSIGN_OR_RETURN(int nodes, IntFromEnv("SLURM_NNODES", 1, 1));
    if (nodes > 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "SLURM_NNODES=%d but neither SLURM_STEP_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE "
          "says how many tasks run on this node",
          nodes));
    }
    info.local_world_size = info.world_size;
    counts_name = "SLURM_NTASKS";
  }
  FULCRUM_RETURN_IF_ERROR(CheckBelow("SLURM_LOCALID", info.local_rank, counts_name,
                                     info.local_world_size));
  return info;
}

// Rank 0's host under srun, which hosts the rendezvous store. srun's default block
// distribution places rank 0 on the first node of the step, so the node list comes first;
// the launch node (SLURM_LAUNCH_NODE_IPADDR) is only a fallback because under salloc it is
// the login node, where no rank runs.
absl::StatusOr<std::string> SlurmMasterAddr(const WorldInfo& info) {
  for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}) {
    if (std::optional<std::string> node_list = GetEnv(name)) {
      return FirstSlurmHost(name, *node_list);
    }
  }
  if (std::optional<std::string> launch_node = GetEnv("SLURM_LAUNCH_NODE_IPADDR")) {
    return *launch_node;
  }
  if (info.local_world_size < info.world_size) {
    return absl::InvalidArgumentError(
        "neither MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_NODELIST nor "
        "SLURM_LAUNCH_NODE_IPADDR names rank 0's host in a multi-node SLURM job");
  }
  return std::string(kLocalHost);
}

absl::StatusOr<WorldInfo> FromOpenMpi() {
  WorldInfo info;
  info.source = "openmpi";
  FULCRUM_ASSIGN_OR_RETURN(info.world_size,
                           IntFromEnv("OMPI_COMM_WORLD_SIZE", 1, std::nullopt));
  FULCRUM_ASSIGN_OR_RETURN(info.rank, IntFromEnv("OMPI_COMM_WORLD_RANK", 0, std::nullopt));
  FULCRUM_RETURN_IF_ERROR(CheckBelow("OMPI_COMM_WORLD_RANK", info.rank, "OMPI_COMM_WORLD_SIZE",
                                     info.world_size));
  FULCRUM_ASSIGN_OR_RETURN(info.local_world_size,
                           IntFromEnv("OMPI_COMM_WORLD_LOCAL_SIZE", 1, info.world_size));
  FULCRUM_ASSIGN_OR_RETURN(
      info.local_rank,
      IntFromEnv("OMPI_COMM_WORLD_LOCAL_RANK", 0, info.rank % info.local_world_size));
  FULCRUM_RETURN_IF_ERROR(CheckBelow("OMPI_COMM_WORLD_LOCAL_RANK", info.local_rank,
                                     "OMPI_COMM_WORLD_LOCAL_SIZE", info.local_world_size));
  if (info.local_world_size > info.world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("OMPI_COMM_WORLD_LOCAL_SIZE=%d must not exceed OMPI_COMM_WORLD_SIZE=%d",
                        info.local_world_size, info.world_size));
  }
  return info;
}

}  // namespace

absl::StatusOr<WorldInfo> WorldInfoFromEnvironment() {
  WorldInfo info;
  if (GetEnv("RANK") || GetEnv("WORLD_SIZE")) {
    FULCRUM_ASSIGN_OR_RETURN(info, FromTorchrun());
  } else if (GetEnv("SLURM_PROCID")) {
    FULCRUM_ASSIGN_OR_RETURN(info, FromSlurm());
  } else if (GetEnv("OMPI_COMM_WORLD_RANK")) {
    FULCRUM_ASSIGN_OR_RETURN(info, FromOpenMpi());
  }

  if (std::optional<std::string> addr = GetEnv("MASTER_ADDR")) {
    info.master_addr = *addr;
  } else if (info.source == "slurm") {
    FULCRUM_ASSIGN_OR_RETURN(info.master_addr, SlurmMasterAddr(info));
  } else if (info.local_world_size < info.world_size) {
    // 127.0.0.1 is right only when every rank shares this host; on several nodes the others
    // would wait on their own loopback until the rendezvous timeout.
    return absl::InvalidArgumentError(absl::StrFormat(
        "MASTER_ADDR is not set but the %s job spans several nodes (world size %d, %d "
        "processes on this node); set it to rank 0's host",
        info.source, info.world_size, info.local_world_size));
  } else {
    info.master_addr = kLocalHost;
  }

  if (std::optional<std::string> port = GetEnv("MASTER_PORT")) {
    FULCRUM_ASSIGN_OR_RETURN(info.master_port, ParseInt("MASTER_PORT", *port));
    if (info.master_port < 1 || info.master_port > 65535) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "MASTER_PORT=%d is not a TCP port (expected 1..65535)", info.master_port));
    }
  } else {
    info.master_port = kDefaultMasterPort;
  }
  return info;
}

}  // namespace fulcrum::parallel
