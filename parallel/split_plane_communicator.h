// SplitPlaneCommunicator: one Communicator made of two of the same members — a tensor
// plane (NCCL: CUDA tensors) and a control plane (Gloo: CPU tensors) — that sends each
// tensor on the plane of its device. What CreateWorldCommunicator returns for the nccl
// backend, so that every group split from the world (ProcessGroupContext: tp, pp, dp, ep,
// edp, mp, the tied-embedding pair) has both planes without its callers knowing.
//
// NOTE [control plane]
// NCCL moves CUDA memory only; Fulcrum also sends small CPU values between ranks: the
// balancer's stage loads and plan hashes (pipeline/pipeline_runner.cc), stop and re-pack
// flags, the loss and metric sums (ProcessGroupContext::SumOver*), the stage ranges and
// the pipeline's string gathers, timeline rows, checkpoint agreement. The rule:
//  - a CPU tensor rides the control plane (Gloo), any other (CUDA) tensor the tensor plane;
//  - Barrier and every control decision ride the control plane;
//  - Split splits both planes, tensor plane first, so a group has the same members on each.
// So model code never chooses a backend: activations, gradients, expert tokens and
// migrated layers are on the GPU and go through NCCL; anything built with at::kCPU (every
// control value today) goes through Gloo, which can carry CPU doubles. Both peers of a
// point-to-point message must put the buffer on the same device — they do when every rank
// follows one DeviceSpec (core/device.h). With the gloo backend both roles are the one
// Gloo communicator and nothing here is used.
//
// Thread-safety: as Communicator (one thread at a time).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace fulcrum::parallel {

class SplitPlaneCommunicator final : public Communicator {
 public:
  /// Both planes must be over the same members with the same ranks (asserted): `tensor`
  /// carries non-CPU tensors, `control` CPU tensors and barriers. Neither may be null.
  SplitPlaneCommunicator(std::unique_ptr<Communicator> tensor, std::unique_ptr<Communicator> control);

  int rank() const override { return tensor_->rank(); }
  int size() const override { return tensor_->size(); }
  const std::vector<int>& global_ranks() const override { return tensor_->global_ranks(); }
  const std::string& name() const override { return tensor_->name(); }
  /// "nccl+gloo" for the usual pair: the tensor plane's backend, then the control plane's.
  const char* backend() const override { return backend_.c_str(); }
  std::chrono::milliseconds timeout() const override { return tensor_->timeout(); }

  void AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) override;
  at::Tensor AllGather(const at::Tensor& input) override;
  at::Tensor ReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum) override;
  PendingTensor IReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum) override;
  void Broadcast(at::Tensor& tensor, int root) override;
  at::Tensor AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits) override;
  std::unique_ptr<CommWork> IAllReduce(at::Tensor& tensor, ReduceOp op) override;
  PendingTensor IAllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                          const std::vector<int64_t>& output_splits) override;
  std::unique_ptr<CommWork> ISend(const at::Tensor& tensor, int dst, int tag) override;
  std::unique_ptr<CommWork> IRecv(at::Tensor& tensor, int src, int tag) override;
  void Barrier() override { control_->Barrier(); }
  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override;

  /// The planes themselves (tests, and callers that must name one explicitly).
  Communicator& tensor_plane() { return *tensor_; }
  Communicator& control_plane() { return *control_; }

  /// The plane `tensor` travels on: the control plane for a CPU tensor.
  Communicator& PlaneOf(const at::Tensor& tensor);

 private:
  std::unique_ptr<Communicator> tensor_;
  std::unique_ptr<Communicator> control_;
  std::string backend_;
};

}  // namespace fulcrum::parallel
