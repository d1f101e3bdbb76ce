#include "parallel/comm_tensor_parallel_group.h"

#include <torch/csrc/autograd/custom_function.h>

namespace fulcrum::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every rank's `t` concatenated along `dim` (the communicator concatenates along dim 0).
at::Tensor GatherAlong(Communicator* comm, const at::Tensor& t, int64_t dim) {
  dim = dim < 0 ? dim + t.dim() : dim;
  if (dim == 0) return comm->AllGather(t.contiguous());
  at::Tensor gathered = comm->AllGather(t.movedim(dim, 0).contiguous());
  return gathered.movedim(0, dim).contiguous();
}

at::Tensor SliceOfRank(Communicator* comm, const at::Tensor& t, int64_t dim) {
  const int64_t chunk = t.size(dim) / comm->size();
  // A copy (NOTE in ShardOf): a view would keep the whole tensor alive.
  return t.narrow(dim, comm->rank() * chunk, chunk).clone(at::MemoryFormat::Contiguous);
}

// Autograd contexts hold IValues, which cannot hold a raw pointer; the communicator outlives
// every graph that uses it, so its address travels as an integer.
void SaveCommunicator(AutogradContext* ctx, Communicator* comm) {
  ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
}
Communicator* SavedCommunicator(AutogradContext* ctx) {
  return reinterpret_cast<Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
}

// f: identity forward, all-reduce backward.
class CopyToRegionFunction : public torch::autograd::Function<CopyToRegionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator* comm = SavedCommunicator(ctx);
    at::Tensor grad = grads[0].contiguous().clone();
    comm->AllReduce(grad, ReduceOp::kSum);
    return {grad, at::Tensor()};
  }
};

// g: all-reduce forward, identity backward.
class ReduceFromRegionFunction : public torch::autograd::Function<ReduceFromRegionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    at::Tensor out = x.contiguous().clone();
    comm->AllReduce(out, ReduceOp::kSum);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// All-gather along the last dimension forward; this rank's slice of the gradient backward.
class GatherFromRegionFunction : public torch::autograd::Function<GatherFromRegionFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return GatherAlong(comm, x, -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator* comm = SavedCommunicator(ctx);
    return {SliceOfRank(comm, grads[0], grads[0].dim() - 1), at::Tensor()};
  }
};

// Dimension 0 is the sequence (NOTE [sequence parallelism]); the communicator gathers and
// reduce-scatters along it.
at::Tensor ReduceScatterRows(Communicator* comm, const at::Tensor& t) {
  return comm->ReduceScatter(t.contiguous(), ReduceOp::kSum);
}

// All-gather of the sequence forward, reduce-scatter of the gradient backward.
class GatherSequenceFunction : public torch::autograd::Function<GatherSequenceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return comm->AllGather(x.contiguous());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatterRows(SavedCommunicator(ctx), grads[0]), at::Tensor()};
  }
};

// Reduce-scatter of the sequence forward, all-gather of the gradient backward.
class ReduceScatterSequenceFunction
    : public torch::autograd::Function<ReduceScatterSequenceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return ReduceScatterRows(comm, x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {SavedCommunicator(ctx)->AllGather(grads[0].contiguous()), at::Tensor()};
  }
};

// All-gather of the sequence forward, this rank's rows of the (whole, equal) gradient
// backward.
class GatherSequenceWholeFunction : public torch::autograd::Function<GatherSequenceWholeFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return comm->AllGather(x.contiguous());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {SliceOfRank(SavedCommunicator(ctx), grads[0], 0), at::Tensor()};
  }
};

// This rank's rows forward, all-gather of the gradient backward.
class ScatterSequenceFunction : public torch::autograd::Function<ScatterSequenceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, Communicator* comm) {
    SaveCommunicator(ctx, comm);
    return SliceOfRank(comm, x, 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {SavedCommunicator(ctx)->AllGather(grads[0].contiguous()), at::Tensor()};
  }
};

}  // namespace

at::Tensor CommTensorParallelGroup::GatherSequence(const at::Tensor& x) {
  return GatherSequenceFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::ReduceScatterSequence(const at::Tensor& x) {
  return ReduceScatterSequenceFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::GatherSequenceWhole(const at::Tensor& x) {
  return GatherSequenceWholeFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::ScatterSequence(const at::Tensor& x) {
  return ScatterSequenceFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::CopyToRegion(const at::Tensor& x) {
  return CopyToRegionFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::ReduceFromRegion(const at::Tensor& x) {
  return ReduceFromRegionFunction::apply(x, comm_);
}

at::Tensor CommTensorParallelGroup::GatherFromRegion(const at::Tensor& x) {
  return GatherFromRegionFunction::apply(x, comm_);
}

void CommTensorParallelGroup::AllReduceSum(at::Tensor& t) { comm_->AllReduce(t, ReduceOp::kSum); }

void CommTensorParallelGroup::AllReduceMax(at::Tensor& t) { comm_->AllReduce(t, ReduceOp::kMax); }

at::Tensor CommTensorParallelGroup::AllGather(const at::Tensor& t, int64_t dim) {
  return GatherAlong(comm_, t.detach(), dim);
}

}  // namespace fulcrum::parallel
