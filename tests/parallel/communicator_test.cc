// Tests of the communicator layer: rendezvous failures, the one-process world (argument
// checks, the wrapper), and the drivers that run the multi-process cases of
// comm_worker_test.cc under fulcrum_launch on real Gloo.
#include "parallel/communicator.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "parallel/communicator_wrapper.h"
#include "parallel/gloo_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/rendezvous.h"
#include "parallel/world.h"
#include "tests/run_command.h"
#include "tests/worker_runs.h"
#include "parallel/world_communicator.h"

namespace fulcrum::parallel {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// A loopback port that nothing listens on (bound, read, released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ADD_FAILURE() << "cannot find a free port";
  }
  close(fd);
  return ntohs(address.sin_port);
}

std::unique_ptr<Communicator> OneProcessWorld() {
  auto comm = CreateWorldCommunicator(WorldInfo{}, Backend::kGloo, std::chrono::seconds(10));
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

template <typename F>
std::string CommErrorOf(F&& f) {
  try {
    f();
  } catch (const CommError& e) {
    return e.what();
  }
  return "(no CommError)";
}

TEST(RendezvousTest, UnreachableMasterTimesOutWithClearMessage) {
  WorldInfo world;
  world.rank = 1;
  world.world_size = 2;
  world.master_addr = "127.0.0.1";
  world.master_port = UnusedPort();
  const auto start = Clock::now();
  auto store = ConnectStore(world, std::chrono::milliseconds(2000));
  const auto took = Clock::now() - start;
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDeadlineExceeded) << store.status();
  EXPECT_EQ(
      std::string(store.status().message()),
      "rendezvous: could not reach the master at 127.0.0.1:" + std::to_string(world.master_port) +
          " within 2000 ms (rank 1 of 2); is rank 0 running and MASTER_ADDR/MASTER_PORT "
          "right?");
  EXPECT_GE(took, std::chrono::milliseconds(1500));
  EXPECT_LT(took, std::chrono::milliseconds(4000));
}

TEST(RendezvousTest, MasterWhoseWorkersNeverComeTimesOut) {
  WorldInfo world;
  world.rank = 0;
  world.world_size = 2;
  world.master_port = UnusedPort();
  const auto start = Clock::now();
  auto store = ConnectStore(world, std::chrono::milliseconds(1000));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDeadlineExceeded) << store.status();
  EXPECT_THAT(std::string(store.status().message()),
              HasSubstr("only 1 of 2 ranks reached the master"));
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(3000));
}

TEST(RendezvousTest, RejectsAnInconsistentWorld) {
  WorldInfo world;
  world.rank = 2;
  world.world_size = 2;
  EXPECT_EQ(ConnectStore(world, std::chrono::seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  world.rank = 1;
  world.master_port = 0;
  EXPECT_THAT(std::string(ConnectStore(world, std::chrono::seconds(1)).status().message()),
              HasSubstr("MASTER_PORT must be in [1, 65535]"));
}

TEST(OneProcessGlooTest, CollectivesOnOneRankAreIdentities) {
  auto comm = OneProcessWorld();
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->name(), "world");
  EXPECT_STREQ(comm->backend(), "gloo");
  EXPECT_EQ(comm->global_ranks(), std::vector<int>{0});

  const at::Tensor x = at::arange(6, at::kFloat).reshape({3, 2});
  at::Tensor y = x.clone();
  comm->AllReduce(y, ReduceOp::kMax);
  EXPECT_TRUE(at::equal(y, x));
  EXPECT_TRUE(at::equal(comm->AllGather(x), x));
  EXPECT_TRUE(at::equal(comm->ReduceScatter(x), x));
  comm->Broadcast(y, 0);
  EXPECT_TRUE(at::equal(y, x));
  EXPECT_TRUE(at::equal(comm->AllToAll(x, {3}, {3}), x));
  comm->Barrier();
  at::Tensor half = x.to(at::kHalf);
  comm->AllReduce(half);
  EXPECT_TRUE(at::equal(half, x.to(at::kHalf)));

  std::unique_ptr<Communicator> self = comm->Split({0}, "tp");
  EXPECT_EQ(self->name(), "tp");
  at::Tensor z = x.clone();
  self->AllReduce(z);
  EXPECT_TRUE(at::equal(z, x));
}

TEST(OneProcessGlooTest, BadArgumentsThrowCommErrorNamingOpAndGroup) {
  auto comm = OneProcessWorld();
  ASSERT_NE(comm, nullptr);
  at::Tensor strided = at::zeros({4, 4}).t();
  EXPECT_THAT(CommErrorOf([&] { comm->AllReduce(strided); }),
              HasSubstr("all_reduce on 'world' (ranks 0): tensor is not contiguous"));
  at::Tensor flags = at::zeros({2}, at::kBool);
  EXPECT_THAT(CommErrorOf([&] { comm->AllReduce(flags); }), HasSubstr("has dtype Bool"));
  at::Tensor undefined;
  EXPECT_THAT(CommErrorOf([&] { comm->Broadcast(undefined, 0); }),
              HasSubstr("broadcast on 'world' (ranks 0): tensor is an undefined tensor"));
  at::Tensor x = at::zeros({4});
  EXPECT_THAT(CommErrorOf([&] { comm->Broadcast(x, 1); }),
              HasSubstr("peer rank 1 is outside [0, 1)"));
  EXPECT_THAT(CommErrorOf([&] { comm->AllToAll(x, {3}, {}); }),
              HasSubstr("input_splits add up to 3 rows but input has 4"));
  EXPECT_THAT(CommErrorOf([&] {
                comm->AllToAll(x, {2, 2}, {});
              }),
              HasSubstr("input_splits has 2 entries; expected one per member (1)"));
  EXPECT_THAT(CommErrorOf([&] { comm->AllToAll(x, {4}, {-1}); }),
              HasSubstr("output_splits[0] is negative"));
  EXPECT_THAT(CommErrorOf([&] { comm->AllGather(at::zeros({})); }),
              HasSubstr("all_gather on 'world' (ranks 0): input is 0-dimensional"));
  EXPECT_THAT(CommErrorOf([&] { comm->Split({1}, "tp"); }),
              HasSubstr("split on 'world' (ranks 0): 'tp': rank 1 is outside [0, 1)"));
  EXPECT_THAT(CommErrorOf([&] { comm->Split({0}, ""); }), HasSubstr("non-empty name"));
  EXPECT_THAT(CommErrorOf([&] { comm->ISend(x, 3, 0); }),
              HasSubstr("send on 'world' (ranks 0): peer rank 3 is outside [0, 1)"));
  // Argument errors are the caller's and leave the communicator usable.
  comm->AllReduce(x);
}

// A decorator that fails the k-th all_reduce: the fault injection the wrapper exists for.
class FailKthAllReduce : public CommunicatorWrapper {
 public:
  FailKthAllReduce(std::unique_ptr<Communicator> inner, int k)
      : CommunicatorWrapper(std::move(inner)), k_(k) {}
  void AllReduce(at::Tensor& tensor, ReduceOp op) override {
    if (++calls_ == k_) throw CommError("all_reduce on '" + name() + "': injected failure");
    CommunicatorWrapper::AllReduce(tensor, op);
  }

 private:
  int k_;
  int calls_ = 0;
};

TEST(CommunicatorWrapperTest, ForwardsAndCanInjectFailures) {
  FailKthAllReduce comm(OneProcessWorld(), 2);
  EXPECT_EQ(comm.name(), "world");
  EXPECT_STREQ(comm.backend(), "gloo");
  at::Tensor x = at::ones({2});
  comm.AllReduce(x, ReduceOp::kSum);
  EXPECT_THAT(CommErrorOf([&] { comm.AllReduce(x, ReduceOp::kSum); }),
              HasSubstr("injected failure"));
  EXPECT_TRUE(at::equal(comm.AllGather(x), x));
}

TEST(WorldCommunicatorTest, ParsesBackendNames) {
  EXPECT_EQ(*ParseBackend("gloo"), Backend::kGloo);
  EXPECT_EQ(*ParseBackend("nccl"), Backend::kNccl);
  EXPECT_THAT(std::string(ParseBackend("mpi").status().message()),
              HasSubstr("unknown communication backend 'mpi'"));
  EXPECT_STREQ(BackendName(Backend::kNccl), "nccl");
}

// Both backends refuse the same bad world arguments with the same words, each naming
// itself, before they touch the store or a device.
TEST(WorldCommunicatorTest, BadWorldArgumentsAreRefusedNamingTheBackend) {
  const auto store = c10::make_intrusive<c10d::HashStore>();
  const std::chrono::milliseconds second(1000);
  struct Case {
    c10::intrusive_ptr<c10d::Store> store;
    int rank, size;
    std::chrono::milliseconds timeout;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {c10::intrusive_ptr<c10d::Store>(), 0, 1, second, ": the store is null"},
           {store, 2, 2, second, ": rank 2 is outside a world of 2 processes"},
           {store, 0, 0, second, ": rank 0 is outside a world of 0 processes"},
           {store, -1, 2, second, ": rank -1 is outside a world of 2 processes"},
           {store, 0, 1, std::chrono::milliseconds(0), ": timeout must be positive, got 0 ms"}}) {
    SCOPED_TRACE(c.message);
    auto gloo = CreateGlooCommunicator(c.store, c.rank, c.size, c.timeout);
    ASSERT_FALSE(gloo.ok());
    EXPECT_EQ(gloo.status().code(), absl::StatusCode::kInvalidArgument) << gloo.status();
    EXPECT_EQ(gloo.status().message(), "gloo" + c.message);
    if (!HaveNccl()) continue;  // Without NCCL in the build: Unimplemented, whatever the arguments.
    auto nccl = CreateNcclCommunicator(c.store, c.rank, c.size, /*device=*/0, c.timeout);
    ASSERT_FALSE(nccl.ok());
    EXPECT_EQ(nccl.status().code(), absl::StatusCode::kInvalidArgument) << nccl.status();
    EXPECT_EQ(nccl.status().message(), "nccl" + c.message);
  }
}

TEST(WorldCommunicatorTest, NcclWithoutADeviceIsAClearError) {
  if (HaveNccl() && NcclVisibleDevices() > 0) GTEST_SKIP() << "this machine has a GPU";
  auto comm = CreateWorldCommunicator(WorldInfo{}, Backend::kNccl, std::chrono::seconds(5));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(),
            HaveNccl() ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kUnimplemented)
      << comm.status();
}

TEST(NcclGpuTest, OneProcessCollectives) {
  if (!HaveNccl()) GTEST_SKIP() << "built without NCCL (no CUDA toolkit with NCCL found)";
  if (NcclVisibleDevices() == 0) GTEST_SKIP() << "no CUDA device visible: NCCL needs a GPU";
  if (!at::hasCUDA()) GTEST_SKIP() << "this LibTorch has no CUDA: cannot make CUDA tensors";
  auto comm = CreateWorldCommunicator(WorldInfo{}, Backend::kNccl, std::chrono::seconds(30));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const at::Tensor x = at::arange(8, at::kFloat).reshape({4, 2}).to(at::Device(at::kCUDA, 0));
  at::Tensor y = x.clone();
  (*comm)->AllReduce(y);
  EXPECT_TRUE(at::equal(y.cpu(), x.cpu()));
  EXPECT_TRUE(at::equal((*comm)->AllGather(x).cpu(), x.cpu()));
  EXPECT_TRUE(at::equal((*comm)->ReduceScatter(x).cpu(), x.cpu()));
  EXPECT_TRUE(at::equal((*comm)->AllToAll(x, {4}, {4}).cpu(), x.cpu()));
  (*comm)->Barrier();
}

struct LaunchResult {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
  int selected = -1;  // The cases of this binary the workers' filter selects.
};

// Runs this test binary's `filter` cases on `nproc` ranks under fulcrum_launch, bounded by
// `limit_s` (coreutils timeout kills the whole launch if something hangs).
LaunchResult LaunchWorkers(int nproc, const std::string& filter, int limit_s,
                           const std::string& env = "") {
  LaunchResult result;
  const std::string launcher = std::string(FULCRUM_BIN_DIR) + "/fulcrum_launch";
  if (access(launcher.c_str(), X_OK) != 0) {
    result.output = launcher + " is missing: build the fulcrum_launch target";
    return result;
  }
  std::array<char, PATH_MAX> self{};
  const ssize_t length = readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (length <= 0) {
    result.output = "cannot find this test binary through /proc/self/exe";
    return result;
  }
  result.selected = fulcrum::testing::CountSelectedTests(std::string(self.data(), length), filter);
  const std::string command =
      "FULCRUM_COMM_WORKER=1 " + env + " timeout -k 5 " + std::to_string(limit_s) + " " + launcher +
      " --nproc_per_node=" + std::to_string(nproc) + " --master_port=0 --kill_timeout_s=2 -- " +
      std::string(self.data(), length) + " --gtest_filter='" + filter + "'";
  const auto start = Clock::now();
  result.exit_code = fulcrum::testing::RunCommand(command, &result.output);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

// Each rank ran and passed every case of the filter (tests/worker_runs.h); skipped cases
// would mean the workers did not see the launch environment.
void ExpectAllRanksPassed(const LaunchResult& run, int nproc) {
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(fulcrum::testing::RanksRanAndPassed(run.output, fulcrum::testing::FirstRanks(nproc),
                                                  run.selected))
      << run.output;
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("[  SKIPPED ]"))) << run.output;
}

TEST(SlowCollectivesTest, TwoRanks) {
  const LaunchResult run = LaunchWorkers(2, "CommWorker.*", 120);
  ExpectAllRanksPassed(run, 2);
  std::cout << "2 ranks: " << run.seconds << " s\n";
}

TEST(SlowCollectivesTest, FourRanks) {
  const LaunchResult run = LaunchWorkers(4, "CommWorker.*", 120);
  ExpectAllRanksPassed(run, 4);
  std::cout << "4 ranks: " << run.seconds << " s\n";
}

// Rank `dead` of 3 exits mid-run; the other two must pass (see CommDeadPeerWorker).
void ExpectSurvivorsPass(int dead) {
  const LaunchResult run = LaunchWorkers(3, "CommDeadPeerWorker.*", 60,
                                         "FULCRUM_TEST_DEAD_RANK=" + std::to_string(dead));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::vector<int> survivors;
  for (int r = 0; r < 3; ++r) {
    if (r != dead) survivors.push_back(r);
  }
  EXPECT_TRUE(fulcrum::testing::RanksRanAndPassed(run.output, survivors, run.selected))
      << run.output;
  EXPECT_LT(run.seconds, 30) << run.output;
}

TEST(SlowCollectivesTest, DeadPeerRaisesCommErrorWithinTheTimeout) { ExpectSurvivorsPass(2); }

TEST(SlowCollectivesTest, DeadStoreHostRaisesCommErrorWithinTheTimeout) { ExpectSurvivorsPass(0); }

// Rank 0 (the store's host) of 3 stops itself (SIGSTOP); see CommStoppedStoreHostWorker. The
// survivors check their own error and time, then exit with code 42, which ends the job; the
// launcher must kill the stopped rank, and the job must end within the timeout plus a few
// seconds rather than twice the timeout.
TEST(SlowCollectivesTest, StoppedStoreHostEndsTheJobWithinTheTimeout) {
  constexpr double kTimeoutS = 5;  // kStoppedHostTimeout in comm_worker_test.cc.
  const LaunchResult run = LaunchWorkers(3, "CommStoppedStoreHostWorker.*", 60);
  std::cout << "job with a stopped store host (timeout " << kTimeoutS << " s) ended after "
            << run.seconds << " s\n";
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("survivor's error after") != std::string::npos ||
        line.find("fulcrum_launch: rank") != std::string::npos) {
      std::cout << "  " << line << "\n";
    }
  }
  EXPECT_EQ(run.exit_code, 42) << run.output;
  for (int r = 1; r < 3; ++r) {
    EXPECT_THAT(run.output,
                HasSubstr("[rank " + std::to_string(r) + "] stopped-host survivor: checks passed"))
        << run.output;
  }
  EXPECT_LT(run.seconds, kTimeoutS + 8) << run.output;

  // The launcher reports how rank 0 ended: killed (SIGTERM or SIGKILL), and reaped.
  const std::string marker = "rank 0 (pid ";
  const size_t at = run.output.find(marker);
  ASSERT_NE(at, std::string::npos) << run.output;
  const pid_t pid = std::atoi(run.output.c_str() + at + marker.size());
  ASSERT_GT(pid, 0) << run.output;
  EXPECT_THAT(run.output.substr(at),
              ::testing::StartsWith(marker + std::to_string(pid) + ") was killed by signal"))
      << run.output;
  EXPECT_EQ(kill(pid, 0), -1) << "rank 0 (pid " << pid << ") is still there";
  EXPECT_EQ(errno, ESRCH);
}

TEST(SlowCollectivesTest, StuckPeerTimesOutInsteadOfHanging) {
  const LaunchResult run = LaunchWorkers(2, "CommStuckPeerWorker.*", 60);
  ExpectAllRanksPassed(run, 2);
}

TEST(SlowNcclCollectivesTest, TwoGpus) {
  if (!HaveNccl()) GTEST_SKIP() << "built without NCCL (no CUDA toolkit with NCCL found)";
  if (NcclVisibleDevices() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices, this machine has " << NcclVisibleDevices();
  if (!at::hasCUDA()) GTEST_SKIP() << "this LibTorch has no CUDA: cannot make CUDA tensors";
  const LaunchResult run = LaunchWorkers(2, "CommNcclWorker.*", 180);
  ExpectAllRanksPassed(run, 2);
}

}  // namespace
}  // namespace fulcrum::parallel
