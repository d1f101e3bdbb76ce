// HostStagedCommunicator (NOTE [host staging] in parallel/host_staged_communicator.h): two
// ranks (threads) over real Gloo. On the CPU the staging path is forced for CPU tensors
// (stage_cpu_tensors), so every copy and every deferred completion runs here; the same
// operations on CUDA tensors run where a GPU is visible (HostStagedCudaTest: both ranks on
// one GPU, which NCCL refuses).
#include "parallel/host_staged_communicator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include <ATen/ATen.h>

#include "parallel/gloo_communicator.h"

namespace fulcrum::parallel {
namespace {

constexpr int kSize = 2;

// Runs `body(rank, comm)` on kSize threads, each with a staged Gloo communicator of one
// shared store; returns each rank's exception message ("" when it passed).
std::vector<std::string> RunRanks(bool stage_cpu_tensors,
                                  const std::function<void(int, Communicator&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(kSize);
  auto rank_body = [&](int r) {
    try {
      GlooOptions options;
      options.hostname = "127.0.0.1";
      auto gloo = CreateGlooCommunicator(store, r, kSize, std::chrono::seconds(30), options);
      if (!gloo.ok()) throw std::runtime_error(std::string(gloo.status().message()));
      HostStagedCommunicator comm(std::move(gloo).value(), stage_cpu_tensors);
      body(r, comm);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) threads.emplace_back(rank_body, r);
  for (std::thread& t : threads) t.join();
  return errors;
}

// Every operation, each rank checking its result against the closed form. `device` holds
// the tensors; the staging copies (host and back) are what is under test.
void EveryOperation(int r, Communicator& comm, const c10::Device& device, bool staged) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  auto expect_equal = [&](const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    if (got.device() != device) throw std::runtime_error(what + ": result left " + device.str());
    if (!at::equal(got.cpu(), want)) {
      std::ostringstream text;
      text << what << ": got " << got.cpu() << " want " << want;
      throw std::runtime_error(text.str());
    }
  };
  // AllReduce in place: 1..4 + 10*r summed over r = 0, 1.
  at::Tensor x = at::arange(1, 5, opts) + 10.0 * r;
  comm.AllReduce(x);
  expect_equal(x, at::arange(1, 5, at::kFloat) * 2 + 10, "all_reduce");
  // The non-blocking one: staged, the tensor changes only at Wait.
  at::Tensor y = at::arange(1, 5, opts) + 10.0 * r;
  std::unique_ptr<CommWork> reduced = comm.IAllReduce(y);
  reduced->Wait();
  expect_equal(y, at::arange(1, 5, at::kFloat) * 2 + 10, "iall_reduce");
  // Broadcast from rank 1.
  at::Tensor b = at::full({3}, static_cast<double>(r + 7), opts);
  comm.Broadcast(b, 1);
  expect_equal(b, at::full({3}, 8.0, at::kFloat), "broadcast");
  // AllGather along dim 0.
  at::Tensor g = comm.AllGather(at::full({2, 2}, static_cast<double>(r), opts));
  expect_equal(g, at::cat({at::zeros({2, 2}), at::ones({2, 2})}), "all_gather");
  // ReduceScatter: rows 2r, 2r+1 of the sum of [0..3] + r over the ranks.
  at::Tensor rs = comm.ReduceScatter(at::arange(0, 4, opts).view({4, 1}) + r);
  expect_equal(rs, (at::arange(2 * r, 2 * r + 2, at::kFloat) * 2 + 1).view({2, 1}),
               "reduce_scatter");
  // AllToAll with uneven splits: rank r sends r+1 rows to each peer.
  at::Tensor a_in = at::full({2 * (r + 1), 1}, static_cast<double>(r), opts);
  at::Tensor a = comm.AllToAll(a_in, {r + 1, r + 1}, {1, 2});
  expect_equal(a, at::cat({at::zeros({1, 1}), at::ones({2, 1})}), "all_to_all");
  PendingTensor pending = comm.IAllToAll(a_in, {r + 1, r + 1}, {1, 2});
  pending.work->Wait();
  expect_equal(pending.tensor, at::cat({at::zeros({1, 1}), at::ones({2, 1})}), "iall_to_all");

  // Point to point. Staged, into a strided view (column 1 of a 3x2 matrix) that changes only
  // at Wait, when the host buffer is copied back.
  if (r == 0) {
    at::Tensor sent = at::arange(1, 4, opts);
    std::unique_ptr<CommWork> work = comm.ISend(sent, 1, /*tag=*/5);
    if (staged) sent.fill_(-1);  // staged: the host copy was taken when ISend returned
    work->Wait();
  } else if (staged) {
    // Staged, the receive may land in a strided view: the copy back writes through it.
    at::Tensor matrix = at::zeros({3, 2}, opts);
    at::Tensor column = matrix.select(1, 1);
    std::unique_ptr<CommWork> work = comm.IRecv(column, 0, /*tag=*/5);
    if (matrix.abs().sum().item<double>() != 0) {
      throw std::runtime_error("irecv: the target changed before Wait");
    }
    work->Wait();
    work->Wait();  // idempotent
    expect_equal(matrix, at::stack({at::zeros({3}), at::arange(1, 4, at::kFloat)}, 1), "irecv");
  } else {
    at::Tensor target = at::zeros({3}, opts);
    comm.IRecv(target, 0, /*tag=*/5)->Wait();
    expect_equal(target, at::arange(1, 4, at::kFloat), "irecv");
  }
  // A split is staged too.
  std::unique_ptr<Communicator> pair = comm.Split({0, 1}, "pair");
  if (dynamic_cast<HostStagedCommunicator*>(pair.get()) == nullptr) {
    throw std::runtime_error("split: not staged");
  }
  at::Tensor s = at::full({2}, static_cast<double>(r + 1), opts);
  pair->AllReduce(s);
  expect_equal(s, at::full({2}, 3.0, at::kFloat), "split all_reduce");
}

TEST(HostStagedTest, EveryOperationThroughTheStagingPathMatchesTheClosedForm) {
  for (const std::string& error : RunRanks(/*stage_cpu_tensors=*/true, [](int r, Communicator& c) {
         EveryOperation(r, c, c10::Device(c10::kCPU), /*staged=*/true);
       })) {
    EXPECT_EQ(error, "");
  }
}

TEST(HostStagedTest, CpuTensorsGoStraightThroughByDefault) {
  // Unstaged, a send's buffer is Gloo's until Wait and a receive lands when Gloo delivers
  // it: the checks of the staging's copies are off.
  for (const std::string& error : RunRanks(/*stage_cpu_tensors=*/false, [](int r, Communicator& c) {
         EveryOperation(r, c, c10::Device(c10::kCPU), /*staged=*/false);
       })) {
    EXPECT_EQ(error, "");
  }
}

TEST(HostStagedCudaTest, TwoRanksShareOneGpu) {
  if (!at::hasCUDA() || at::getNumGPUs() == 0) GTEST_SKIP() << "no CUDA device visible";
  for (const std::string& error : RunRanks(/*stage_cpu_tensors=*/false, [](int r, Communicator& c) {
         EveryOperation(r, c, c10::Device(c10::kCUDA, 0), /*staged=*/true);
       })) {
    EXPECT_EQ(error, "");
  }
}

}  // namespace
}  // namespace fulcrum::parallel
