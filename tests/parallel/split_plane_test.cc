// Tests of the control plane (NOTE [control plane] in parallel/split_plane_communicator.h):
// which plane each tensor takes, that splits keep both planes, that ProcessGroupContext's
// CPU values go through the control plane, and --distributed_backend's resolution against
// the device. Gloo plays both roles on the CPU; the NCCL pairing is GPU-only (NcclGpuTest).
#include "parallel/split_plane_communicator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "parallel/communicator_wrapper.h"
#include "parallel/gloo_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/process_groups.h"
#include "parallel/world_communicator.h"

namespace fulcrum::parallel {
namespace {

using ::testing::HasSubstr;

// What one plane was asked to carry, shared by the plane and every split of it.
struct PlaneLog {
  std::atomic<int> tensor_ops{0};   // Collectives and point-to-point calls.
  std::atomic<int> barriers{0};
  std::atomic<int> splits{0};
};

// A plane that counts what it carries. `forward` false: it records and returns without
// communicating (stands in for NCCL on a machine without a GPU; one rank only).
class CountingPlane : public CommunicatorWrapper {
 public:
  CountingPlane(std::unique_ptr<Communicator> inner, std::shared_ptr<PlaneLog> log, bool forward)
      : CommunicatorWrapper(std::move(inner)), log_(std::move(log)), forward_(forward) {}

  void AllReduce(at::Tensor& t, ReduceOp op) override {
    ++log_->tensor_ops;
    if (forward_) CommunicatorWrapper::AllReduce(t, op);
  }
  at::Tensor AllGather(const at::Tensor& t) override {
    ++log_->tensor_ops;
    return forward_ ? CommunicatorWrapper::AllGather(t) : t;
  }
  void Broadcast(at::Tensor& t, int root) override {
    ++log_->tensor_ops;
    if (forward_) CommunicatorWrapper::Broadcast(t, root);
  }
  at::Tensor AllToAll(const at::Tensor& t, const std::vector<int64_t>& in,
                      const std::vector<int64_t>& out) override {
    ++log_->tensor_ops;
    return forward_ ? CommunicatorWrapper::AllToAll(t, in, out) : t;
  }
  void Barrier() override {
    ++log_->barriers;
    CommunicatorWrapper::Barrier();
  }
  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override {
    ++log_->splits;
    return std::make_unique<CountingPlane>(CommunicatorWrapper::Split(ranks, name), log_,
                                           forward_);
  }

 private:
  std::shared_ptr<PlaneLog> log_;
  bool forward_;
};

std::unique_ptr<Communicator> GlooWorld(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size) {
  GlooOptions options;
  options.hostname = "127.0.0.1";
  auto comm = CreateGlooCommunicator(store, rank, size, std::chrono::seconds(30), options);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

TEST(SplitPlaneTest, CpuTensorsTakeTheControlPlaneOthersTheTensorPlane) {
  auto tensor_log = std::make_shared<PlaneLog>();
  auto control_log = std::make_shared<PlaneLog>();
  auto store = c10::make_intrusive<c10d::HashStore>();
  SplitPlaneCommunicator comm(
      std::make_unique<CountingPlane>(GlooWorld(store, 0, 1), tensor_log, /*forward=*/false),
      std::make_unique<CountingPlane>(GlooWorld(store, 0, 1), control_log, /*forward=*/true));
  EXPECT_STREQ(comm.backend(), "gloo+gloo");

  at::Tensor cpu = at::ones({3}, at::kDouble);
  comm.AllReduce(cpu);
  comm.AllGather(cpu);
  comm.Broadcast(cpu, 0);
  EXPECT_EQ(control_log->tensor_ops, 3);
  EXPECT_EQ(tensor_log->tensor_ops, 0);

  // A tensor on any other device (a meta tensor here, a CUDA one in training) goes to the
  // tensor plane, which does not forward it.
  at::Tensor elsewhere = at::empty({3}, at::TensorOptions().device(at::kMeta));
  comm.AllReduce(elsewhere);
  comm.AllToAll(elsewhere, {}, {});
  EXPECT_EQ(tensor_log->tensor_ops, 2);
  EXPECT_EQ(control_log->tensor_ops, 3);
  EXPECT_EQ(&comm.PlaneOf(elsewhere), &comm.tensor_plane());
  EXPECT_EQ(&comm.PlaneOf(cpu), &comm.control_plane());

  comm.Barrier();
  EXPECT_EQ(control_log->barriers, 1);
  EXPECT_EQ(tensor_log->barriers, 0);
}

TEST(SplitPlaneTest, SplitKeepsBothPlanes) {
  auto tensor_log = std::make_shared<PlaneLog>();
  auto control_log = std::make_shared<PlaneLog>();
  auto store = c10::make_intrusive<c10d::HashStore>();
  SplitPlaneCommunicator comm(
      std::make_unique<CountingPlane>(GlooWorld(store, 0, 1), tensor_log, /*forward=*/false),
      std::make_unique<CountingPlane>(GlooWorld(store, 0, 1), control_log, /*forward=*/true));
  std::unique_ptr<Communicator> group = comm.Split({0}, "dp");
  EXPECT_EQ(tensor_log->splits, 1);
  EXPECT_EQ(control_log->splits, 1);
  ASSERT_NE(dynamic_cast<SplitPlaneCommunicator*>(group.get()), nullptr);
  at::Tensor cpu = at::ones({2}, at::kDouble);
  group->AllReduce(cpu);
  EXPECT_EQ(control_log->tensor_ops, 1);
  EXPECT_EQ(tensor_log->tensor_ops, 0);
}

// Two ranks (threads) of a dp=2 job whose world pairs two Gloo worlds: the sums of CPU
// doubles (losses, metrics, balancer loads), the pipeline's string gather and the stage
// ranges all go through the control plane and arrive right; the tensor plane carries none.
TEST(SplitPlaneTest, ProcessGroupControlValuesGoThroughTheControlPlane) {
  constexpr int kSize = 2;
  auto tensor_store = c10::make_intrusive<c10d::HashStore>();
  auto control_store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<PlaneLog>> tensor_logs, control_logs;
  for (int r = 0; r < kSize; ++r) {
    tensor_logs.push_back(std::make_shared<PlaneLog>());
    control_logs.push_back(std::make_shared<PlaneLog>());
  }
  std::vector<std::vector<double>> sums(kSize);
  std::vector<std::vector<std::string>> gathered(kSize);
  std::vector<std::string> errors(kSize);
  auto rank_body = [&](int r) {
    try {
      // The planes are built one after the other, as CreateWorldCommunicator does.
      auto tensor = std::make_unique<CountingPlane>(GlooWorld(tensor_store, r, kSize),
                                                    tensor_logs[r], /*forward=*/true);
      auto control = std::make_unique<CountingPlane>(GlooWorld(control_store, r, kSize),
                                                     control_logs[r], /*forward=*/true);
      auto world = std::make_unique<SplitPlaneCommunicator>(std::move(tensor), std::move(control));
      ParallelConfig config;
      config.world_size = kSize;
      auto context = ProcessGroupContext::Create(std::move(world), config);
      if (!context.ok()) {
        errors[r] = std::string(context.status().message());
        return;
      }
      std::vector<double> values = {r + 1.0, 0.5};
      (*context)->SumOverDataParallel(values);
      sums[r] = values;
      gathered[r] = (*context)->GatherOverPipeline("stage" + std::to_string(r));
      (*context)->Barrier();
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < kSize; ++r) threads.emplace_back(rank_body, r);
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kSize; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(sums[r], (std::vector<double>{3.0, 1.0}));
    // pp = 1: each rank's pipeline is itself.
    EXPECT_EQ(gathered[r], (std::vector<std::string>{"stage" + std::to_string(r)}));
    EXPECT_EQ(tensor_logs[r]->tensor_ops, 0) << "a CPU value went through the tensor plane";
    EXPECT_GE(control_logs[r]->tensor_ops, 1);
    EXPECT_EQ(control_logs[r]->barriers, 1);
    // Every group was split on both planes, in step.
    EXPECT_EQ(tensor_logs[r]->splits, control_logs[r]->splits);
    EXPECT_GE(tensor_logs[r]->splits, 6);
  }
}

TEST(ResolveBackendTest, AutoFollowsTheDevice) {
  const c10::Device cpu(c10::kCPU);
  const c10::Device gpu(c10::kCUDA, 0);
  EXPECT_EQ(*ResolveBackend("auto", cpu, /*have_nccl=*/true), Backend::kGloo);
  EXPECT_EQ(*ResolveBackend("auto", cpu, /*have_nccl=*/false), Backend::kGloo);
  EXPECT_EQ(*ResolveBackend("auto", gpu, /*have_nccl=*/true), Backend::kNccl);
  EXPECT_EQ(*ResolveBackend("gloo", cpu, /*have_nccl=*/true), Backend::kGloo);
  EXPECT_EQ(*ResolveBackend("nccl", gpu, /*have_nccl=*/true), Backend::kNccl);
  // gloo on a GPU stages its tensors through host memory (NOTE [host staging]).
  EXPECT_EQ(*ResolveBackend("gloo", gpu, /*have_nccl=*/true), Backend::kGloo);
  EXPECT_EQ(*ResolveBackend("gloo", gpu, /*have_nccl=*/false), Backend::kGloo);
}

TEST(ResolveBackendTest, MismatchesAreRefusedWithClearMessages) {
  const c10::Device cpu(c10::kCPU);
  const c10::Device gpu(c10::kCUDA, 1);
  struct Case {
    std::string name;
    c10::Device device;
    bool have_nccl;
    absl::StatusCode code;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"nccl", cpu, true, absl::StatusCode::kFailedPrecondition,
            "--distributed_backend=nccl needs a CUDA device, but the device is cpu (--device): "
            "NCCL moves CUDA memory only"},
           {"nccl", gpu, false, absl::StatusCode::kUnimplemented,
            "the nccl backend is not in this build"},
           {"nccl", cpu, false, absl::StatusCode::kFailedPrecondition, "NCCL moves CUDA memory only"},
           {"auto", gpu, false, absl::StatusCode::kUnimplemented,
            "--distributed_backend=auto picks nccl because the device is cuda:1"},
           {"mpi", cpu, true, absl::StatusCode::kInvalidArgument,
            "unknown --distributed_backend 'mpi'; expected auto, gloo or nccl"}}) {
    SCOPED_TRACE(c.name + " on " + c.device.str());
    auto backend = ResolveBackend(c.name, c.device, c.have_nccl);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), c.code) << backend.status();
    EXPECT_THAT(std::string(backend.status().message()), HasSubstr(c.message));
  }
}

// The real pairing on one GPU: CUDA tensors through NCCL, CPU doubles through Gloo. Two
// NCCL ranks cannot share one GPU (NCCL refuses a communicator with a duplicate device), so
// more ranks are SlowNcclCollectivesTest.TwoGpus in communicator_test.cc.
TEST(NcclGpuTest, OneRankWorldPairsNcclWithGlooControlPlane) {
  if (!HaveNccl()) GTEST_SKIP() << "built without NCCL (no CUDA toolkit with NCCL found)";
  if (NcclVisibleDevices() == 0) GTEST_SKIP() << "no CUDA device visible: NCCL needs a GPU";
  if (!at::hasCUDA()) GTEST_SKIP() << "this LibTorch has no CUDA: cannot make CUDA tensors";
  auto comm = CreateWorldCommunicator(WorldInfo{}, Backend::kNccl, std::chrono::seconds(30));
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_STREQ((*comm)->backend(), "nccl+gloo");
  at::Tensor gpu = at::arange(6, at::kFloat).to(at::Device(at::kCUDA, 0));
  (*comm)->AllReduce(gpu);
  EXPECT_TRUE(at::equal(gpu.cpu(), at::arange(6, at::kFloat)));
  at::Tensor loads = at::tensor({1.5, 2.5}, at::kDouble);  // NCCL could not take these.
  (*comm)->AllReduce(loads);
  EXPECT_TRUE(at::equal(loads, at::tensor({1.5, 2.5}, at::kDouble)));
  std::unique_ptr<Communicator> dp = (*comm)->Split({0}, "dp");
  at::Tensor grads = at::ones({4}, at::kFloat).to(at::Device(at::kCUDA, 0));
  dp->AllReduce(grads);
  EXPECT_TRUE(at::equal(dp->AllToAll(grads, {4}, {4}).cpu(), at::ones({4}, at::kFloat)));
  (*comm)->Barrier();
}

}  // namespace
}  // namespace fulcrum::parallel
