#include "parallel/host_staged_communicator.h"

#include <utility>

#include <ATen/ATen.h>

namespace fulcrum::parallel {
namespace {

// Completes a staged operation (NOTE [host staging]): waits for the wrapped one, then — for
// a receive, whose `target` is defined — copies the host buffer into the tensor on its
// device; a send's host copy is only kept alive until then. Wait is idempotent, as
// CommWork's.
class StagedWork final : public CommWork {
 public:
  StagedWork(std::unique_ptr<CommWork> inner, at::Tensor host, at::Tensor target = {})
      : inner_(std::move(inner)), host_(std::move(host)), target_(std::move(target)) {}

  void Wait() override {
    if (inner_ == nullptr) return;
    inner_->Wait();
    if (target_.defined()) target_.copy_(host_);
    inner_.reset();
    host_.reset();
  }

 private:
  std::unique_ptr<CommWork> inner_;
  at::Tensor host_;
  at::Tensor target_;  // shares the caller's storage; undefined for a send
};

}  // namespace

HostStagedCommunicator::HostStagedCommunicator(std::unique_ptr<Communicator> inner,
                                               bool stage_cpu_tensors)
    : CommunicatorWrapper(std::move(inner)), stage_cpu_tensors_(stage_cpu_tensors) {}

bool HostStagedCommunicator::Staged(const at::Tensor& tensor) const {
  return tensor.defined() && (stage_cpu_tensors_ || !tensor.device().is_cpu());
}

at::Tensor HostStagedCommunicator::ToHost(const at::Tensor& tensor) {
  // A new host tensor in every case: for a device tensor the copy waits for the stream
  // that produces it; for a host one (tests) it separates the buffers as a device would.
  return tensor.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

void HostStagedCommunicator::AllReduce(at::Tensor& tensor, ReduceOp op) {
  if (!Staged(tensor)) return inner().AllReduce(tensor, op);
  at::Tensor host = ToHost(tensor);
  inner().AllReduce(host, op);
  tensor.copy_(host);
}

at::Tensor HostStagedCommunicator::AllGather(const at::Tensor& input) {
  if (!Staged(input)) return inner().AllGather(input);
  return inner().AllGather(ToHost(input)).to(input.device());
}

at::Tensor HostStagedCommunicator::ReduceScatter(const at::Tensor& input, ReduceOp op) {
  if (!Staged(input)) return inner().ReduceScatter(input, op);
  return inner().ReduceScatter(ToHost(input), op).to(input.device());
}

void HostStagedCommunicator::Broadcast(at::Tensor& tensor, int root) {
  if (!Staged(tensor)) return inner().Broadcast(tensor, root);
  at::Tensor host = ToHost(tensor);
  inner().Broadcast(host, root);
  tensor.copy_(host);
}

at::Tensor HostStagedCommunicator::AllToAll(const at::Tensor& input,
                                            const std::vector<int64_t>& input_splits,
                                            const std::vector<int64_t>& output_splits) {
  if (!Staged(input)) return inner().AllToAll(input, input_splits, output_splits);
  return inner().AllToAll(ToHost(input), input_splits, output_splits).to(input.device());
}

std::unique_ptr<CommWork> HostStagedCommunicator::IAllReduce(at::Tensor& tensor, ReduceOp op) {
  if (!Staged(tensor)) return inner().IAllReduce(tensor, op);
  at::Tensor host = ToHost(tensor);
  std::unique_ptr<CommWork> work = inner().IAllReduce(host, op);
  return std::make_unique<StagedWork>(std::move(work), std::move(host), tensor);
}

PendingTensor HostStagedCommunicator::IReduceScatter(const at::Tensor& input, ReduceOp op) {
  if (!Staged(input)) return inner().IReduceScatter(input, op);
  PendingTensor host = inner().IReduceScatter(ToHost(input), op);
  at::Tensor out = at::empty_like(host.tensor, host.tensor.options().device(input.device()));
  return PendingTensor{out, std::make_unique<StagedWork>(std::move(host.work), host.tensor, out)};
}

PendingTensor HostStagedCommunicator::IAllToAll(const at::Tensor& input,
                                                const std::vector<int64_t>& input_splits,
                                                const std::vector<int64_t>& output_splits) {
  if (!Staged(input)) return inner().IAllToAll(input, input_splits, output_splits);
  PendingTensor host = inner().IAllToAll(ToHost(input), input_splits, output_splits);
  at::Tensor out = at::empty_like(host.tensor, host.tensor.options().device(input.device()));
  return PendingTensor{out, std::make_unique<StagedWork>(std::move(host.work), host.tensor, out)};
}

std::unique_ptr<CommWork> HostStagedCommunicator::ISend(const at::Tensor& tensor, int dst,
                                                        int tag) {
  if (!Staged(tensor)) return inner().ISend(tensor, dst, tag);
  at::Tensor host = ToHost(tensor);
  std::unique_ptr<CommWork> work = inner().ISend(host, dst, tag);
  return std::make_unique<StagedWork>(std::move(work), std::move(host));
}

std::unique_ptr<CommWork> HostStagedCommunicator::IRecv(at::Tensor& tensor, int src, int tag) {
  if (!Staged(tensor)) return inner().IRecv(tensor, src, tag);
  at::Tensor host = at::empty(tensor.sizes(), tensor.options().device(at::kCPU));
  std::unique_ptr<CommWork> work = inner().IRecv(host, src, tag);
  return std::make_unique<StagedWork>(std::move(work), std::move(host), tensor);
}

std::unique_ptr<Communicator> HostStagedCommunicator::Split(const std::vector<int>& ranks,
                                                            const std::string& name) {
  return std::make_unique<HostStagedCommunicator>(inner().Split(ranks, name), stage_cpu_tensors_);
}

}  // namespace fulcrum::parallel
