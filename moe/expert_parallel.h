// Expert parallelism: the E experts of an MoE layer are shared out over the n ranks of the
// expert-parallel group (rank r holds experts [r·E/n, (r+1)·E/n)), and each rank's
// capacity-padded dispatch buffer [E, C, D] is exchanged by all-to-all so that every
// expert sees the tokens routed to it from every rank.
//
// NOTE [flexible expert layout]
// After the exchange, the rows a local expert received are made one contiguous matrix
// [n·C, D] (Tutel's flexible layout, Hwang et al. 2023 §3.2): the buffer goes from
// [E, C, D] = [n, E/n, C, D] (by destination rank) through the all-to-all to
// [n, E/n, C, D] (by source rank) and is transposed to [E/n, n·C, D]. Each local expert
// then runs one GEMM whatever n is, and the math of an expert is the same at every ep
// size: its input rows are the same rows, grouped by source rank.
//
// NOTE [hierarchical all-to-all]
// With `intra_size` L > 1 (ranks r = node·L + local), the exchange runs in two steps of
// L-way and n/L-way all-to-alls instead of one n-way: first inside the node, every rank
// sends to local rank l the chunks bound for local rank l on every node; then between
// nodes, each rank forwards to node b what it gathered for node b. Both steps move the
// same bytes as the flat exchange, but the inter-node step sends n/L larger messages
// instead of n small ones (Tutel §3.3, "2DH all-to-all"). The result is identical to the
// flat all-to-all, element for element.
//
// Not thread-safe; one exchange per expert-parallel group, shared by the MoE layers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace fulcrum::moe {

class ExpertExchange {
 public:
  /// `ep` (must outlive this) is the expert-parallel group. `intra_size` > 1 selects the
  /// hierarchical all-to-all with groups of `intra_size` consecutive ranks (it must divide
  /// the group size); 0 or 1 the flat one. Collective over `ep` (it splits sub-groups).
  ExpertExchange(parallel::Communicator* ep, int intra_size = 0);
  ~ExpertExchange();

  int rank() const { return ep_->rank(); }
  int size() const { return ep_->size(); }
  bool hierarchical() const { return intra_ != nullptr; }

  /// Equal-split all-to-all along dimension 0 (size()·chunk rows): chunk j goes to rank j,
  /// the result holds rank j's chunk for this rank at position j. Flat or hierarchical.
  /// Not differentiable (see Scatter/Gather).
  at::Tensor AllToAll(const at::Tensor& input);

  /// The dispatch buffer [E, C, D] → the local experts' inputs [E/n, n·C, D] (NOTE
  /// [flexible expert layout]). Differentiable.
  at::Tensor Scatter(const at::Tensor& buffer);
  /// Scatter, issued without waiting (flat exchange; the hierarchical one runs now): the
  /// returned function waits for the rows and gives Scatter's result. Lets the caller work
  /// while the exchange is in flight (the router under cached assignments). The backward
  /// exchange blocks. Call the function exactly once, before any other exchange.
  std::function<at::Tensor()> StartScatter(const at::Tensor& buffer);
  /// The inverse of Scatter: local experts' outputs [E/n, n·C, D] → [E, C, D] in this
  /// rank's dispatch layout. Differentiable.
  at::Tensor Gather(const at::Tensor& expert_output);

  /// The largest `value` over the group.
  int64_t Max(int64_t value);

  /// NOTE [all-to-all overlap]
  /// Scatter → `experts` → Gather in `degree` chunks of the capacity dimension, so that the
  /// exchanges of some chunks run while the experts compute others (Tutel's adaptive
  /// pipelining, §3.4): every chunk's all-to-all is issued non-blocking up front; chunk i's
  /// experts start as soon as its rows arrived, and its outputs leave at once. The result
  /// equals Gather(experts(Scatter(buffer))) row for row (experts act row-wise); only the
  /// forward overlaps — the backward exchanges block. Always the flat exchange.
  /// `experts` maps local rows [E/n, n·C_i, D] to outputs of that shape.
  at::Tensor OverlappedExperts(const at::Tensor& buffer, int degree,
                               const std::function<at::Tensor(const at::Tensor&)>& experts);

  /// NOTE [ragged expert exchange]
  /// With per-expert capacities each expert's rows are only those it keeps, so ranks send
  /// each other different amounts: the per-expert row counts go first (one small
  /// all-to-all), then the rows themselves with those splits (always the flat exchange).
  /// Received rows arrive by source rank, then local expert; they are regrouped by local
  /// expert, then source rank, so each local expert again multiplies one contiguous matrix.
  struct RaggedLayout {
    std::vector<int64_t> send_splits;  // Rows to each rank.
    std::vector<int64_t> recv_splits;  // Rows from each rank.
    std::vector<int64_t> expert_rows;  // Rows per local expert after regrouping.
    at::Tensor order;                  // Received row of each regrouped row.
  };
  /// Exchanges `rows_per_expert` ([E] int64, this rank's buffer layout: expert-major,
  /// experts contiguous in order) and plans the exchange.
  RaggedLayout PlanRagged(const at::Tensor& rows_per_expert);
  /// Buffer [Σ rows, D] → the local experts' rows [Σ expert_rows, D]. Differentiable.
  at::Tensor ScatterRagged(const at::Tensor& buffer, const RaggedLayout& layout);
  /// The inverse of ScatterRagged. Differentiable.
  at::Tensor GatherRagged(const at::Tensor& expert_output, const RaggedLayout& layout);

 private:
  parallel::Communicator* ep_;
  std::unique_ptr<parallel::Communicator> intra_;  // Same node; null when flat.
  std::unique_ptr<parallel::Communicator> inter_;  // Same local rank, other nodes.
};

}  // namespace fulcrum::moe
