// The per-rank halves of the multi-process communicator tests (suites *Worker, which ctest
// does not register). Every case here does nothing (skips) unless the process was started
// by a SlowCollectivesTest driver in communicator_test.cc, which runs
//   FULCRUM_COMM_WORKER=1 fulcrum_launch --nproc_per_node=N -- parallel_test
//       --gtest_filter=CommWorker.*
// so each of the N ranks runs the same cases in the same order against a real Gloo world.
// Expected values are closed forms of the ranks (the all-reduce of `rank` over n ranks is
// n(n-1)/2), so every rank checks its own result.
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/world.h"
#include "parallel/world_communicator.h"

namespace fulcrum::parallel {
namespace {

using ::testing::HasSubstr;

constexpr std::chrono::milliseconds kWorldTimeout{20000};

bool IsWorker() {
  const char* worker = std::getenv("FULCRUM_COMM_WORKER");
  return worker != nullptr && std::string(worker) == "1" && std::getenv("RANK") != nullptr;
}

#define SKIP_UNLESS_WORKER()                                                    \
  if (!IsWorker()) {                                                            \
    GTEST_SKIP() << "runs only under fulcrum_launch, started by SlowComm*Test"; \
  }

std::unique_ptr<Communicator>& WorldSlot() {
  static std::unique_ptr<Communicator> world;
  return world;
}

// The job's world communicator, created on first use; every case of a worker process
// shares it (and so exercises one long-lived communicator, as training does).
Communicator& World() {
  auto& world = WorldSlot();
  if (!world) {
    auto info = WorldInfoFromEnvironment();
    if (!info.ok()) throw CommError(std::string(info.status().message()));
    auto comm = CreateWorldCommunicator(*info, Backend::kGloo, kWorldTimeout);
    if (!comm.ok()) throw CommError(std::string(comm.status().message()));
    world = std::move(comm).value();
  }
  return *world;
}

// Closes the world together: a rank that left while a peer still waited on its last
// message would turn the peer's success into "connection closed".
class WorldEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    auto& world = WorldSlot();
    if (!world) return;
    try {
      world->Barrier();
    } catch (const CommError& e) {
      ADD_FAILURE() << "final barrier: " << e.what();
    }
    world.reset();
  }
};
const auto* const kWorldEnvironment = ::testing::AddGlobalTestEnvironment(new WorldEnvironment);

at::TensorOptions Opts(at::ScalarType type) { return at::TensorOptions().dtype(type); }

TEST(CommWorker, AllReduceSumMaxMinOfRankValues) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  for (at::ScalarType type : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(type));
    // Element i holds 10*rank + i, so the expected values differ per element.
    const at::Tensor index = at::arange(6, Opts(at::kLong)).reshape({2, 3});
    at::Tensor sum = (index + 10 * r).to(type);
    at::Tensor max = sum.clone();
    at::Tensor min = sum.clone();
    comm.AllReduce(sum, ReduceOp::kSum);
    comm.AllReduce(max, ReduceOp::kMax);
    comm.AllReduce(min, ReduceOp::kMin);
    EXPECT_TRUE(at::equal(sum, (index * n + 10 * n * (n - 1) / 2).to(type))) << sum;
    EXPECT_TRUE(at::equal(max, (index + 10 * (n - 1)).to(type))) << max;
    EXPECT_TRUE(at::equal(min, index.to(type))) << min;
  }
}

// Several non-blocking all_reduces in flight at once, then a blocking collective issued
// behind them: each ends with the bits the blocking AllReduce gives the same input (random
// fp32 values: the order of the additions shows in the last bits), bfloat16 rounded once.
TEST(CommWorker, NonBlockingAllReducesInFlightEqualTheBlockingOnes) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int r = comm.rank();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + r);
  std::vector<at::Tensor> pending, blocking;
  std::vector<std::unique_ptr<CommWork>> works;
  for (int i = 0; i < 4; ++i) {
    const at::ScalarType type = i == 3 ? at::kBFloat16 : at::kFloat;
    at::Tensor x = at::randn({1000 + 37 * i}, gen, Opts(at::kFloat)).to(type);
    blocking.push_back(x.clone());
    pending.push_back(x);
    works.push_back(comm.IAllReduce(pending.back(), ReduceOp::kSum));
  }
  at::Tensor behind = at::full({3}, static_cast<double>(r), Opts(at::kDouble));
  comm.AllReduce(behind, ReduceOp::kMax);  // issued after the four, waited first
  EXPECT_EQ(behind[0].item<double>(), comm.size() - 1);
  for (int i = 0; i < 4; ++i) {
    works[i]->Wait();
    works[i]->Wait();  // a second wait is a no-op
    comm.AllReduce(blocking[i], ReduceOp::kSum);
    EXPECT_TRUE(at::equal(pending[i], blocking[i])) << "in flight #" << i;
  }
}

// Non-blocking reduce-scatters in flight, their inputs overwritten at once (the call keeps
// its own copy): each returns this rank's chunk of the blocking all_reduce of the original
// input, bit for bit (Gloo's is that all_reduce, run on c10d's worker), bfloat16 included;
// at two ranks also the ring ReduceScatter's bits (both add x_r + x_other).
TEST(CommWorker, NonBlockingReduceScattersReturnThisRanksChunkOfTheSum) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2000 + r);
  std::vector<at::Tensor> originals;
  std::vector<PendingTensor> pending;
  for (int i = 0; i < 3; ++i) {
    const at::ScalarType type = i == 2 ? at::kBFloat16 : at::kFloat;
    at::Tensor x = at::randn({n * (500 + 13 * i)}, gen, Opts(at::kFloat)).to(type);
    originals.push_back(x.clone());
    pending.push_back(comm.IReduceScatter(x, ReduceOp::kSum));
    x.fill_(1e6);  // the collective works on its own copy
  }
  for (int i = 0; i < 3; ++i) {
    pending[i].work->Wait();
    const int64_t rows = originals[i].size(0) / n;
    at::Tensor whole = originals[i].clone();
    comm.AllReduce(whole, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(pending[i].tensor, whole.narrow(0, r * rows, rows))) << "#" << i;
    if (n == 2) {
      EXPECT_TRUE(at::equal(pending[i].tensor, comm.ReduceScatter(originals[i], ReduceOp::kSum)))
          << "#" << i;
    }
  }
}

TEST(CommWorker, AllGatherConcatenatesRowsInRankOrder) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  for (at::ScalarType type : {at::kFloat, at::kLong, at::kBFloat16}) {
    at::Tensor input = at::full({2, 3}, comm.rank(), Opts(type));
    at::Tensor output = comm.AllGather(input);
    ASSERT_EQ(output.sizes(), (std::vector<int64_t>{2 * n, 3}));
    for (int j = 0; j < n; ++j) {
      EXPECT_TRUE(at::equal(output.narrow(0, 2 * j, 2), at::full({2, 3}, j, Opts(type))))
          << "rows from rank " << j << ": " << output;
    }
  }
}

TEST(CommWorker, ReduceScatterReturnsThisRanksReducedChunk) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  // Chunk c of rank q's input holds (q+1)*(c+1): the sum of chunk r is (r+1)*n(n+1)/2,
  // the max (r+1)*n.
  at::Tensor input = at::empty({2 * n, 4}, Opts(at::kDouble));
  for (int c = 0; c < n; ++c) input.narrow(0, 2 * c, 2).fill_((r + 1) * (c + 1));
  at::Tensor sum = comm.ReduceScatter(input, ReduceOp::kSum);
  at::Tensor max = comm.ReduceScatter(input, ReduceOp::kMax);
  EXPECT_TRUE(at::equal(sum, at::full({2, 4}, (r + 1) * n * (n + 1) / 2, Opts(at::kDouble))))
      << sum;
  EXPECT_TRUE(at::equal(max, at::full({2, 4}, (r + 1) * n, Opts(at::kDouble)))) << max;
  EXPECT_TRUE(at::equal(input.narrow(0, 0, 2), at::full({2, 4}, r + 1, Opts(at::kDouble))))
      << "reduce_scatter must not modify its input";
}

// NOTE [ring reduce-scatter]: the ring's chunk r equals the all_reduce's chunk r — bit for
// bit on two ranks (x_r + x_other either way), within the reassociation of n fp32 adds on
// more.
TEST(CommWorker, RingReduceScatterMatchesAllReduceOfTheWhole) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  for (at::ScalarType type : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(100 + r);
    const int64_t rows = 3 * n;
    at::Tensor input = at::randn({rows, 5}, Opts(at::kFloat)).to(type);
    at::Tensor whole = input.clone();
    comm.AllReduce(whole, ReduceOp::kSum);
    const at::Tensor expected = whole.narrow(0, r * 3, 3);
    const at::Tensor got = comm.ReduceScatter(input, ReduceOp::kSum);
    ASSERT_EQ(got.scalar_type(), type);
    ASSERT_EQ(got.sizes(), expected.sizes());
    if (n == 2) {
      EXPECT_TRUE(at::equal(got, expected)) << (got - expected).abs().max();
    } else {
      // fp32: the reassociation; bf16: it can move a rounding by one bf16 step (2^-7 relative).
      const double rtol = type == at::kBFloat16 ? 1.0 / 128 : 0.0;
      EXPECT_TRUE(at::allclose(got.to(at::kFloat), expected.to(at::kFloat), rtol, 1e-6))
          << (got.to(at::kFloat) - expected.to(at::kFloat)).abs().max();
    }
    const at::Tensor min = comm.ReduceScatter(input, ReduceOp::kMin);
    at::Tensor whole_min = input.clone();
    comm.AllReduce(whole_min, ReduceOp::kMin);
    EXPECT_TRUE(at::equal(min, whole_min.narrow(0, r * 3, 3)));
  }
}

TEST(CommWorker, BroadcastFromTheLastRank) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int root = comm.size() - 1;
  const at::Tensor expected = at::arange(12, Opts(at::kFloat)).reshape({3, 4}) * 7;
  at::Tensor tensor = comm.rank() == root ? expected.clone() : at::zeros({3, 4});
  comm.Broadcast(tensor, root);
  EXPECT_TRUE(at::equal(tensor, expected)) << tensor;
}

TEST(CommWorker, AllToAllEqualSplits) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  // Block j (2 rows) goes to rank j and holds 100*r + j; block j of the output came from
  // rank j and so holds 100*j + r.
  at::Tensor input = at::empty({2 * n, 3}, Opts(at::kLong));
  for (int j = 0; j < n; ++j) input.narrow(0, 2 * j, 2).fill_(100 * r + j);
  at::Tensor output = comm.AllToAll(input, {}, {});
  ASSERT_EQ(output.sizes(), input.sizes());
  for (int j = 0; j < n; ++j) {
    EXPECT_TRUE(
        at::equal(output.narrow(0, 2 * j, 2), at::full({2, 3}, 100 * j + r, Opts(at::kLong))))
        << "block from rank " << j << ": " << output;
  }
}

TEST(CommWorker, AllToAllUnequalSplits) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  // Rank q sends q+j+1 rows to rank j; row k of that block holds 1000*q + 10*j + k.
  std::vector<int64_t> send(n), recv(n);
  for (int j = 0; j < n; ++j) {
    send[j] = r + j + 1;
    recv[j] = j + r + 1;
  }
  std::vector<at::Tensor> blocks;
  for (int j = 0; j < n; ++j) {
    blocks.push_back(
        (at::arange(send[j], Opts(at::kFloat)) + 1000 * r + 10 * j).unsqueeze(1).repeat({1, 2}));
  }
  at::Tensor output = comm.AllToAll(at::cat(blocks), send, recv);
  int64_t offset = 0;
  for (int j = 0; j < n; ++j) {
    const at::Tensor expected =
        (at::arange(recv[j], Opts(at::kFloat)) + 1000 * j + 10 * r).unsqueeze(1).repeat({1, 2});
    EXPECT_TRUE(at::equal(output.narrow(0, offset, recv[j]), expected))
        << "block from rank " << j << ": " << output;
    offset += recv[j];
  }
  EXPECT_EQ(output.size(0), offset);
}

TEST(CommWorker, AllToAllWithEmptyBlocks) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  // Rank q sends q+1 rows (value q) to rank j when q+j is odd, nothing otherwise: the
  // token exchange of a router that leaves some experts idle.
  auto rows = [](int q, int j) -> int64_t { return (q + j) % 2 == 1 ? q + 1 : 0; };
  std::vector<int64_t> send(n), recv(n);
  int64_t total_send = 0;
  for (int j = 0; j < n; ++j) {
    send[j] = rows(r, j);
    recv[j] = rows(j, r);
    total_send += send[j];
  }
  at::Tensor output = comm.AllToAll(at::full({total_send, 2}, r, Opts(at::kInt)), send, recv);
  int64_t offset = 0;
  for (int j = 0; j < n; ++j) {
    EXPECT_TRUE(
        at::equal(output.narrow(0, offset, recv[j]), at::full({recv[j], 2}, j, Opts(at::kInt))));
    offset += recv[j];
  }
  EXPECT_EQ(output.size(0), offset);
}

TEST(CommWorker, SendRecvRingWithTags) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  const int n = comm.size();
  const int r = comm.rank();
  const int next = (r + 1) % n;
  const int prev = (r + n - 1) % n;
  // Two messages to the same peer, told apart by tag only; the receives are posted in the
  // opposite order to the sends, so a backend that ignored tags would swap them.
  at::Tensor a = at::full({4}, r, Opts(at::kLong));
  at::Tensor b = at::full({4}, 100 + r, Opts(at::kLong));
  at::Tensor got_a = at::zeros({4}, Opts(at::kLong));
  at::Tensor got_b = at::zeros({4}, Opts(at::kLong));
  auto send_a = comm.ISend(a, next, /*tag=*/7);
  auto send_b = comm.ISend(b, next, /*tag=*/8);
  auto recv_b = comm.IRecv(got_b, prev, /*tag=*/8);
  auto recv_a = comm.IRecv(got_a, prev, /*tag=*/7);
  recv_b->Wait();
  recv_a->Wait();
  send_a->Wait();
  send_b->Wait();
  EXPECT_TRUE(at::equal(got_a, at::full({4}, prev, Opts(at::kLong)))) << got_a;
  EXPECT_TRUE(at::equal(got_b, at::full({4}, 100 + prev, Opts(at::kLong)))) << got_b;

  // The blocking forms, as a pipeline stage uses them: even ranks send first.
  at::Tensor token = at::full({2, 2}, r, Opts(at::kFloat));
  at::Tensor received = at::empty({2, 2});
  if (r % 2 == 0) {
    comm.Send(token, next, 1);
    comm.Recv(received, prev, 1);
  } else {
    comm.Recv(received, prev, 1);
    comm.Send(token, next, 1);
  }
  EXPECT_TRUE(at::equal(received, at::full({2, 2}, prev, Opts(at::kFloat))));
}

TEST(CommWorker, BarrierWaitsForTheSlowestRank) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = World();
  comm.Barrier();
  constexpr auto kDelay = std::chrono::milliseconds(300);
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == 0) std::this_thread::sleep_for(kDelay);
  comm.Barrier();
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, kDelay * 2 / 3) << "left the barrier before rank 0 entered it";
}

TEST(CommWorker, SplitIntoHalves) {
  SKIP_UNLESS_WORKER();
  Communicator& world = World();
  const int n = world.size();
  const int r = world.rank();
  const int half = n / 2;
  const bool low = r < half;
  std::vector<int> members;
  for (int q = low ? 0 : half; q < (low ? half : n); ++q) members.push_back(q);
  std::unique_ptr<Communicator> sub = world.Split(members, low ? "low" : "high");
  ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
  EXPECT_EQ(sub->rank(), low ? r : r - half);
  EXPECT_EQ(sub->global_ranks(), members);
  EXPECT_EQ(sub->name(), low ? "low" : "high");
  EXPECT_STREQ(sub->backend(), "gloo");

  at::Tensor sum = at::full({3}, r, Opts(at::kLong));
  sub->AllReduce(sum);
  int64_t expected = 0;
  for (int q : members) expected += q;
  EXPECT_TRUE(at::equal(sum, at::full({3}, expected, Opts(at::kLong)))) << sum;

  at::Tensor gathered = sub->AllGather(at::full({1}, r, Opts(at::kLong)));
  EXPECT_TRUE(at::equal(gathered, at::tensor(std::vector<int64_t>(members.begin(), members.end()))))
      << gathered;

  // The parent keeps working while the halves exist.
  at::Tensor all = at::ones({1});
  world.AllReduce(all);
  EXPECT_EQ(all.item<float>(), n);

  // Errors on a sub-communicator name it.
  try {
    sub->AllToAll(at::zeros({4}), {1}, {});
    ADD_FAILURE() << "all_to_all with one split entry did not throw";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr(low ? "all_to_all on 'low'" : "all_to_all on 'high'"));
    EXPECT_THAT(e.what(), HasSubstr("input_splits"));
  }
}

TEST(CommWorker, SplitIntoOddAndEvenRanks) {
  SKIP_UNLESS_WORKER();
  Communicator& world = World();
  const int n = world.size();
  const int r = world.rank();
  std::vector<int> members;
  for (int q = r % 2; q < n; q += 2) members.push_back(q);
  std::unique_ptr<Communicator> sub = world.Split(members, "parity");
  EXPECT_EQ(sub->global_ranks(), members);
  EXPECT_EQ(sub->rank(), r / 2);

  at::Tensor max = at::full({2}, r, Opts(at::kInt));
  sub->AllReduce(max, ReduceOp::kMax);
  EXPECT_TRUE(at::equal(max, at::full({2}, members.back(), Opts(at::kInt))));

  // Broadcast from the sub-communicator's last member; send/recv between its members use
  // sub-communicator ranks.
  at::Tensor value = at::full({2}, r, Opts(at::kFloat));
  sub->Broadcast(value, sub->size() - 1);
  EXPECT_TRUE(at::equal(value, at::full({2}, members.back(), Opts(at::kFloat))));
  if (sub->size() > 1) {
    const int next = (sub->rank() + 1) % sub->size();
    const int prev = (sub->rank() + sub->size() - 1) % sub->size();
    at::Tensor got = at::empty({2});
    auto send = sub->ISend(at::full({2}, r, Opts(at::kFloat)), next, 3);
    sub->Recv(got, prev, 3);
    send->Wait();
    EXPECT_TRUE(at::equal(got, at::full({2}, members[prev], Opts(at::kFloat))));
  }

  // A split of a split, and the same split again: keys never collide.
  std::unique_ptr<Communicator> again = world.Split(members, "parity");
  std::unique_ptr<Communicator> self = sub->Split({sub->rank()}, "self");
  at::Tensor one = at::ones({1});
  again->AllReduce(one);
  EXPECT_EQ(one.item<float>(), static_cast<float>(members.size()));
  self->AllReduce(one);
  EXPECT_EQ(one.item<float>(), static_cast<float>(members.size()));
  EXPECT_EQ(self->global_ranks(), std::vector<int>{r});
}

// Run alone (its own launch, 3 ranks): rank FULCRUM_TEST_DEAD_RANK dies after a barrier;
// the survivors' next collective must fail within a few seconds, naming the operation, the
// group and the dead rank (or, when the dead rank hosted the store, saying so), and leave
// the communicator failing fast.
TEST(CommDeadPeerWorker, SurvivorsGetCommErrorNamingOpGroupAndPeer) {
  SKIP_UNLESS_WORKER();
  auto info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  constexpr std::chrono::milliseconds kTimeout{3000};
  auto comm = CreateWorldCommunicator(*info, Backend::kGloo, kTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& world = **comm;
  const char* dead_env = std::getenv("FULCRUM_TEST_DEAD_RANK");
  const int dead = dead_env != nullptr ? std::atoi(dead_env) : world.size() - 1;
  world.Barrier();
  if (world.rank() == dead) {
    std::fflush(nullptr);
    _exit(0);  // Dies without closing anything properly, as a crashed process would.
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  at::Tensor tensor = at::ones({1024});
  const auto start = std::chrono::steady_clock::now();
  try {
    world.AllReduce(tensor);
    ADD_FAILURE() << "all_reduce with a dead peer did not throw";
  } catch (const CommError& e) {
    const auto took = std::chrono::steady_clock::now() - start;
    std::cerr << "survivor's error: " << e.what() << "\n";
    EXPECT_LT(took, kTimeout + std::chrono::milliseconds(2500)) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("all_reduce on 'world' (ranks 0,1,2)"));
    if (dead == 0) {
      EXPECT_THAT(e.what(), HasSubstr("store is unreachable too, so world rank 0"));
    } else {
      const std::string peer = std::to_string(dead);
      EXPECT_THAT(e.what(), HasSubstr("no sign of rank " + peer + " (world rank " + peer + ")"));
    }
  }
  try {
    world.Barrier();
    ADD_FAILURE() << "a failed communicator kept working";
  } catch (const CommError& e) {
    EXPECT_THAT(e.what(), HasSubstr("barrier on 'world'"));
    EXPECT_THAT(e.what(), HasSubstr("unusable after an earlier failure"));
  }
  if (world.rank() == 0 && dead != 0) {
    // Rank 0 hosts the store the other survivor probes to name the dead peer: exiting first
    // would make that probe report a dead store instead (a race the test must not have).
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  }
}

// Run alone (its own launch, 3 ranks, SlowCollectivesTest.StoppedStoreHost...): rank 0, the
// store's host, stops itself (SIGSTOP) after a barrier, as a hung process would. The
// survivors' all_reduce must fail with a CommError naming rank 0 within the timeout plus the
// failure probe's bound (kProbeCallTimeout in gloo_communicator.cc, 2 s), not within twice
// the timeout. Each survivor then exits non-zero, as a training job would, so the launcher
// ends the job and kills the stopped rank; the driver checks that it did.
constexpr std::chrono::milliseconds kStoppedHostTimeout{5000};
constexpr int kStoppedHostSurvivorExit = 42;

TEST(CommStoppedStoreHostWorker, SurvivorsFailWithinTheTimeoutPlusTheProbeBound) {
  SKIP_UNLESS_WORKER();
  auto info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  auto comm = CreateWorldCommunicator(*info, Backend::kGloo, kStoppedHostTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& world = **comm;
  world.Barrier();
  if (world.rank() == 0) {
    std::fflush(nullptr);
    raise(SIGSTOP);  // Hung: sockets stay open, nothing answers. Only SIGKILL ends it.
    ADD_FAILURE() << "rank 0 was continued; the launcher should have killed it";
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // Rank 0 is stopped by now.
  at::Tensor tensor = at::ones({1024});
  const auto start = std::chrono::steady_clock::now();
  try {
    world.AllReduce(tensor);
    ADD_FAILURE() << "all_reduce with a stopped peer did not throw";
  } catch (const CommError& e) {
    const auto took = std::chrono::steady_clock::now() - start;
    std::cerr << "survivor's error after " << std::chrono::duration<double>(took).count()
              << " s: " << e.what() << "\n";
    // The timeout, Gloo's grace (250 ms), the probe's bound (2 s) and 1 s of slack; the old
    // probe waited for the whole store timeout again (about 2 x 5 s).
    EXPECT_LT(std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
              (kStoppedHostTimeout + std::chrono::milliseconds(3250)).count())
        << e.what();
    EXPECT_THAT(e.what(),
                HasSubstr("all_reduce on 'world' (ranks 0,1,2): timed out after 5000 ms"));
    EXPECT_THAT(e.what(), HasSubstr("store is unreachable too, so world rank 0"));
  }
  if (!::testing::Test::HasFailure()) std::cerr << "stopped-host survivor: checks passed\n";
  std::fflush(nullptr);
  _exit(kStoppedHostSurvivorExit);  // Ends the job: the launcher stops the other ranks.
}

// Run alone (its own launch, 2 ranks): rank 1 is alive but skips calls, the case that
// hangs naive code. First it skips a Split: rank 0's Split must fail after about the
// timeout, naming both groups, and leave the world usable. Then it skips an all_reduce:
// rank 0 must get a timeout CommError naming rank 1.
TEST(CommStuckPeerWorker, SplitAndCollectiveTimeOutNamingTheSilentRank) {
  SKIP_UNLESS_WORKER();
  auto info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  constexpr std::chrono::milliseconds kTimeout{1500};
  auto comm = CreateWorldCommunicator(*info, Backend::kGloo, kTimeout);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& world = **comm;
  world.Barrier();

  if (world.rank() == 1) {
    std::this_thread::sleep_for(kTimeout);
  } else {
    const auto start = std::chrono::steady_clock::now();
    try {
      world.Split({0, 1}, "pair");
      ADD_FAILURE() << "split without its other member did not throw";
    } catch (const CommError& e) {
      std::cerr << "split error: " << e.what() << "\n";
      EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout + std::chrono::seconds(2));
      EXPECT_THAT(e.what(), HasSubstr("split of 'world' (ranks 0,1) into 'pair' (ranks 0,1)"));
    }
  }
  world.Barrier();  // A failed Split leaves the parent usable.

  if (world.rank() == 1) {
    std::this_thread::sleep_for(kTimeout + std::chrono::milliseconds(1500));
    return;
  }
  at::Tensor tensor = at::ones({16});
  const auto start = std::chrono::steady_clock::now();
  try {
    world.AllReduce(tensor);
    ADD_FAILURE() << "all_reduce without its peer did not throw";
  } catch (const CommError& e) {
    const auto took = std::chrono::steady_clock::now() - start;
    std::cerr << "all_reduce error: " << e.what() << "\n";
    EXPECT_GE(took, kTimeout);
    EXPECT_LT(took, kTimeout + std::chrono::milliseconds(2000));
    EXPECT_THAT(e.what(), HasSubstr("all_reduce on 'world' (ranks 0,1): timed out after 1500 ms"));
    EXPECT_THAT(e.what(), HasSubstr("no sign of rank 1 (world rank 1)"));
  }
}

// The NCCL backend on real GPUs (SlowNcclCollectivesTest, 2 GPUs and a CUDA LibTorch).
TEST(CommNcclWorker, CollectivesSplitAndSendRecv) {
  SKIP_UNLESS_WORKER();
  if (!HaveNccl() || NcclVisibleDevices() == 0 || !at::hasCUDA()) {
    GTEST_SKIP() << "needs NCCL, a GPU and a CUDA LibTorch";
  }
  auto info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  auto created = CreateWorldCommunicator(*info, Backend::kNccl, std::chrono::seconds(60));
  ASSERT_TRUE(created.ok()) << created.status();
  Communicator& comm = **created;
  const at::Device gpu(at::kCUDA, info->local_rank);
  const int n = comm.size();
  const int r = comm.rank();

  at::Tensor sum = at::full({4}, r, Opts(at::kFloat)).to(gpu);
  comm.AllReduce(sum);
  EXPECT_TRUE(at::equal(sum.cpu(), at::full({4}, n * (n - 1) / 2, Opts(at::kFloat))));

  at::Tensor gathered = comm.AllGather(at::full({1, 2}, r, Opts(at::kLong)).to(gpu)).cpu();
  for (int j = 0; j < n; ++j) EXPECT_EQ(gathered[j][0].item<int64_t>(), j);

  at::Tensor input = at::empty({n, 2}, Opts(at::kFloat));
  for (int c = 0; c < n; ++c) input[c].fill_((r + 1) * (c + 1));
  at::Tensor chunk = comm.ReduceScatter(input.to(gpu)).cpu();
  EXPECT_TRUE(at::equal(chunk, at::full({1, 2}, (r + 1) * n * (n + 1) / 2, Opts(at::kFloat))));

  std::vector<int64_t> send(n), recv(n);
  std::vector<at::Tensor> blocks;
  for (int j = 0; j < n; ++j) {
    send[j] = r + j + 1;
    recv[j] = j + r + 1;
    blocks.push_back(at::full({send[j], 3}, 10 * r + j, Opts(at::kFloat)));
  }
  at::Tensor exchanged = comm.AllToAll(at::cat(blocks).to(gpu), send, recv).cpu();
  int64_t offset = 0;
  for (int j = 0; j < n; ++j) {
    EXPECT_TRUE(at::equal(exchanged.narrow(0, offset, recv[j]),
                          at::full({recv[j], 3}, 10 * j + r, Opts(at::kFloat))));
    offset += recv[j];
  }

  // Every rank sends before it receives: safe because queued operations launch together.
  at::Tensor got = at::zeros({8}, Opts(at::kFloat)).to(gpu);
  auto sent = comm.ISend(at::full({8}, r, Opts(at::kFloat)).to(gpu), (r + 1) % n, 0);
  auto received = comm.IRecv(got, (r + n - 1) % n, 0);
  received->Wait();
  sent->Wait();
  EXPECT_TRUE(at::equal(got.cpu(), at::full({8}, (r + n - 1) % n, Opts(at::kFloat))));

  std::unique_ptr<Communicator> self = comm.Split({r}, "self");
  at::Tensor one = at::ones({1}, Opts(at::kFloat)).to(gpu);
  self->AllReduce(one);
  EXPECT_EQ(one.cpu().item<float>(), 1.0f);
  comm.Barrier();
}

}  // namespace
}  // namespace fulcrum::parallel
