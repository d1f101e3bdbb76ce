#include "tools/internal/launch_supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace fulcrum::launch {
namespace {

using Clock = std::chrono::steady_clock;

// A line longer than this (a progress bar redrawn with '\r', binary output) is written in
// pieces of this size, each with its own prefix, so memory stays bounded.
constexpr size_t kMaxLineBytes = size_t{1} << 20;
constexpr size_t kReadChunkBytes = 64 * 1024;
// Reads per stream when relaying what an exited rank left in its pipe, so a runaway
// grandchild still writing into it cannot stall the loop.
constexpr int kMaxDrainReads = 64;
// After the last rank exited, how long processes it left behind may keep its output pipes
// open before they are killed.
constexpr auto kDrainTimeout = std::chrono::seconds(2);
// Signals that stop the job: forwarded to every rank; a second one kills them.
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Shared with the signal handler, which only bumps the counters and writes a byte to the
// self-pipe so that poll() wakes up; all real work happens in the main loop.
int g_wake_pipe[2] = {-1, -1};
volatile sig_atomic_t g_stop_signal_count = 0;
volatile sig_atomic_t g_last_stop_signal = 0;

void OnSignal(int signal_number) {
  const int saved_errno = errno;
  if (signal_number != SIGCHLD) {
    g_last_stop_signal = signal_number;
    // Not a lost update: sa_mask blocks every handled signal while the handler runs.
    g_stop_signal_count = g_stop_signal_count + 1;
  }
  const char byte = 0;
  // The pipe is non-blocking; when it is full a wake-up is pending anyway.
  [[maybe_unused]] const ssize_t ignored = write(g_wake_pipe[1], &byte, 1);
  errno = saved_errno;
}

std::string DescribeSignal(int signal_number) {
  return absl::StrFormat("signal %d (%s)", signal_number, strsignal(signal_number));
}

// Writes all of `data` to `fd`. What cannot be written (a closed pipe, a full disk) is
// dropped: the ranks must go on being supervised regardless.
void WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // Our stdout is a non-blocking descriptor shared with the caller; wait a little.
      pollfd writable{fd, POLLOUT, 0};
      if (poll(&writable, 1, 1000) <= 0) return;
    } else {
      return;
    }
  }
}

void Say(absl::string_view message) {
  WriteAll(STDERR_FILENO, absl::StrCat("fulcrum_launch: ", message, "\n"));
}

std::vector<char*> CStringArray(const std::vector<std::string>& strings) {
  std::vector<char*> array;
  array.reserve(strings.size() + 1);
  for (const std::string& s : strings) array.push_back(const_cast<char*>(s.c_str()));
  array.push_back(nullptr);
  return array;
}

struct OutputStream {
  int fd = -1;          // Read end of the pipe from the rank; -1 once closed.
  int sink = -1;        // The launcher's stdout or stderr.
  std::string partial;  // Bytes after the last newline, waiting for the rest of the line.
};

struct Child {
  int rank = 0;
  pid_t pid = -1;  // Also its process group id (NOTE [process groups]); -1: never started.
  bool running = false;
  std::string prefix;  // "[rank K] "
  int log_fd = -1;
  OutputStream out;
  OutputStream err;

  // A rank whose pipes are still open after it exited left processes behind in its group.
  bool MayHaveProcesses() const { return running || out.fd >= 0 || err.fd >= 0; }
};

class Supervisor {
 public:
  explicit Supervisor(const SupervisorOptions& options) : options_(options) {}
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  int Run(const std::vector<ChildSpec>& specs);

 private:
  bool Setup();
  void TearDown();
  bool Start(Child& child, const ChildSpec& spec);
  void Relay(Child& child, OutputStream& stream, absl::string_view data);
  void EmitLine(Child& child, OutputStream& stream, absl::string_view line);
  void ReadFrom(Child& child, OutputStream& stream, int max_reads);
  void CloseStream(Child& child, OutputStream& stream);
  void ReapExited();
  void OnExit(Child& child, int status);
  void HandleStopSignals();
  void CheckKillDeadline();
  void Fail(int exit_code, const std::string& what);
  void SignalGroups(int signal_number);
  int PollTimeoutMs(Clock::time_point now) const;
  int CountRunning() const;

  SupervisorOptions options_;
  std::vector<Child> children_;
  std::vector<std::pair<int, struct sigaction>> saved_actions_;
  int null_fd_ = -1;
  int exit_code_ = 0;
  bool stopping_ = false;  // A rank failed or a stop signal came: the job is ending.
  int stop_signal_ = 0;    // The stop signal forwarded before any rank failed, or 0.
  bool stopped_unclean_ = false;  // A rank exited non-zero after stop_signal_ was forwarded.
  int stop_signals_handled_ = 0;
  bool relaunch_requested_ = false;  // A rank exited with options_.relaunch_exit_code.
  int released_ = 0;                 // Ranks released by a live shrink (release_dir).
  std::optional<Clock::time_point> kill_deadline_;   // SIGKILL whatever still runs then.
  std::optional<Clock::time_point> drain_deadline_;  // Stop waiting for stray writers.
};

bool Supervisor::Setup() {
  if (pipe2(g_wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    Say(absl::StrCat("cannot create a pipe: ", strerror(errno)));
    return false;
  }
  g_stop_signal_count = 0;
  g_last_stop_signal = 0;
  null_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);

  struct sigaction action = {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int s : kStopSignals) sigaddset(&action.sa_mask, s);
  sigaddset(&action.sa_mask, SIGCHLD);
  std::vector<int> handled = {SIGCHLD};
  for (int s : kStopSignals) {
    // SIGHUP or SIGINT that the launcher was started with ignored (nohup; a background job
    // of a shell without job control) stays ignored, for the ranks too: the caller asked
    // for that. SIGTERM is how schedulers stop a job, so it is always forwarded.
    struct sigaction current;
    sigaction(s, nullptr, &current);
    if (s == SIGTERM || current.sa_handler != SIG_IGN) handled.push_back(s);
  }
  for (int s : handled) {
    struct sigaction old;
    sigaction(s, &action, &old);
    saved_actions_.emplace_back(s, old);
  }
  // A reader of our output that went away must not kill the launcher (and orphan the
  // ranks); writes to it then fail with EPIPE and are dropped.
  struct sigaction ignore = {};
  ignore.sa_handler = SIG_IGN;
  struct sigaction old_pipe;
  sigaction(SIGPIPE, &ignore, &old_pipe);
  saved_actions_.emplace_back(SIGPIPE, old_pipe);
  return true;
}

void Supervisor::TearDown() {
  for (const auto& [signal_number, action] : saved_actions_) {
    sigaction(signal_number, &action, nullptr);
  }
  saved_actions_.clear();
  for (Child& child : children_) {
    if (child.log_fd >= 0) close(child.log_fd);
    child.log_fd = -1;
  }
  for (int& fd : g_wake_pipe) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
  if (null_fd_ >= 0) close(null_fd_);
  null_fd_ = -1;
}

bool Supervisor::Start(Child& child, const ChildSpec& spec) {
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    Say(absl::StrFormat("cannot start rank %d: pipe: %s", child.rank, strerror(errno)));
    return false;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    Say(absl::StrFormat("cannot start rank %d: pipe: %s", child.rank, strerror(errno)));
    close(out_pipe[0]);
    close(out_pipe[1]);
    return false;
  }
  // Everything the child needs is prepared before fork().
  std::vector<char*> argv = CStringArray(spec.argv);
  std::vector<char*> envp = CStringArray(spec.env);
  const std::string exec_failure = absl::StrCat("fulcrum_launch: cannot execute '",
                                                spec.argv.empty() ? "" : spec.argv[0], "': ");
  // Handled signals stay blocked from fork() until the child has restored the original
  // dispositions: otherwise a SIGTERM sent to its group in between would run our handler
  // in the child (and be lost) instead of stopping it.
  sigset_t blocked;
  sigset_t old_mask;
  sigemptyset(&blocked);
  for (const auto& [signal_number, action] : saved_actions_) sigaddset(&blocked, signal_number);
  sigprocmask(SIG_BLOCK, &blocked, &old_mask);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // The child. The launcher is single-threaded, so the C library is in a sane state here.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != launcher) _exit(1);  // The launcher died before prctl took effect.
    if (null_fd_ >= 0) dup2(null_fd_, STDIN_FILENO);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    for (const auto& [signal_number, action] : saved_actions_) {
      sigaction(signal_number, &action, nullptr);
    }
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    if (!spec.argv.empty()) execvpe(argv[0], argv.data(), envp.data());
    const int exec_errno = spec.argv.empty() ? ENOENT : errno;
    const std::string message = absl::StrCat(exec_failure, strerror(exec_errno), "\n");
    WriteAll(STDERR_FILENO, message);
    _exit(exec_errno == ENOENT ? 127 : 126);  // What a shell returns for the same failure.
  }
  const int fork_errno = errno;
  // Also set here, so the group exists before fork() returns no matter which process the
  // scheduler runs first (EACCES once the child has exec'd: then it did it itself).
  if (pid > 0) setpgid(pid, pid);
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (pid < 0) {
    Say(absl::StrFormat("cannot start rank %d: fork: %s", child.rank, strerror(fork_errno)));
    close(out_pipe[0]);
    close(err_pipe[0]);
    return false;
  }
  fcntl(out_pipe[0], F_SETFL, fcntl(out_pipe[0], F_GETFL) | O_NONBLOCK);
  fcntl(err_pipe[0], F_SETFL, fcntl(err_pipe[0], F_GETFL) | O_NONBLOCK);
  child.pid = pid;
  child.running = true;
  child.out = {out_pipe[0], STDOUT_FILENO, {}};
  child.err = {err_pipe[0], STDERR_FILENO, {}};
  return true;
}

void Supervisor::EmitLine(Child& child, OutputStream& stream, absl::string_view line) {
  // One write per line: lines of different ranks never mix.
  WriteAll(stream.sink, absl::StrCat(child.prefix, line, "\n"));
  if (child.log_fd >= 0) WriteAll(child.log_fd, absl::StrCat(line, "\n"));
}

void Supervisor::Relay(Child& child, OutputStream& stream, absl::string_view data) {
  while (!data.empty()) {
    const size_t newline = data.find('\n');
    if (newline == absl::string_view::npos) {
      stream.partial.append(data.data(), data.size());
      break;
    }
    if (stream.partial.empty()) {
      EmitLine(child, stream, data.substr(0, newline));
    } else {
      stream.partial.append(data.data(), newline);
      EmitLine(child, stream, stream.partial);
      stream.partial.clear();
    }
    data.remove_prefix(newline + 1);
  }
  while (stream.partial.size() >= kMaxLineBytes) {
    EmitLine(child, stream, absl::string_view(stream.partial).substr(0, kMaxLineBytes));
    stream.partial.erase(0, kMaxLineBytes);
  }
}

void Supervisor::CloseStream(Child& child, OutputStream& stream) {
  // A last line without a newline (a crash mid-print) is still a line worth seeing.
  if (!stream.partial.empty()) EmitLine(child, stream, stream.partial);
  stream.partial.clear();
  close(stream.fd);
  stream.fd = -1;
}

void Supervisor::ReadFrom(Child& child, OutputStream& stream, int max_reads) {
  char buffer[kReadChunkBytes];
  for (int i = 0; i < max_reads && stream.fd >= 0; ++i) {
    const ssize_t n = read(stream.fd, buffer, sizeof(buffer));
    if (n > 0) {
      Relay(child, stream, absl::string_view(buffer, static_cast<size_t>(n)));
    } else if (n < 0 && errno == EINTR) {
      --i;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {
      CloseStream(child, stream);  // End of file: every writer is gone (or a read error).
    }
  }
}

int Supervisor::CountRunning() const {
  return static_cast<int>(std::count_if(children_.begin(), children_.end(),
                                        [](const Child& c) { return c.running; }));
}

void Supervisor::SignalGroups(int signal_number) {
  for (const Child& child : children_) {
    // ESRCH (the group is already empty) is expected and harmless.
    if (child.pid > 0 && child.MayHaveProcesses()) kill(-child.pid, signal_number);
  }
}

void Supervisor::Fail(int exit_code, const std::string& what) {
  exit_code_ = exit_code;
  stopping_ = true;
  const int others = CountRunning();
  if (others == 0) {
    Say(what);
  } else {
    Say(absl::StrFormat("%s; stopping the other %d rank%s (SIGTERM, SIGKILL after %g s)", what,
                        others, others == 1 ? "" : "s", options_.kill_timeout_s));
  }
  SignalGroups(SIGTERM);
  kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(options_.kill_timeout_s));
}

void Supervisor::OnExit(Child& child, int status) {
  child.running = false;
  // Its last words are already in the pipes; relay them before saying how it ended.
  ReadFrom(child, child.out, kMaxDrainReads);
  ReadFrom(child, child.err, kMaxDrainReads);
  int code = 0;
  std::string how;
  if (WIFEXITED(status)) {
    code = WEXITSTATUS(status);
    how = absl::StrFormat("exited with code %d", code);
  } else if (WIFSIGNALED(status)) {
    code = 128 + WTERMSIG(status);
    how = absl::StrCat("was killed by ", DescribeSignal(WTERMSIG(status)),
                       WCOREDUMP(status) ? ", core dumped" : "");
  }
  if (code == 0) {
    struct stat marker;
    if (!options_.release_dir.empty() &&
        stat(absl::StrCat(options_.release_dir, "/released.", child.rank).c_str(), &marker) == 0) {
      ++released_;
      const int others = CountRunning();
      Say(absl::StrFormat("rank %d (pid %d) was released by re-packing and exited 0; %d rank%s "
                          "go on",
                          child.rank, child.pid, others, others == 1 ? "" : "s"));
    }
    return;
  }
  if (options_.relaunch_exit_code != 0 && code == options_.relaunch_exit_code && !stopping_) {
    if (!relaunch_requested_) {
      relaunch_requested_ = true;
      const int others = CountRunning();
      Say(absl::StrFormat("rank %d (pid %d) exited with code %d: the job asks for a relaunch%s",
                          child.rank, child.pid, code,
                          others == 0 ? ""
                                      : absl::StrFormat("; the other %d rank%s get %g s to exit",
                                                        others, others == 1 ? "" : "s",
                                                        options_.stop_timeout_s)));
      kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(options_.stop_timeout_s));
    }
    return;
  }
  if (stop_signal_ != 0) stopped_unclean_ = true;
  const std::string what = absl::StrFormat("rank %d (pid %d) %s", child.rank, child.pid, how);
  if (stopping_) {
    Say(what);  // One of the ranks being stopped; the exit code is already decided.
  } else {
    Fail(code, what);
  }
}

void Supervisor::ReapExited() {
  for (Child& child : children_) {
    if (!child.running) continue;
    int status = 0;
    const pid_t reaped = waitpid(child.pid, &status, WNOHANG);
    if (reaped == child.pid) {
      OnExit(child, status);
    } else if (reaped < 0 && errno != EINTR) {
      // ECHILD: something else in this process reaped it; its status is lost.
      child.running = false;
      if (!stopping_) {
        Fail(1, absl::StrFormat("rank %d (pid %d) vanished: waitpid: %s", child.rank, child.pid,
                                strerror(errno)));
      }
    }
  }
}

void Supervisor::HandleStopSignals() {
  while (stop_signals_handled_ < g_stop_signal_count) {
    ++stop_signals_handled_;
    const int signal_number = g_last_stop_signal;
    if (stop_signals_handled_ == 1) {
      Say(absl::StrFormat(
          "received %s; forwarding it to every rank (SIGKILL after %g s or on a second signal)",
          DescribeSignal(signal_number), options_.stop_timeout_s));
      if (!stopping_) stop_signal_ = signal_number;
      stopping_ = true;
      SignalGroups(signal_number);
      kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(options_.stop_timeout_s));
    } else {
      Say(absl::StrFormat("received %s again; killing every rank", DescribeSignal(signal_number)));
      SignalGroups(SIGKILL);
      kill_deadline_.reset();
    }
  }
}

void Supervisor::CheckKillDeadline() {
  if (!kill_deadline_ || Clock::now() < *kill_deadline_) return;
  kill_deadline_.reset();
  if (const int running = CountRunning(); running > 0) {
    Say(absl::StrFormat("%d rank%s still running %g s after SIGTERM; sending SIGKILL", running,
                        running == 1 ? "" : "s", options_.kill_timeout_s));
  }
  SignalGroups(SIGKILL);
}

int Supervisor::PollTimeoutMs(Clock::time_point now) const {
  std::optional<Clock::time_point> next;
  for (const auto& deadline : {kill_deadline_, drain_deadline_}) {
    if (deadline && (!next || *deadline < *next)) next = deadline;
  }
  if (!next) return -1;
  const auto wait = std::chrono::ceil<std::chrono::milliseconds>(*next - now).count();
  return static_cast<int>(std::clamp<decltype(wait)>(wait, 0, 60 * 1000));
}

int Supervisor::Run(const std::vector<ChildSpec>& specs) {
  if (!Setup()) return 1;
  children_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    Child& child = children_[i];
    child.rank = specs[i].rank;
    child.prefix = absl::StrFormat("[rank %d] ", child.rank);
    if (options_.log_dir.empty()) continue;
    const std::string path = absl::StrFormat("%s/rank_%d.log", options_.log_dir, child.rank);
    child.log_fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (child.log_fd < 0) {
      Say(absl::StrFormat("cannot open log file %s: %s", path, strerror(errno)));
      TearDown();
      return 1;
    }
  }
  for (size_t i = 0; i < specs.size() && g_stop_signal_count == 0; ++i) {
    if (!Start(children_[i], specs[i])) {
      Fail(1, absl::StrFormat("rank %d could not be started", children_[i].rank));
      break;
    }
  }

  std::vector<pollfd> poll_fds;
  std::vector<std::pair<Child*, OutputStream*>> poll_streams;
  while (true) {
    ReapExited();
    HandleStopSignals();
    CheckKillDeadline();
    const Clock::time_point now = Clock::now();
    if (CountRunning() == 0) {
      const bool any_open = std::any_of(children_.begin(), children_.end(),
                                        [](const Child& c) { return c.MayHaveProcesses(); });
      if (!any_open) break;
      if (!drain_deadline_) drain_deadline_ = now + kDrainTimeout;
      if (now >= *drain_deadline_) break;
    }
    poll_fds.assign(1, pollfd{g_wake_pipe[0], POLLIN, 0});
    poll_streams.assign(1, {nullptr, nullptr});
    for (Child& child : children_) {
      for (OutputStream* stream : {&child.out, &child.err}) {
        if (stream->fd < 0) continue;
        poll_fds.push_back(pollfd{stream->fd, POLLIN, 0});
        poll_streams.emplace_back(&child, stream);
      }
    }
    if (poll(poll_fds.data(), poll_fds.size(), PollTimeoutMs(now)) < 0) {
      if (errno == EINTR) continue;
      Say(absl::StrCat("poll failed: ", strerror(errno), "; killing every rank"));
      if (exit_code_ == 0) exit_code_ = 1;
      SignalGroups(SIGKILL);
      for (Child& child : children_) {
        if (child.running && waitpid(child.pid, nullptr, 0) == child.pid) child.running = false;
      }
      break;
    }
    if (poll_fds[0].revents != 0) {
      char bytes[256];
      while (read(g_wake_pipe[0], bytes, sizeof(bytes)) > 0) {
      }
    }
    for (size_t i = 1; i < poll_fds.size(); ++i) {
      // One read per stream per round keeps a chatty rank from starving the others.
      if (poll_fds[i].revents != 0) ReadFrom(*poll_streams[i].first, *poll_streams[i].second, 1);
    }
  }

  // Whatever still holds a rank's pipes was left behind by it and must not outlive the job.
  for (Child& child : children_) {
    if (child.out.fd < 0 && child.err.fd < 0) continue;
    Say(absl::StrFormat("rank %d left processes behind that keep its output open; killing them",
                        child.rank));
    kill(-child.pid, SIGKILL);
    for (OutputStream* stream : {&child.out, &child.err}) {
      if (stream->fd < 0) continue;
      ReadFrom(child, *stream, kMaxDrainReads);
      if (stream->fd >= 0) CloseStream(child, *stream);
    }
  }
  TearDown();
  if (exit_code_ == 0 && stop_signal_ == 0 && relaunch_requested_) {
    return options_.relaunch_exit_code;
  }
  if (exit_code_ == 0 && stop_signal_ == 0 && released_ > 0) {
    Say(absl::StrFormat("every rank exited 0; %d of %d were released early by re-packing",
                        released_, static_cast<int>(children_.size())));
  }
  if (stop_signal_ != 0) {
    if (stopped_unclean_) return 128 + stop_signal_;
    Say(absl::StrFormat("every rank exited 0 after %s: the job stopped cleanly",
                        DescribeSignal(stop_signal_)));
    return 0;
  }
  return exit_code_;
}

}  // namespace

int RunChildren(const std::vector<ChildSpec>& children, const SupervisorOptions& options) {
  if (children.empty()) return 0;
  Supervisor supervisor(options);
  return supervisor.Run(children);
}

}  // namespace fulcrum::launch
