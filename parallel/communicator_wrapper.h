// CommunicatorWrapper: a Communicator that forwards every call to another one. Derive from
// it to decorate a communicator — delay calls, fail the k-th one, count bytes, log — by
// overriding only the methods of interest:
//
//   class FailingComm : public CommunicatorWrapper {
//    public:
//     using CommunicatorWrapper::CommunicatorWrapper;
//     void AllReduce(at::Tensor& t, ReduceOp op) override {
//       if (++calls_ == 3) throw CommError("all_reduce on 'dp': injected failure");
//       CommunicatorWrapper::AllReduce(t, op);
//     }
//    private:
//     int calls_ = 0;
//   };
//
// Thread-safety: that of the wrapped communicator.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communicator.h"

namespace fulcrum::parallel {

class CommunicatorWrapper : public Communicator {
 public:
  /// Takes ownership of `inner`, which must not be null.
  explicit CommunicatorWrapper(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::vector<int>& global_ranks() const override { return inner_->global_ranks(); }
  const std::string& name() const override { return inner_->name(); }
  const char* backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }

  void AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) override {
    inner_->AllReduce(tensor, op);
  }
  std::unique_ptr<CommWork> IAllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) override {
    return inner_->IAllReduce(tensor, op);
  }
  at::Tensor AllGather(const at::Tensor& input) override { return inner_->AllGather(input); }
  at::Tensor ReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum) override {
    return inner_->ReduceScatter(input, op);
  }
  PendingTensor IReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum) override {
    return inner_->IReduceScatter(input, op);
  }
  void Broadcast(at::Tensor& tensor, int root) override { inner_->Broadcast(tensor, root); }
  at::Tensor AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                      const std::vector<int64_t>& output_splits) override {
    return inner_->AllToAll(input, input_splits, output_splits);
  }
  PendingTensor IAllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                          const std::vector<int64_t>& output_splits) override {
    return inner_->IAllToAll(input, input_splits, output_splits);
  }
  std::unique_ptr<CommWork> ISend(const at::Tensor& tensor, int dst, int tag) override {
    return inner_->ISend(tensor, dst, tag);
  }
  std::unique_ptr<CommWork> IRecv(at::Tensor& tensor, int src, int tag) override {
    return inner_->IRecv(tensor, src, tag);
  }
  void Barrier() override { inner_->Barrier(); }
  /// Returns the wrapped communicator's split, undecorated; override to decorate it too.
  std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                      const std::string& name) override {
    return inner_->Split(ranks, name);
  }

 protected:
  Communicator& inner() { return *inner_; }
  const Communicator& inner() const { return *inner_; }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace fulcrum::parallel
