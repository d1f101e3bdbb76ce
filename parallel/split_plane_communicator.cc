#include "parallel/split_plane_communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fulcrum::parallel {

SplitPlaneCommunicator::SplitPlaneCommunicator(std::unique_ptr<Communicator> tensor,
                                               std::unique_ptr<Communicator> control)
    : tensor_(std::move(tensor)), control_(std::move(control)) {
  TORCH_INTERNAL_ASSERT(tensor_ != nullptr && control_ != nullptr, "a plane is missing");
  // The planes are split in step (Split below), so a mismatch is a bug, not bad input.
  TORCH_INTERNAL_ASSERT(tensor_->rank() == control_->rank() &&
                            tensor_->global_ranks() == control_->global_ranks(),
                        "tensor plane '", tensor_->name(), "' (world ranks ",
                        absl::StrJoin(tensor_->global_ranks(), ","), ") and control plane '",
                        control_->name(), "' (world ranks ",
                        absl::StrJoin(control_->global_ranks(), ","), ") differ");
  backend_ = absl::StrCat(tensor_->backend(), "+", control_->backend());
}

Communicator& SplitPlaneCommunicator::PlaneOf(const at::Tensor& tensor) {
  return tensor.device().is_cpu() ? *control_ : *tensor_;
}

void SplitPlaneCommunicator::AllReduce(at::Tensor& tensor, ReduceOp op) {
  PlaneOf(tensor).AllReduce(tensor, op);
}

at::Tensor SplitPlaneCommunicator::AllGather(const at::Tensor& input) {
  return PlaneOf(input).AllGather(input);
}

at::Tensor SplitPlaneCommunicator::ReduceScatter(const at::Tensor& input, ReduceOp op) {
  return PlaneOf(input).ReduceScatter(input, op);
}

PendingTensor SplitPlaneCommunicator::IReduceScatter(const at::Tensor& input, ReduceOp op) {
  return PlaneOf(input).IReduceScatter(input, op);
}

void SplitPlaneCommunicator::Broadcast(at::Tensor& tensor, int root) {
  PlaneOf(tensor).Broadcast(tensor, root);
}

at::Tensor SplitPlaneCommunicator::AllToAll(const at::Tensor& input,
                                            const std::vector<int64_t>& input_splits,
                                            const std::vector<int64_t>& output_splits) {
  return PlaneOf(input).AllToAll(input, input_splits, output_splits);
}

std::unique_ptr<CommWork> SplitPlaneCommunicator::IAllReduce(at::Tensor& tensor, ReduceOp op) {
  return PlaneOf(tensor).IAllReduce(tensor, op);
}

PendingTensor SplitPlaneCommunicator::IAllToAll(const at::Tensor& input,
                                                const std::vector<int64_t>& input_splits,
                                                const std::vector<int64_t>& output_splits) {
  return PlaneOf(input).IAllToAll(input, input_splits, output_splits);
}

std::unique_ptr<CommWork> SplitPlaneCommunicator::ISend(const at::Tensor& tensor, int dst, int tag) {
  return PlaneOf(tensor).ISend(tensor, dst, tag);
}

std::unique_ptr<CommWork> SplitPlaneCommunicator::IRecv(at::Tensor& tensor, int src, int tag) {
  return PlaneOf(tensor).IRecv(tensor, src, tag);
}

std::unique_ptr<Communicator> SplitPlaneCommunicator::Split(const std::vector<int>& ranks,
                                                            const std::string& name) {
  std::unique_ptr<Communicator> tensor = tensor_->Split(ranks, name);
  std::unique_ptr<Communicator> control = control_->Split(ranks, name);
  return std::make_unique<SplitPlaneCommunicator>(std::move(tensor), std::move(control));
}

}  // namespace fulcrum::parallel
