// HostStagedCommunicator: a Communicator over a CPU-only one (Gloo) that also carries
// tensors on another device (CUDA) by staging them through host memory. What
// CreateWorldCommunicator returns for the gloo backend, so `--distributed_backend=gloo
// --device=cuda` runs.
//
// NOTE [host staging]
// NCCL refuses two ranks of one communicator on one GPU, so on a machine with one GPU the
// multi-rank code (pipeline sends, layer moves, tensor- and expert-parallel collectives,
// the data-parallel reduction) can run on the GPU only over another transport. This one
// copies each non-CPU tensor to the host, runs the operation on the wrapped Gloo
// communicator, and copies the result back to the tensor's device:
//  - AllReduce, Broadcast: in place — host copy, operation, copy back into the tensor;
//  - AllGather, ReduceScatter, AllToAll: the result is made on the host and moved to the
//    input's device;
//  - ISend: the host copy is made before ISend returns (the copy waits for the stream that
//    produced the tensor), so the caller may reuse the tensor at once, as with any ISend;
//  - IRecv, IAllToAll, IAllReduce: into a host buffer; Wait() copies it into the device tensor.
// CPU tensors go straight through. Correct, not fast: every message crosses PCIe twice
// and the device-to-host copies synchronise the stream. It is for running the multi-rank
// paths on one GPU (tests, tools/gpu_check.sh), never for training at speed; use nccl with
// one GPU per rank for that.
//
// Thread-safety: that of the wrapped communicator.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator_wrapper.h"

namespace fulcrum::parallel {

class HostStagedCommunicator final : public CommunicatorWrapper {
 public:
  /// Wraps `inner` (a CPU-only communicator; not null). `stage_cpu_tensors` is for tests on
  /// machines without a GPU: CPU tensors take the staging path too (copied to a separate
  /// host tensor and back), so the copies and the deferred completions are exercised.
  explicit HostStagedCommunicator(std::unique_ptr<Communicator> inner,
                                  bool stage_cpu_tensors = false);

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
  /// The split of the wrapped communicator, staged the same way.
  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override;

 private:
  /// Whether `tensor` takes the staging path.
  bool Staged(const at::Tensor& tensor) const;
  /// A host copy of `tensor` (its own storage even when `tensor` is on the host).
  static at::Tensor ToHost(const at::Tensor& tensor);

  bool stage_cpu_tensors_;
};

}  // namespace fulcrum::parallel
