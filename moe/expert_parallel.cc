#include "moe/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace fulcrum::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [E, C, D] by destination rank → [E/n, n·C, D] by local expert (NOTE [flexible expert
// layout]).
at::Tensor ScatterRows(ExpertExchange& exchange, const at::Tensor& buffer) {
  const int64_t n = exchange.size();
  const int64_t experts = buffer.size(0);
  const int64_t c = buffer.size(1);
  const int64_t d = buffer.size(2);
  at::Tensor received = exchange.AllToAll(buffer.contiguous());  // [n·E/n, C, D] by source
  return received.view({n, experts / n, c, d}).transpose(0, 1).reshape({experts / n, n * c, d});
}

// The inverse permutation and exchange.
at::Tensor GatherRows(ExpertExchange& exchange, const at::Tensor& expert_output) {
  const int64_t n = exchange.size();
  const int64_t local = expert_output.size(0);
  const int64_t c = expert_output.size(1) / n;
  const int64_t d = expert_output.size(2);
  at::Tensor by_rank =
      expert_output.reshape({local, n, c, d}).transpose(0, 1).reshape({n * local, c, d});
  return exchange.AllToAll(by_rank);
}

void SaveExchange(AutogradContext* ctx, ExpertExchange* exchange) {
  ctx->saved_data["exchange"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(exchange));
}
ExpertExchange& SavedExchange(AutogradContext* ctx) {
  return *reinterpret_cast<ExpertExchange*>(
      static_cast<intptr_t>(ctx->saved_data["exchange"].toInt()));
}

// An exchange whose backward is its inverse: Scatter (forward ScatterRows, backward
// GatherRows) and Gather (the other way round).
template <at::Tensor (*Forward)(ExpertExchange&, const at::Tensor&),
          at::Tensor (*Backward)(ExpertExchange&, const at::Tensor&)>
class InvertibleExchange : public torch::autograd::Function<InvertibleExchange<Forward, Backward>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, ExpertExchange* exchange) {
    SaveExchange(ctx, exchange);
    return Forward(*exchange, input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Backward(SavedExchange(ctx), grads[0].contiguous()), at::Tensor()};
  }
};
using ScatterFunction = InvertibleExchange<ScatterRows, GatherRows>;
using GatherFunction = InvertibleExchange<GatherRows, ScatterRows>;

// All-to-all with row splits; its backward is the exchange with the splits swapped.
class VariableAllToAllFunction : public torch::autograd::Function<VariableAllToAllFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            parallel::Communicator* comm, std::vector<int64_t> send,
                            std::vector<int64_t> recv) {
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return comm->AllToAll(input.contiguous(), send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* comm = reinterpret_cast<parallel::Communicator*>(
        static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<int64_t> recv = ctx->saved_data["recv"].toIntVector();
    return {comm->AllToAll(grads[0].contiguous(), recv, send), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The handle of a non-blocking exchange, shared by the function that issues it and the one
// that waits for it.
struct PendingExchange {
  std::unique_ptr<parallel::CommWork> work;
};

// Issues an equal-split all-to-all and returns its (not yet written) output; WaitFunction
// makes it valid. Backward: the blocking exchange of the gradient (its own inverse).
class IssueAllToAllFunction : public torch::autograd::Function<IssueAllToAllFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            parallel::Communicator* comm, std::shared_ptr<PendingExchange> pending) {
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    parallel::PendingTensor issued = comm->IAllToAll(input.contiguous(), {}, {});
    pending->work = std::move(issued.work);
    return issued.tensor;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* comm = reinterpret_cast<parallel::Communicator*>(
        static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    return {comm->AllToAll(grads[0].contiguous(), {}, {}), at::Tensor(), at::Tensor()};
  }
};

class WaitFunction : public torch::autograd::Function<WaitFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            std::shared_ptr<PendingExchange> pending) {
    pending->work->Wait();
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

ExpertExchange::ExpertExchange(parallel::Communicator* ep, int intra_size) : ep_(ep) {
  const int n = ep->size();
  TORCH_CHECK(intra_size >= 0, "hierarchical all-to-all group size must be >= 0, got ",
              intra_size);
  if (intra_size <= 1 || intra_size >= n) return;  // one level is all there is
  TORCH_CHECK(n % intra_size == 0, "hierarchical all-to-all: the node size ", intra_size,
              " does not divide the expert-parallel size ", n);
  const int node = ep->rank() / intra_size;
  const int local = ep->rank() % intra_size;
  // Every member must split in the same order: first all intra-node groups, then all
  // inter-node ones (each call is collective only over its own members).
  std::vector<int> same_node;
  for (int l = 0; l < intra_size; ++l) same_node.push_back(node * intra_size + l);
  intra_ = ep->Split(same_node, ep->name() + "_intra");
  std::vector<int> same_local;
  for (int b = 0; b < n / intra_size; ++b) same_local.push_back(b * intra_size + local);
  inter_ = ep->Split(same_local, ep->name() + "_inter");
}

ExpertExchange::~ExpertExchange() = default;

at::Tensor ExpertExchange::AllToAll(const at::Tensor& input) {
  const int64_t n = size();
  if (n == 1) return input;
  TORCH_CHECK(input.size(0) % n == 0, "all-to-all over ", n, " ranks needs a multiple of ", n,
              " rows, got ", input.size(0));
  at::Tensor x = input.contiguous();
  if (!hierarchical()) return ep_->AllToAll(x, {}, {});
  // NOTE [hierarchical all-to-all]. Chunks are indexed by destination rank b·L + l.
  const int64_t local_size = intra_->size();
  const int64_t nodes = n / local_size;
  const int64_t chunk = x.numel() / n;
  // Step 1, inside the node: regroup [b][l] → [l][b] and send group l to local rank l;
  // what arrives is [i][b]: from local rank i, bound for (node b, this local rank).
  at::Tensor by_local = x.view({nodes, local_size, chunk}).transpose(0, 1).contiguous();
  at::Tensor step1 = intra_->AllToAll(by_local.view({local_size * nodes, chunk}), {}, {});
  // Step 2, between nodes: regroup [i][b] → [b][i] and send group b to node b; what
  // arrives is [a][i], from rank a·L + i: the flat all-to-all's order.
  at::Tensor by_node = step1.view({local_size, nodes, chunk}).transpose(0, 1).contiguous();
  at::Tensor step2 = inter_->AllToAll(by_node.view({nodes * local_size, chunk}), {}, {});
  return step2.view(input.sizes());
}

at::Tensor ExpertExchange::Scatter(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.dim() == 3 && buffer.size(0) % size() == 0,
              "expert buffer must be [experts, capacity, hidden] with experts a multiple of ",
              size(), ", got ", buffer.sizes());
  if (size() == 1) return buffer;
  return ScatterFunction::apply(buffer, this);
}

std::function<at::Tensor()> ExpertExchange::StartScatter(const at::Tensor& buffer) {
  if (size() == 1 || hierarchical()) {
    at::Tensor local = Scatter(buffer);
    return [local] { return local; };
  }
  TORCH_CHECK(buffer.dim() == 3 && buffer.size(0) % size() == 0,
              "expert buffer must be [experts, capacity, hidden] with experts a multiple of ",
              size(), ", got ", buffer.sizes());
  auto pending = std::make_shared<PendingExchange>();
  at::Tensor arriving = IssueAllToAllFunction::apply(buffer, ep_, pending);
  const int64_t n = size(), e = buffer.size(0), c = buffer.size(1), d = buffer.size(2);
  return [arriving, pending, n, e, c, d] {
    return WaitFunction::apply(arriving, pending)
        .view({n, e / n, c, d})
        .transpose(0, 1)
        .reshape({e / n, n * c, d});
  };
}

at::Tensor ExpertExchange::Gather(const at::Tensor& expert_output) {
  TORCH_CHECK(expert_output.dim() == 3 && expert_output.size(1) % size() == 0,
              "local expert output must be [local experts, ranks·capacity, hidden], got ",
              expert_output.sizes());
  if (size() == 1) return expert_output;
  return GatherFunction::apply(expert_output, this);
}

ExpertExchange::RaggedLayout ExpertExchange::PlanRagged(const at::Tensor& rows_per_expert) {
  const int64_t n = size();
  const int64_t experts = rows_per_expert.numel();
  TORCH_CHECK(experts % n == 0, "per-expert rows for ", experts, " experts over ", n, " ranks");
  const int64_t local = experts / n;
  at::Tensor counts = rows_per_expert.to(at::kLong).contiguous();
  // [n, E/n]: what each rank will send here, per local expert (counts first).
  at::Tensor received = (n == 1 ? counts : ep_->AllToAll(counts, {}, {})).view({n, local});
  at::Tensor sent = counts.view({n, local});
  RaggedLayout layout;
  const int64_t* r = received.data_ptr<int64_t>();
  const int64_t* s = sent.data_ptr<int64_t>();
  layout.expert_rows.assign(local, 0);
  for (int64_t j = 0; j < n; ++j) {
    int64_t send = 0, recv = 0;
    for (int64_t e = 0; e < local; ++e) {
      send += s[j * local + e];
      recv += r[j * local + e];
      layout.expert_rows[e] += r[j * local + e];
    }
    layout.send_splits.push_back(send);
    layout.recv_splits.push_back(recv);
  }
  // Received rows are [j][e][rows]; regroup to [e][j][rows].
  std::vector<int64_t> start(n * local);
  int64_t offset = 0;
  for (int64_t i = 0; i < n * local; ++i) {
    start[i] = offset;
    offset += r[i];
  }
  std::vector<int64_t> order;
  order.reserve(offset);
  for (int64_t e = 0; e < local; ++e) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t row = 0; row < r[j * local + e]; ++row) order.push_back(start[j * local + e] + row);
    }
  }
  layout.order = at::tensor(order, at::kLong);
  return layout;
}

at::Tensor ExpertExchange::ScatterRagged(const at::Tensor& buffer, const RaggedLayout& layout) {
  at::Tensor received = size() == 1 ? buffer
                                    : VariableAllToAllFunction::apply(buffer, ep_, layout.send_splits,
                                                                      layout.recv_splits);
  return received.index_select(0, layout.order);
}

at::Tensor ExpertExchange::GatherRagged(const at::Tensor& expert_output,
                                        const RaggedLayout& layout) {
  // Undo the regrouping (order is a permutation), then send the rows home.
  at::Tensor by_rank = at::zeros_like(expert_output).index_copy(0, layout.order, expert_output);
  if (size() == 1) return by_rank;
  return VariableAllToAllFunction::apply(by_rank, ep_, layout.recv_splits, layout.send_splits);
}

at::Tensor ExpertExchange::OverlappedExperts(
    const at::Tensor& buffer, int degree,
    const std::function<at::Tensor(const at::Tensor&)>& experts) {
  const int64_t n = size();
  const int64_t e = buffer.size(0);
  const int64_t c = buffer.size(1);
  const int64_t d = buffer.size(2);
  TORCH_CHECK(degree >= 1 && e % n == 0, "overlapped exchange: degree ", degree, ", ", e,
              " experts over ", n, " ranks");
  if (n == 1 || degree == 1 || c < 2) return Gather(experts(Scatter(buffer)));
  const int64_t chunks = std::min<int64_t>(degree, c);
  std::vector<int64_t> widths;
  for (int64_t i = 0; i < chunks; ++i) widths.push_back(c / chunks + (i < c % chunks ? 1 : 0));
  // Issue every chunk's exchange first.
  std::vector<at::Tensor> arriving;
  std::vector<std::shared_ptr<PendingExchange>> pending;
  int64_t start = 0;
  for (int64_t w : widths) {
    pending.push_back(std::make_shared<PendingExchange>());
    arriving.push_back(
        IssueAllToAllFunction::apply(buffer.narrow(1, start, w), ep_, pending.back()));
    start += w;
  }
  std::vector<at::Tensor> leaving;
  std::vector<std::shared_ptr<PendingExchange>> leaving_pending;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t w = widths[i];
    at::Tensor rows = WaitFunction::apply(arriving[i], pending[i])
                          .view({n, e / n, w, d})
                          .transpose(0, 1)
                          .reshape({e / n, n * w, d});
    at::Tensor out = experts(rows).reshape({e / n, n, w, d}).transpose(0, 1).reshape({e, w, d});
    leaving_pending.push_back(std::make_shared<PendingExchange>());
    leaving.push_back(IssueAllToAllFunction::apply(out, ep_, leaving_pending.back()));
  }
  for (int64_t i = 0; i < chunks; ++i) leaving[i] = WaitFunction::apply(leaving[i], leaving_pending[i]);
  return at::cat(leaving, 1);
}

int64_t ExpertExchange::Max(int64_t value) {
  if (size() == 1) return value;
  at::Tensor t = at::tensor({value}, at::kLong);
  ep_->AllReduce(t, parallel::ReduceOp::kMax);
  return t.item<int64_t>();
}

}  // namespace fulcrum::moe
