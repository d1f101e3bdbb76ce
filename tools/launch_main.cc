// fulcrum_launch: starts the processes of one node of a distributed job, like torchrun.
//
//   fulcrum_launch --nproc_per_node=4 -- ./fulcrum_train --recipe=tiny
//   fulcrum_launch --nnodes=2 --node_rank=1 --master_addr=node0 --nproc_per_node=8 -- ...
//
// Each rank finds its place in the job through the environment (parallel/world.h reads
// it). The supervision — output prefixes, signal forwarding, tearing down the node when a
// rank fails — lives in tools/internal/launch_supervisor.h.
#include <gflags/gflags.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <cmath>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/usable_cores.h"
#include "recipes/relaunch_protocol.h"
#include "tools/internal/launch_supervisor.h"

extern char** environ;

DEFINE_int32(nproc_per_node, 1,
             "Processes to start on this node (one per GPU; on CPU, one per group of cores).");
DEFINE_int32(nnodes, 1, "Nodes in the job; each runs its own fulcrum_launch.");
DEFINE_int32(node_rank, 0,
             "This node's index, 0..nnodes-1: it runs ranks node_rank*nproc_per_node up to "
             "(node_rank+1)*nproc_per_node-1.");
DEFINE_string(master_addr, "127.0.0.1",
              "Host of rank 0, where the rendezvous store listens. With --nnodes>1, node 0's "
              "address as the other nodes reach it.");
DEFINE_int32(master_port, 29500,
             "Port of the rendezvous store. 0 picks a free port on this host (only with "
             "--nnodes=1: other nodes could not learn it).");
DEFINE_double(kill_timeout_s, 5,
              "Seconds the ranks get to exit after SIGTERM (when a rank failed or the launcher "
              "was signalled) before SIGKILL.");
DEFINE_double(stop_timeout_s, 120,
              "Seconds the ranks get, after a SIGINT/SIGTERM/SIGHUP the launcher forwarded, to "
              "finish their iteration, save and exit before SIGKILL (fulcrum_train stops "
              "gracefully on the first such signal).");
DEFINE_string(log_dir, "",
              "If set, each rank's output is also written to DIR/rank_K.log (created if "
              "missing; K is the global rank).");

namespace fulcrum {
namespace {

constexpr char kUsageText[] =
    R"(starts the processes of one node of a distributed job, like torchrun.

Usage:
  fulcrum_launch [--nproc_per_node=N] [--nnodes=M --node_rank=I --master_addr=HOST]
                 [--master_port=P] [--kill_timeout_s=S] [--stop_timeout_s=S] [--log_dir=DIR]
                 -- PROGRAM [ARGS...]

Each of the N processes gets in its environment:
  RANK=I*N+L  LOCAL_RANK=L  WORLD_SIZE=M*N  LOCAL_WORLD_SIZE=N  GROUP_RANK=I
  MASTER_ADDR  MASTER_PORT  and OMP_NUM_THREADS=max(1, usable cores / N) unless
  OMP_NUM_THREADS is already set (N processes with one thread per core each would
  oversubscribe the node many times over).
Its stdin is /dev/null. Every line it writes to stdout or stderr comes out whole on the
launcher's stdout or stderr, prefixed "[rank K] ".

When a process exits non-zero or dies from a signal, the others get SIGTERM (their whole
process group), then SIGKILL after --kill_timeout_s. SIGINT, SIGTERM and SIGHUP sent to
the launcher (a scheduler's pre-emption) are forwarded to every process, which get
--stop_timeout_s to stop (fulcrum_train finishes its iteration and saves); a second such
signal kills every process at once.

Re-packing through a checkpoint (fulcrum_train --repack_via_checkpoint): every process
gets FULCRUM_RELAUNCH_FILE=PATH. A process exiting with code 75 is not a failure: when
every process exited 0 or 75 and rank 0 wrote PATH ({"world_size": N, "args": [...]}),
the launcher starts N processes again with the same command followed by those args (the
smaller --pipeline_model_parallel_size and --load of the checkpoint). Only with --nnodes=1.

A live shrink (fulcrum_train --repack_script / --repack=auto) releases processes in
place: each leaves a marker in that directory and exits 0, reported as released; the
others go on, and a later failure still ends the job with its code.

Exit status: 0 when every process exits 0, also after a forwarded stop signal; otherwise
the first failure's code (128+S for signal S; 128+S too when the launcher was stopped by
signal S and a process did not exit 0); 2 for wrong usage.)";

constexpr int kUsageError = 2;

int UsageError(const std::string& message) {
  std::cerr << "fulcrum_launch: " << message << "\nRun `fulcrum_launch --help` for usage.\n";
  return kUsageError;
}

// Sets the launcher's flags from the arguments before the child command and stores the
// index of the command's first word in `program_index` (argc when there is none). The
// command starts after `--`, or else at the first argument that is neither a flag nor a
// flag's value, so `fulcrum_launch --nproc_per_node 2 ./train --lr=1` works too. Parsed
// here rather than by gflags::ParseCommandLineFlags, which would both take the program's
// own flags for ours and exit(1) on a mistake where a usage error must exit 2.
bool ParseLauncherFlags(int argc, char** argv, int* program_index, bool* help,
                        std::string* error) {
  *help = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t equals = arg.find('=');
    std::string name(arg.substr(0, equals));
    std::optional<std::string> value;
    if (equals != std::string_view::npos) value = std::string(arg.substr(equals + 1));
    if (name == "help" || name == "helpfull" || name == "helpshort" || name == "h") {
      *help = true;
      continue;
    }
    gflags::CommandLineFlagInfo info;
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      if (!value && absl::StartsWith(name, "no") &&
          gflags::GetCommandLineFlagInfo(name.c_str() + 2, &info) && info.type == "bool") {
        name = name.substr(2);
        value = "false";
      } else {
        *error = absl::StrFormat("unknown flag '%s'; a flag of PROGRAM goes after `--`",
                                 argv[i]);
        return false;
      }
    }
    if (!value) {
      if (info.type == "bool") {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        *error = absl::StrFormat("--%s needs a value (%s)", name, info.type);
        return false;
      }
    }
    if (gflags::SetCommandLineOption(name.c_str(), value->c_str()).empty()) {
      *error = absl::StrFormat("--%s=%s: expected a value of type %s", name, *value, info.type);
      return false;
    }
  }
  *program_index = i;
  return true;
}

// Checks the flags together; returns an error message or an empty string.
std::string ValidateFlags() {
  if (FLAGS_nproc_per_node < 1) {
    return absl::StrFormat("--nproc_per_node=%d must be at least 1", FLAGS_nproc_per_node);
  }
  if (FLAGS_nnodes < 1) return absl::StrFormat("--nnodes=%d must be at least 1", FLAGS_nnodes);
  if (FLAGS_node_rank < 0 || FLAGS_node_rank >= FLAGS_nnodes) {
    return absl::StrFormat("--node_rank=%d must be in 0..%d (--nnodes=%d)", FLAGS_node_rank,
                           FLAGS_nnodes - 1, FLAGS_nnodes);
  }
  if (static_cast<int64_t>(FLAGS_nnodes) * FLAGS_nproc_per_node > (1 << 20)) {
    return absl::StrFormat("--nnodes=%d × --nproc_per_node=%d is not a plausible world size",
                           FLAGS_nnodes, FLAGS_nproc_per_node);
  }
  if (FLAGS_master_port < 0 || FLAGS_master_port > 65535) {
    return absl::StrFormat("--master_port=%d is not a TCP port (expected 0..65535)",
                           FLAGS_master_port);
  }
  if (FLAGS_master_port == 0 && FLAGS_nnodes > 1) {
    return absl::StrFormat(
        "--master_port=0 (pick a free port) needs --nnodes=1, not %d: the other nodes could "
        "not learn the port; pass the same --master_port to every node",
        FLAGS_nnodes);
  }
  if (FLAGS_master_addr.empty()) return "--master_addr must not be empty";
  if (!(FLAGS_kill_timeout_s >= 0) || !std::isfinite(FLAGS_kill_timeout_s)) {
    return absl::StrFormat("--kill_timeout_s=%g must be a non-negative number of seconds",
                           FLAGS_kill_timeout_s);
  }
  if (!(FLAGS_stop_timeout_s >= 0) || !std::isfinite(FLAGS_stop_timeout_s)) {
    return absl::StrFormat("--stop_timeout_s=%g must be a non-negative number of seconds",
                           FLAGS_stop_timeout_s);
  }
  return "";
}

// Asks the kernel for a free TCP port by binding to port 0. The port is released before
// the ranks start, so another process could take it first; the window is milliseconds
// (torchrun accepts the same race), and then rank 0's store fails to bind, loudly.
std::optional<int> PickFreePort(std::string* error) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = absl::StrCat("socket: ", strerror(errno));
    return std::nullopt;
  }
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  std::optional<int> port;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    *error = absl::StrCat("bind: ", strerror(errno));
  } else if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    *error = absl::StrCat("getsockname: ", strerror(errno));
  } else {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

// Creates `path` and its missing parents, like `mkdir -p`.
bool MakeDirectories(const std::string& path, std::string* error) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      *error = absl::StrFormat("cannot create %s: %s", prefix, strerror(errno));
      return false;
    }
    if (slash == std::string::npos) break;
  }
  struct stat info;
  if (stat(path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    *error = absl::StrFormat("%s is not a directory", path);
    return false;
  }
  return true;
}

// The environment of local rank `local_rank` of `nproc`: the launcher's own, with the
// rendezvous variables replaced.
std::vector<std::string> ChildEnvironment(int local_rank, int nproc, int master_port,
                                          const std::string& relaunch_file) {
  std::vector<std::pair<std::string, std::string>> assigned = {
      {"RANK", absl::StrCat(FLAGS_node_rank * nproc + local_rank)},
      {"LOCAL_RANK", absl::StrCat(local_rank)},
      {"WORLD_SIZE", absl::StrCat(FLAGS_nnodes * nproc)},
      {"LOCAL_WORLD_SIZE", absl::StrCat(nproc)},
      {"GROUP_RANK", absl::StrCat(FLAGS_node_rank)},
      {"MASTER_ADDR", FLAGS_master_addr},
      {"MASTER_PORT", absl::StrCat(master_port)},
      {kRelaunchFileEnv, relaunch_file},
  };
  const char* omp_threads = getenv("OMP_NUM_THREADS");
  if (omp_threads == nullptr || *omp_threads == '\0') {
    assigned.emplace_back("OMP_NUM_THREADS", absl::StrCat(std::max(1, UsableCores() / nproc)));
  }
  std::vector<std::string> env;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view name = std::string_view(*entry).substr(0, strcspn(*entry, "="));
    const bool replaced = std::any_of(assigned.begin(), assigned.end(),
                                      [&](const auto& kv) { return kv.first == name; });
    if (!replaced) env.emplace_back(*entry);
  }
  for (const auto& [name, value] : assigned) env.push_back(absl::StrCat(name, "=", value));
  return env;
}

int Main(int argc, char** argv) {
  gflags::SetUsageMessage(kUsageText);
  int program_index = argc;
  bool help = false;
  std::string error;
  if (!ParseLauncherFlags(argc, argv, &program_index, &help, &error)) return UsageError(error);
  if (help) {
    gflags::ShowUsageWithFlagsRestrict(argv[0], "launch_main");
    return 0;
  }
  if (program_index >= argc) {
    return UsageError(
        "no program to run; put it after `--`, e.g. fulcrum_launch --nproc_per_node=2 -- "
        "./fulcrum_train");
  }
  if (error = ValidateFlags(); !error.empty()) return UsageError(error);
  if (!FLAGS_log_dir.empty() && !MakeDirectories(FLAGS_log_dir, &error)) {
    return UsageError(absl::StrCat("--log_dir: ", error));
  }

  int master_port = FLAGS_master_port;
  if (master_port == 0) {
    std::optional<int> port = PickFreePort(&error);
    if (!port) {
      std::cerr << "fulcrum_launch: cannot pick a free port for --master_port=0: " << error
                << "\n";
      return 1;
    }
    master_port = *port;
  }

  // NOTE [relaunch protocol] (recipes/relaunch_protocol.h): the ranks' request to come
  // back smaller is a file in a directory of the launcher's own.
  std::string relaunch_dir = "/tmp/fulcrum_launch_XXXXXX";
  if (const char* tmp = getenv("TMPDIR"); tmp != nullptr && *tmp != '\0') {
    relaunch_dir = absl::StrCat(tmp, "/fulcrum_launch_XXXXXX");
  }
  if (mkdtemp(relaunch_dir.data()) == nullptr) {
    std::cerr << "fulcrum_launch: cannot create a directory " << relaunch_dir << ": "
              << strerror(errno) << "\n";
    return 1;
  }
  const std::string relaunch_file = relaunch_dir + "/relaunch.json";

  std::vector<std::string> command(argv + program_index, argv + argc);
  int nproc = FLAGS_nproc_per_node;
  launch::SupervisorOptions options;
  options.kill_timeout_s = FLAGS_kill_timeout_s;
  options.stop_timeout_s = FLAGS_stop_timeout_s;
  options.log_dir = FLAGS_log_dir;
  options.relaunch_exit_code = kRelaunchExitCode;
  options.release_dir = relaunch_dir;
  int code = 0;
  for (int launch_count = 0;; ++launch_count) {
    std::vector<launch::ChildSpec> children;
    for (int local_rank = 0; local_rank < nproc; ++local_rank) {
      children.push_back({FLAGS_node_rank * nproc + local_rank, command,
                          ChildEnvironment(local_rank, nproc, master_port, relaunch_file)});
    }
    std::cerr << absl::StrFormat(
        "fulcrum_launch: node %d of %d starts ranks %d..%d of %d, master %s:%d: %s\n",
        FLAGS_node_rank, FLAGS_nnodes, children.front().rank, children.back().rank,
        FLAGS_nnodes * nproc, FLAGS_master_addr, master_port, absl::StrJoin(command, " "));
    std::cerr.flush();
    code = launch::RunChildren(children, options);
    if (code != kRelaunchExitCode) break;
    // Every rank exited 0 or asked for a relaunch: read what rank 0 asked for.
    std::ifstream in(relaunch_file);
    nlohmann::json request = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    std::remove(relaunch_file.c_str());
    if (!in.is_open() || request.is_discarded() || !request.contains("world_size") ||
        !request["world_size"].is_number_integer() || !request.contains("args") ||
        !request["args"].is_array()) {
      std::cerr << "fulcrum_launch: the ranks asked for a relaunch (exit code "
                << kRelaunchExitCode << ") but left no valid request in " << relaunch_file
                << "\n";
      break;
    }
    const int world_size = request["world_size"].get<int>();
    if (FLAGS_nnodes != 1 || world_size < 1 || world_size > FLAGS_nnodes * nproc) {
      std::cerr << absl::StrFormat(
          "fulcrum_launch: the ranks asked for a relaunch on %d ranks, which this launcher "
          "cannot do (--nnodes=%d, %d ranks now); relaunch by hand with %s\n",
          world_size, FLAGS_nnodes, FLAGS_nnodes * nproc, request["args"].dump());
      break;
    }
    std::vector<std::string> extra;
    for (const auto& arg : request["args"]) extra.push_back(arg.get<std::string>());
    std::cerr << absl::StrFormat(
        "fulcrum_launch: re-packing through a checkpoint: %d ranks released, relaunching %d "
        "with %s (%s)\n",
        nproc - world_size, world_size, absl::StrJoin(extra, " "),
        request.value("reason", std::string("no reason given")));
    command.insert(command.end(), extra.begin(), extra.end());
    nproc = world_size;
    if (FLAGS_master_port == 0) {
      std::optional<int> port = PickFreePort(&error);
      if (!port) {
        std::cerr << "fulcrum_launch: cannot pick a free port for the relaunch: " << error << "\n";
        code = 1;
        break;
      }
      master_port = *port;
    }
  }
  // The release markers of a live shrink, then the directory.
  for (int rank = 0; rank < FLAGS_nnodes * FLAGS_nproc_per_node; ++rank) {
    std::remove((relaunch_dir + "/" + ReleaseMarkerName(rank)).c_str());
  }
  rmdir(relaunch_dir.c_str());
  return code;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) { return fulcrum::Main(argc, argv); }
