// The one narrow interface through which Fulcrum communicates between processes.
//
// Two real backends implement it: Gloo (c10d::ProcessGroupGloo; CPU tensors — what tests and
// CI use) and NCCL (CUDA builds). Model code never sees a backend: tensor-, pipeline-,
// expert- and data-parallel code takes a Communicator& for its group. Tests may wrap one
// with a decorator that delays or fails calls (see CommunicatorWrapper).
//
// Semantics common to every method:
//  - Collectives are called by every member of the communicator, in the same order.
//  - Tensors must be contiguous and on the backend's device; dtypes float32/64, bfloat16,
//    float16, int32, int64, uint8.
//  - Every blocking call is bounded by timeout(): a dead or stuck peer raises CommError
//    naming the operation, the communicator and (where known) the peer — never a hang.
//  - Ranks are ranks *within this communicator* (0..size()-1); global_ranks() maps them
//    to world ranks.
//
// Thread-safety: a Communicator is used by one thread at a time (the training thread);
// non-blocking handles (CommWork) may be waited on from that thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fulcrum::parallel {

enum class ReduceOp { kSum, kMax, kMin };

/// A communication failure or timeout. The message names the operation, the communicator
/// and the peer where known, e.g. "all_reduce on 'dp' (ranks 0,2): timed out after 30000 ms
/// waiting for rank 2".
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A pending non-blocking operation.
class CommWork {
 public:
  virtual ~CommWork() = default;
  /// Blocks until the operation completes; throws CommError on failure or timeout.
  virtual void Wait() = 0;
};

/// A tensor that a non-blocking collective is still writing: read it only after
/// work->Wait().
struct PendingTensor {
  at::Tensor tensor;
  std::unique_ptr<CommWork> work;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// World rank of each member, indexed by rank in this communicator.
  virtual const std::vector<int>& global_ranks() const = 0;
  /// Human-readable name used in errors and logs: "world", "tp", "dp", "pp", "ep", ...
  virtual const std::string& name() const = 0;
  /// "gloo" or "nccl".
  virtual const char* backend() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  /// In place: every member ends with the reduction of all members' `tensor`.
  virtual void AllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  /// AllReduce that returns at once: `tensor` holds the reduction after work->Wait(), and
  /// must be neither read nor written before. Several may be in flight; every member issues
  /// them (and the other collectives) in the same order. The default runs the blocking
  /// AllReduce (NCCL's is already asynchronous to the host); Gloo's runs on c10d's worker
  /// while the caller computes — the building block of a gradient reduction overlapped
  /// with the backward pass.
  virtual std::unique_ptr<CommWork> IAllReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  /// Every member's `input` (same shape everywhere) concatenated along dimension 0, in rank
  /// order.
  virtual at::Tensor AllGather(const at::Tensor& input) = 0;
  /// `input` has size() equal chunks along dimension 0; returns the reduction over members
  /// of chunk rank().
  virtual at::Tensor ReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum) = 0;
  /// ReduceScatter that returns at once: the result is valid after work->Wait(); `input` may
  /// be changed or freed meanwhile. Several may be in flight; every member issues them (and
  /// the other collectives) in the same order. The default runs the blocking ReduceScatter.
  /// Gloo's all-reduces a copy of `input` on c10d's worker and returns this rank's chunk of
  /// it: (n − 1)/n more bytes than the blocking ring (NOTE [ring reduce-scatter]) but none
  /// of the caller's time — c10d's own Gloo reduce-scatter is that same all-reduce.
  virtual PendingTensor IReduceScatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum);
  /// In place: every member ends with root's `tensor`.
  virtual void Broadcast(at::Tensor& tensor, int root) = 0;
  /// Sends rows [Σ input_splits[:j], +input_splits[j]) of `input` (split along dim 0) to
  /// rank j and returns what every rank sent here, concatenated in rank order with
  /// output_splits[j] rows from rank j. Empty split vectors mean equal splits.
  virtual at::Tensor AllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                              const std::vector<int64_t>& output_splits) = 0;
  /// AllToAll that returns at once: the result is valid after work->Wait(). Several may be
  /// in flight; they complete in issue order. `input` must stay unchanged until then. The
  /// default runs the blocking AllToAll (NCCL's is already asynchronous to the host).
  virtual PendingTensor IAllToAll(const at::Tensor& input, const std::vector<int64_t>& input_splits,
                                  const std::vector<int64_t>& output_splits);
  /// Point to point. `tag` distinguishes concurrent messages between the same pair.
  virtual std::unique_ptr<CommWork> ISend(const at::Tensor& tensor, int dst, int tag) = 0;
  virtual std::unique_ptr<CommWork> IRecv(at::Tensor& tensor, int src, int tag) = 0;
  void Send(const at::Tensor& tensor, int dst, int tag) { ISend(tensor, dst, tag)->Wait(); }
  void Recv(at::Tensor& tensor, int src, int tag) { IRecv(tensor, src, tag)->Wait(); }
  virtual void Barrier() = 0;

  /// A communicator over `ranks` (ranks of this communicator, ascending, this rank among
  /// them), called by exactly those members, in the same order on each. `name` labels it in
  /// errors; (name, ranks) must be unique among the splits of this communicator.
  virtual std::unique_ptr<Communicator> Split(const std::vector<int>& ranks,
                                              const std::string& name) = 0;
};

}  // namespace fulcrum::parallel
