// Tests of fulcrum_launch, run as the real binary with small shell programs as ranks:
// environment per rank, whole prefixed lines, free ports, failure and signal handling
// (measured in wall time: a launcher that hangs wastes a cluster allocation), usage errors.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fulcrum {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using Clock = std::chrono::steady_clock;

const char kLauncher[] = FULCRUM_BIN_DIR "/fulcrum_launch";
// Upper bound for any single launcher run; far above what a correct launcher needs.
constexpr double kRunTimeoutS = 20;
// What the launcher says when it had to kill processes a rank left behind. Signals go to
// whole process groups, so stopping a `sh -c '...; sleep 60'` rank never needs that.
constexpr char kLeftBehind[] = "left processes behind";

Clock::duration Seconds(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

struct RunResult {
  int exit_code = -1;  // 128+N when the launcher itself died from signal N.
  std::string out;
  std::string err;
  double seconds = 0;  // Wall time from start to exit.
};

// Launcher environment changes: a value sets the variable, nullopt removes it.
using EnvChanges = std::map<std::string, std::optional<std::string>>;

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

int CountOf(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++count;
  }
  return count;
}

// One fulcrum_launch process with its stdout and stderr read through pipes.
class Launcher {
 public:
  explicit Launcher(const std::vector<std::string>& args, const EnvChanges& env_changes = {}) {
    std::vector<std::string> env;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string name(*entry, strcspn(*entry, "="));
      if (env_changes.count(name) == 0) env.emplace_back(*entry);
    }
    for (const auto& [name, value] : env_changes) {
      if (value) env.push_back(name + "=" + *value);
    }
    std::vector<std::string> argv = {kLauncher};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> argv_c;
    std::vector<char*> env_c;
    for (std::string& s : argv) argv_c.push_back(s.data());
    for (std::string& s : env) env_c.push_back(s.data());
    argv_c.push_back(nullptr);
    env_c.push_back(nullptr);

    int out_pipe[2];
    int err_pipe[2];
    EXPECT_EQ(pipe2(out_pipe, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(err_pipe, O_CLOEXEC), 0);
    start_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      // The test binary may run with SIGINT ignored (a background job of a script); the
      // launcher would inherit that and rightly keep ignoring it.
      for (int s : {SIGINT, SIGTERM, SIGHUP}) signal(s, SIG_DFL);
      dup2(out_pipe[1], STDOUT_FILENO);
      dup2(err_pipe[1], STDERR_FILENO);
      execve(argv_c[0], argv_c.data(), env_c.data());
      _exit(99);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);
    out_fd_ = out_pipe[0];
    err_fd_ = err_pipe[0];
  }

  ~Launcher() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) close(out_fd_);
    if (err_fd_ >= 0) close(err_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

  // Reads output until `done(out, err)` holds; false after `timeout_s` or when the output
  // ended first.
  bool WaitFor(const std::function<bool(const std::string&, const std::string&)>& done,
               double timeout_s) {
    const Clock::time_point deadline = Clock::now() + Seconds(timeout_s);
    while (!done(out_, err_)) {
      if (Clock::now() >= deadline || (out_fd_ < 0 && err_fd_ < 0)) return false;
      Pump(deadline);
    }
    return true;
  }

  // Reads all output and waits for the launcher to exit; SIGKILLs it (failing the test)
  // after kRunTimeoutS.
  RunResult Finish() {
    const Clock::time_point deadline = start_ + Seconds(kRunTimeoutS);
    while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < deadline) Pump(deadline);
    int status = 0;
    while (true) {
      const pid_t reaped = waitpid(pid_, &status, WNOHANG);
      if (reaped == pid_) break;
      if (Clock::now() >= deadline) {
        ADD_FAILURE() << "fulcrum_launch did not exit within " << kRunTimeoutS << " s";
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      usleep(10 * 1000);
    }
    exited_ = true;
    RunResult result;
    result.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result.out = out_;
    result.err = err_;
    return result;
  }

 private:
  void Pump(Clock::time_point deadline) {
    std::vector<pollfd> fds;
    for (int fd : {out_fd_, err_fd_}) {
      if (fd >= 0) fds.push_back({fd, POLLIN, 0});
    }
    if (fds.empty()) return;
    const auto wait_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait_ms, 0) + 1)) <= 0) {
      return;
    }
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      char buffer[65536];
      const ssize_t n = read(p.fd, buffer, sizeof(buffer));
      int& fd = p.fd == out_fd_ ? out_fd_ : err_fd_;
      std::string& text = p.fd == out_fd_ ? out_ : err_;
      if (n > 0) {
        text.append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fd);
        fd = -1;
      }
    }
  }

  pid_t pid_ = -1;
  bool exited_ = false;
  int out_fd_ = -1;
  int err_fd_ = -1;
  std::string out_;
  std::string err_;
  Clock::time_point start_;
};

RunResult RunLauncher(const std::vector<std::string>& args, const EnvChanges& env_changes = {}) {
  return Launcher(args, env_changes).Finish();
}

// fulcrum_launch --nproc_per_node=N [flags...] -- /bin/sh -c SCRIPT
RunResult RunShell(int nproc, const std::string& script, std::vector<std::string> flags = {},
                   const EnvChanges& env_changes = {}) {
  flags.insert(flags.begin(), "--nproc_per_node=" + std::to_string(nproc));
  flags.insert(flags.end(), {"--", "/bin/sh", "-c", script});
  return RunLauncher(flags, env_changes);
}

class SlowLaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "fulcrum_launch_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string dir_;
};

TEST_F(SlowLaunchTest, SetsTheRendezvousVariablesOfEachRank) {
  const RunResult r = RunShell(
      3,
      "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
      "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR "
      "MASTER_PORT=$MASTER_PORT",
      {"--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=12345"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = Lines(r.out);
  std::sort(lines.begin(), lines.end());
  std::vector<std::string> expected;
  for (int local = 0; local < 3; ++local) {
    const int rank = 3 + local;
    expected.push_back("[rank " + std::to_string(rank) + "] RANK=" + std::to_string(rank) +
                       " WORLD_SIZE=6 LOCAL_RANK=" + std::to_string(local) +
                       " LOCAL_WORLD_SIZE=3 GROUP_RANK=1 MASTER_ADDR=10.1.2.3 "
                       "MASTER_PORT=12345");
  }
  EXPECT_EQ(lines, expected);
}

TEST_F(SlowLaunchTest, CommandMayFollowFlagsWithoutSeparator) {
  const RunResult r = RunLauncher({"--nproc_per_node", "2", "/bin/sh", "-c", "echo rank=$RANK", "--x"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] rank="), 2) << r.out;
}

TEST_F(SlowLaunchTest, SetsOmpNumThreadsUnlessAlreadySet) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int expected = std::max(1, CPU_COUNT(&set) / 2);
  RunResult r = RunShell(2, "echo threads=$OMP_NUM_THREADS", {}, {{"OMP_NUM_THREADS", {}}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] threads=" + std::to_string(expected) + "\n"), 2) << r.out;

  r = RunShell(2, "echo threads=$OMP_NUM_THREADS", {}, {{"OMP_NUM_THREADS", "7"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] threads=7\n"), 2) << r.out;
}

// The ranks inherit libgomp's wait policy as it is (NOTE [OpenMP wait policy] in
// core/threads.h): unset stays unset, a set one is kept.
TEST_F(SlowLaunchTest, LeavesTheOpenMpWaitPolicyAlone) {
  RunResult r = RunShell(2, "echo wait=$OMP_WAIT_POLICY", {}, {{"OMP_WAIT_POLICY", {}}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] wait=\n"), 2) << r.out;

  r = RunShell(2, "echo wait=$OMP_WAIT_POLICY", {}, {{"OMP_WAIT_POLICY", "ACTIVE"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] wait=ACTIVE\n"), 2) << r.out;
}

TEST_F(SlowLaunchTest, EveryLineIsPrefixedAndWhole) {
  // Each line is written in two pieces and ranks write concurrently, so only a launcher
  // that reassembles lines per rank prints them whole. Rank 0 adds one 200 kB line (more
  // than a pipe holds) and everyone mirrors to stderr.
  constexpr int kRanks = 4;
  constexpr int kLines = 400;
  const std::string payload(60, 'x');
  const std::string script =
      "i=0; while [ $i -lt " + std::to_string(kLines) +
      " ]; do printf 'r%s line %s ' $RANK $i; printf '" + payload +
      "\\n'; printf 'e%s line %s\\n' $RANK $i >&2; i=$((i+1)); done; "
      "if [ $RANK = 0 ]; then head -c 200000 /dev/zero | tr '\\0' y; echo; fi";
  const RunResult r = RunShell(kRanks, script);
  ASSERT_EQ(r.exit_code, 0) << r.err.substr(0, 2000);

  const std::regex out_line(R"(\[rank (\d)\] r(\d) line (\d+) x{60})");
  const std::string long_line = "[rank 0] " + std::string(200000, 'y');
  std::vector<int> next(kRanks, 0);
  int long_lines = 0;
  for (const std::string& line : Lines(r.out)) {
    if (line == long_line) {
      ++long_lines;
      continue;
    }
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, out_line)) << "mangled line: " << line.substr(0, 200);
    const int rank = std::stoi(m[1]);
    EXPECT_EQ(m[2], m[1]) << line;
    EXPECT_EQ(std::stoi(m[3]), next[rank]++) << "rank " << rank << " lines out of order";
  }
  EXPECT_EQ(long_lines, 1);
  EXPECT_EQ(next, std::vector<int>(kRanks, kLines));

  const std::regex err_line(R"(\[rank (\d)\] e(\d) line (\d+))");
  std::vector<int> err_next(kRanks, 0);
  for (const std::string& line : Lines(r.err)) {
    if (line.rfind("fulcrum_launch: ", 0) == 0) continue;  // The launcher's own notes.
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, err_line)) << "mangled line: " << line;
    EXPECT_EQ(m[2], m[1]) << line;
    EXPECT_EQ(std::stoi(m[3]), err_next[std::stoi(m[1])]++) << line;
  }
  EXPECT_EQ(err_next, std::vector<int>(kRanks, kLines));
}

TEST_F(SlowLaunchTest, OverlongLineIsSplitIntoPrefixedPieces) {
  // Memory stays bounded: a line over 1 MiB comes out in 1 MiB pieces, each prefixed.
  const RunResult r = RunShell(1, "head -c 2500000 /dev/zero | tr '\\0' z");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<size_t> sizes;
  for (const std::string& line : Lines(r.out)) {
    ASSERT_EQ(line.rfind("[rank 0] ", 0), 0u);
    ASSERT_EQ(line.find_first_not_of('z', 9), std::string::npos);
    sizes.push_back(line.size() - 9);
  }
  EXPECT_EQ(sizes, (std::vector<size_t>{1 << 20, 1 << 20, 2500000 - (2 << 20)}));
}

TEST_F(SlowLaunchTest, PartialLastLineIsFlushed) {
  const RunResult r = RunShell(2, "printf 'no newline %s' $RANK; printf 'tail' >&2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] no newline 0\n"));
  EXPECT_THAT(r.out, HasSubstr("[rank 1] no newline 1\n"));
  EXPECT_EQ(CountOf(r.err, "] tail\n"), 2) << r.err;
}

TEST_F(SlowLaunchTest, MasterPortZeroPicksOneFreePortForAllRanks) {
  const RunResult r = RunShell(3, "echo port=$MASTER_PORT", {"--master_port=0"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::regex port_line(R"(\[rank \d\] port=(\d+))");
  std::set<int> ports;
  for (const std::string& line : Lines(r.out)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, port_line)) << line;
    ports.insert(std::stoi(m[1]));
  }
  ASSERT_EQ(ports.size(), 1u) << r.out;
  const int port = *ports.begin();
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
  // It really is a free port: we can listen on it ourselves.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<uint16_t>(port));
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
      << "port " << port << ": " << strerror(errno);
  close(fd);
}

TEST_F(SlowLaunchTest, FailingRankStopsTheOthersAndSetsTheExitCode) {
  const RunResult r = RunShell(3, "if [ $RANK = 1 ]; then echo bye; exit 3; fi; sleep 60");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.out, HasSubstr("[rank 1] bye"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.err, HasSubstr("exited with code 3; stopping the other 2 ranks"));
  EXPECT_THAT(r.err, Not(HasSubstr(kLeftBehind)));
}

// NOTE [relaunch protocol] (recipes/relaunch_protocol.h): ranks exiting 75 after rank 0
// wrote the request are relaunched, fewer, with the request's flags after the command.
TEST_F(SlowLaunchTest, RanksAskingForARelaunchComeBackFewerWithTheRequestsFlags) {
  // First launch: no flags after the command ($# = 0); rank 0 asks for 2 ranks and two
  // more arguments. Second launch: the arguments arrive and everybody exits 0.
  const std::string script =
      R"(if [ $# -gt 0 ]; then echo second RANK=$RANK WORLD_SIZE=$WORLD_SIZE args=$*; exit 0; fi; )"
      R"(echo first RANK=$RANK WORLD_SIZE=$WORLD_SIZE; )"
      R"(if [ $RANK = 0 ]; then echo '{"world_size": 2, "args": ["--a=1", "--b=2"], )"
      R"("reason": "test"}' > $FULCRUM_RELAUNCH_FILE.tmp && )"
      R"(mv $FULCRUM_RELAUNCH_FILE.tmp $FULCRUM_RELAUNCH_FILE; fi; exit 75)";
  const RunResult r = RunLauncher(
      {"--nproc_per_node=4", "--master_port=0", "--", "/bin/sh", "-c", script, "sh"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(CountOf(r.out, "] first RANK="), 4) << r.out;
  EXPECT_EQ(CountOf(r.out, "] second RANK="), 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("[rank 1] second RANK=1 WORLD_SIZE=2 args=--a=1 --b=2"));
  EXPECT_THAT(r.err, HasSubstr("exited with code 75: the job asks for a relaunch"));
  EXPECT_THAT(r.err, HasSubstr("re-packing through a checkpoint: 2 ranks released, relaunching 2 "
                               "with --a=1 --b=2 (test)"));
  EXPECT_THAT(r.err, Not(HasSubstr("stopping the other")));
}

// A live shrink: rank 1 is released (its marker, exit 0) and rank 0 goes on; when rank 0
// later fails, the job still ends with its error within seconds.
TEST_F(SlowLaunchTest, ReleasedRanksExitZeroAndALaterFailureStillEndsTheJob) {
  const std::string release =
      R"(if [ $RANK = 1 ]; then touch $(dirname $FULCRUM_RELAUNCH_FILE)/released.1; exit 0; fi; )";
  RunResult r = RunShell(2, release + "sleep 1; echo done");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] done"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
  EXPECT_THAT(r.err, HasSubstr("was released by re-packing and exited 0; 1 rank go on"));
  EXPECT_THAT(r.err, HasSubstr("every rank exited 0; 1 of 2 were released early by re-packing"));

  r = RunShell(3, release + R"(if [ $RANK = 0 ]; then sleep 1; echo crash; exit 5; fi; sleep 60)");
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.err, HasSubstr("was released by re-packing"));
  EXPECT_THAT(r.err, HasSubstr("rank 0 (pid"));
  EXPECT_THAT(r.err, HasSubstr("exited with code 5; stopping the other 1 rank"));
}

// A rank that fails while the others ask for a relaunch fails the job: no relaunch.
TEST_F(SlowLaunchTest, AFailureBesideARelaunchRequestFailsTheJob) {
  RunResult r = RunShell(
      3, R"(if [ $RANK = 2 ]; then sleep 0.5; echo crash; exit 3; fi; )"
         R"(if [ $RANK = 0 ]; then echo '{"world_size": 1, "args": []}' > $FULCRUM_RELAUNCH_FILE; )"
         R"(fi; exit 75)");
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_THAT(r.err, HasSubstr("rank 2 (pid"));
  EXPECT_THAT(r.err, HasSubstr("exited with code 3"));
  EXPECT_THAT(r.err, Not(HasSubstr("relaunching")));
  // Asking without a request is an error too: the launcher cannot know how to relaunch.
  r = RunShell(2, "exit 75");
  EXPECT_EQ(r.exit_code, 75) << r.err;
  EXPECT_THAT(r.err, HasSubstr("left no valid request"));
}

TEST_F(SlowLaunchTest, RankKilledBySignalFailsTheJob) {
  const RunResult r = RunShell(2, "if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60");
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.err, HasSubstr("rank 0 (pid"));
  EXPECT_THAT(r.err, HasSubstr("was killed by signal 9"));
  EXPECT_THAT(r.err, Not(HasSubstr(kLeftBehind)));
}

TEST_F(SlowLaunchTest, RankIgnoringSigtermIsKilledAfterTheTimeout) {
  // Rank 1 ignores SIGTERM (so does its `sleep`, which inherits that); rank 0 fails only
  // once rank 1 is ready.
  const std::string ready = dir_ + "/ready";
  const RunResult r = RunShell(
      2,
      "if [ $RANK = 1 ]; then trap '' TERM; touch " + ready + "; sleep 60; fi; "
      "while [ ! -e " + ready + " ]; do sleep 0.05; done; exit 5",
      {"--kill_timeout_s=1"});
  EXPECT_EQ(r.exit_code, 5) << r.err;
  EXPECT_GE(r.seconds, 1);
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.err, HasSubstr("1 rank still running 1 s after SIGTERM; sending SIGKILL"));
  EXPECT_THAT(r.err, HasSubstr("rank 1 (pid"));
}

TEST_F(SlowLaunchTest, SigtermIsForwardedToEveryRank) {
  // The shell runs its trap once the current `sleep 0.1` ends. (A long `sleep 60 & wait`
  // would race: a job forked just as the signal arrives can swallow it before its exec.)
  Launcher launcher({"--nproc_per_node=2", "--", "/bin/sh", "-c",
                     "trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.1; done"});
  ASSERT_TRUE(launcher.WaitFor(
      [](const std::string& out, const std::string&) { return CountOf(out, "] ready") == 2; },
      kRunTimeoutS))
      << launcher.out() << launcher.err();
  const auto signalled = Clock::now();
  ASSERT_EQ(kill(launcher.pid(), SIGTERM), 0);
  const RunResult r = launcher.Finish();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(), 4);
  // Every rank handled the signal and exited 0: a clean stop (a pre-empted training run
  // that saved), so the launcher exits 0 too.
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank 0] got TERM"));
  EXPECT_THAT(r.out, HasSubstr("[rank 1] got TERM"));
  EXPECT_THAT(r.err, HasSubstr("received signal 15"));
  EXPECT_THAT(r.err, HasSubstr("every rank exited 0 after signal 15"));
  EXPECT_THAT(r.err, Not(HasSubstr(kLeftBehind)));
}

TEST_F(SlowLaunchTest, RankFailingAfterAStopSignalGivesTheSignalsCode) {
  Launcher launcher({"--nproc_per_node=2", "--", "/bin/sh", "-c",
                     "trap 'exit $((RANK + 3))' TERM; echo ready; while :; do sleep 0.1; done"});
  ASSERT_TRUE(launcher.WaitFor(
      [](const std::string& out, const std::string&) { return CountOf(out, "] ready") == 2; },
      kRunTimeoutS));
  ASSERT_EQ(kill(launcher.pid(), SIGTERM), 0);
  const RunResult r = launcher.Finish();
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_THAT(r.err, Not(HasSubstr("stopped cleanly")));
}

TEST_F(SlowLaunchTest, SigintStopsRanksThatDoNotHandleIt) {
  // A rank caught by the signal mid-fork may survive it: --stop_timeout_s bounds the wait.
  Launcher launcher({"--nproc_per_node=2", "--stop_timeout_s=3", "--", "/bin/sh", "-c",
                     "echo ready; sleep 60"});
  ASSERT_TRUE(launcher.WaitFor(
      [](const std::string& out, const std::string&) { return CountOf(out, "] ready") == 2; },
      kRunTimeoutS));
  ASSERT_EQ(kill(launcher.pid(), SIGINT), 0);
  const RunResult r = launcher.Finish();
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.err, Not(HasSubstr(kLeftBehind)));
}

TEST_F(SlowLaunchTest, SecondSignalKillsAtOnce) {
  Launcher launcher({"--nproc_per_node=2", "--kill_timeout_s=30", "--", "/bin/sh", "-c",
                     "trap '' TERM; echo ready; sleep 60"});
  ASSERT_TRUE(launcher.WaitFor(
      [](const std::string& out, const std::string&) { return CountOf(out, "] ready") == 2; },
      kRunTimeoutS));
  ASSERT_EQ(kill(launcher.pid(), SIGTERM), 0);
  ASSERT_TRUE(launcher.WaitFor(
      [](const std::string&, const std::string& err) { return CountOf(err, "forwarding") == 1; },
      kRunTimeoutS))
      << launcher.err();
  const auto signalled = Clock::now();
  ASSERT_EQ(kill(launcher.pid(), SIGTERM), 0);
  const RunResult r = launcher.Finish();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - signalled).count(), 4);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.err;
  EXPECT_THAT(r.err, HasSubstr("again; killing every rank"));
  EXPECT_THAT(r.err, Not(HasSubstr(kLeftBehind)));
}

TEST_F(SlowLaunchTest, ProcessesLeftBehindDoNotHoldTheLauncher) {
  // The rank exits but a background grandchild keeps its stdout open.
  const RunResult r = RunShell(1, "sleep 60 & echo done");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 10);
  EXPECT_THAT(r.out, HasSubstr("[rank 0] done"));
  EXPECT_THAT(r.err, HasSubstr(std::string("rank 0 ") + kLeftBehind));
}

TEST_F(SlowLaunchTest, ProgramThatCannotRunFailsWith127) {
  const RunResult r = RunLauncher({"--nproc_per_node=2", "--", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_THAT(r.err, HasSubstr("] fulcrum_launch: cannot execute '/nonexistent/program'"));
}

TEST_F(SlowLaunchTest, LogDirGetsEachRanksOutput) {
  const std::string log_dir = dir_ + "/logs/run1";
  const RunResult r =
      RunShell(2, "echo out $RANK; echo err $RANK >&2", {"--log_dir=" + log_dir});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (int rank : {0, 1}) {
    std::ifstream file(log_dir + "/rank_" + std::to_string(rank) + ".log");
    ASSERT_TRUE(file.good()) << "rank " << rank;
    std::vector<std::string> lines;
    for (std::string line; std::getline(file, line);) lines.push_back(line);
    std::sort(lines.begin(), lines.end());
    EXPECT_EQ(lines, (std::vector<std::string>{"err " + std::to_string(rank),
                                               "out " + std::to_string(rank)}));
  }
}

struct UsageCase {
  std::vector<std::string> args;
  std::string message;
};

class LaunchUsageTest : public ::testing::TestWithParam<UsageCase> {};

TEST_P(LaunchUsageTest, ExitsTwoWithAMessage) {
  const RunResult r = RunLauncher(GetParam().args);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr(GetParam().message));
  EXPECT_THAT(r.err, HasSubstr("--help"));
  EXPECT_THAT(r.err, Not(HasSubstr("[rank")));
}

INSTANTIATE_TEST_SUITE_P(
    BadUsage, LaunchUsageTest,
    ::testing::Values(
        UsageCase{{}, "no program to run"},
        UsageCase{{"--nproc_per_node=2", "--"}, "no program to run"},
        UsageCase{{"--nproc_per_node=0", "--", "true"}, "--nproc_per_node=0 must be at least 1"},
        UsageCase{{"--nproc_per_node=abc", "--", "true"},
                  "--nproc_per_node=abc: expected a value of type int32"},
        UsageCase{{"--nnodes=0", "--", "true"}, "--nnodes=0 must be at least 1"},
        UsageCase{{"--nnodes=2", "--node_rank=2", "--", "true"},
                  "--node_rank=2 must be in 0..1 (--nnodes=2)"},
        UsageCase{{"--master_port=70000", "--", "true"}, "--master_port=70000 is not a TCP port"},
        UsageCase{{"--master_port=0", "--nnodes=2", "--", "true"},
                  "--master_port=0 (pick a free port) needs --nnodes=1"},
        UsageCase{{"--kill_timeout_s=-1", "--", "true"}, "--kill_timeout_s=-1 must be"},
        UsageCase{{"--master_addr=", "--", "true"}, "--master_addr must not be empty"},
        UsageCase{{"--no_such_flag=1", "--", "true"}, "unknown flag '--no_such_flag=1'"},
        UsageCase{{"--nproc_per_node"}, "--nproc_per_node needs a value"}));

TEST(LaunchHelpTest, HelpDescribesTheFlagsAndExitsZero) {
  const RunResult r = RunLauncher({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Usage:"));
  EXPECT_THAT(r.out, HasSubstr("-nproc_per_node"));
  EXPECT_THAT(r.out, HasSubstr("-master_port"));
  EXPECT_THAT(r.out, HasSubstr("OMP_NUM_THREADS"));
}

}  // namespace
}  // namespace fulcrum
