// The process supervisor behind fulcrum_launch: starts the ranks of one node, relays their
// output line by line with a "[rank K] " prefix, forwards stop signals and tears the whole
// node down as soon as one rank fails, so a broken job never sits idle on its allocation.
//
// NOTE [process groups] Each rank runs in its own process group (its pid is the group id)
// and every signal goes to the whole group. A rank is often a shell or a wrapper whose real
// work is a grandchild (`sh -c 'python train.py'`); signalling only the direct child would
// leave the grandchild running and holding the output pipe open. Own groups also mean a
// terminal's Ctrl-C reaches only the launcher, which forwards it once. Ranks read stdin
// from /dev/null (a background group reading the terminal would be stopped by SIGTTIN) and
// get SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG), so none outlives it.
//
// Thread-safety: RunChildren installs process-wide signal handlers and reaps child
// processes; call it once, from the main thread of a single-threaded program.
#pragma once

#include <string>
#include <vector>

namespace fulcrum::launch {

/// One process to start.
struct ChildSpec {
  int rank = 0;                   // Global rank, shown as "[rank K] " before each line.
  std::vector<std::string> argv;  // argv[0] is looked up in PATH like execvp does.
  std::vector<std::string> env;   // The child's complete environment, "NAME=value" each.
};

struct SupervisorOptions {
  /// Seconds a rank gets between SIGTERM and SIGKILL when another rank failed. Default: 5.
  double kill_timeout_s = 5;
  /// Seconds the ranks get, after a stop signal the launcher forwarded, to finish their
  /// iteration, save and exit (fulcrum_train's graceful stop) before SIGKILL. Default: 120.
  double stop_timeout_s = 120;
  /// When not empty, an existing directory: each rank's output (stdout and stderr, without
  /// the prefix) is also written to log_dir/rank_K.log. Default: empty.
  std::string log_dir;
  /// When not 0, a rank exiting with this code asks for a relaunch (NOTE [relaunch protocol]
  /// in recipes/relaunch_protocol.h) and is not a failure: the others get stop_timeout_s to
  /// exit too (then SIGKILL, a failure). Default: 0 (every non-zero code is a failure).
  int relaunch_exit_code = 0;
  /// When not empty, a directory where a rank released on purpose by a live shrink leaves
  /// the file released.RANK before it exits 0: reported as a release, not as an early end.
  std::string release_dir;
};

/// Starts `children` and supervises them until every one has exited. Returns the exit code
/// for the launcher:
///  - 0 when every child exited with status 0;
///  - otherwise the code of the first child that failed (128+N when it died from signal N),
///    after SIGTERM — then SIGKILL once kill_timeout_s passed — to all others;
///  - after the launcher received signal N (SIGINT, SIGTERM or SIGHUP), which it forwards
///    to every child (SIGKILL after stop_timeout_s, or at once on a second such signal):
///    0 when every child still exited with status 0 — they stopped cleanly, as
///    fulcrum_train does after saving — else 128+N. SIGINT and SIGHUP that the launcher
///    inherited as ignored (nohup, background jobs) stay ignored;
///  - relaunch_exit_code when every child exited 0 or with it, at least one with it;
///  - 1 when a child could not be started (fork or pipe failed) or a log file could not be
///    opened.
/// A child whose program cannot be executed reports it on its stderr and exits 127 (126
/// when not executable), like a shell. The launcher's own messages go to stderr, prefixed
/// "fulcrum_launch: ".
int RunChildren(const std::vector<ChildSpec>& children, const SupervisorOptions& options);

}  // namespace fulcrum::launch
