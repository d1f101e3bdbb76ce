#include "moe/dispatch.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fulcrum::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Zeroes the rows of `flat` [rows, D] that no position names (empty slots).
void ZeroUnnamedRows(at::Tensor& flat, const at::Tensor& position) {
  const int64_t rows = flat.size(0);
  if (position.numel() >= rows) return;
  at::Tensor empty =
      at::ones({rows}, position.options().dtype(at::kBool)).index_fill_(0, position, false);
  flat.index_fill_(0, at::nonzero(empty).view({-1}), 0);
}

// x [T, D] → buffer [E, C, D]. Saves only the indices (NOTE [index dispatch memory]).
class DispatchFunction : public torch::autograd::Function<DispatchFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& token,
                            const at::Tensor& position, int64_t num_experts, int64_t capacity) {
    ctx->save_for_backward({token, position});
    ctx->saved_data["num_tokens"] = x.size(0);
    const int64_t hidden = x.size(1);
    const int64_t rows = num_experts * capacity;
    if (token.numel() == 0) return at::zeros({num_experts, capacity, hidden}, x.options());
    // Positions are unique, so each buffer row has at most one source token: one gather
    // straight into the buffer, no [M, D] temporary. Empty slots gather row 0 and are
    // zeroed after (few at capacity factor 1).
    const at::Tensor source = at::zeros({rows}, token.options()).index_copy_(0, position, token);
    at::Tensor buffer = at::empty({num_experts, capacity, hidden}, x.options());
    at::Tensor flat = buffer.view({rows, hidden});
    at::index_select_out(flat, x, 0, source);
    ZeroUnnamedRows(flat, position);
    return buffer;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& token = saved[0];
    const at::Tensor& position = saved[1];
    const int64_t num_tokens = ctx->saved_data["num_tokens"].toInt();
    const at::Tensor& grad_buffer = grads[0];
    const int64_t hidden = grad_buffer.size(2);
    at::Tensor grad_x = at::zeros({num_tokens, hidden}, grad_buffer.options());
    // A token sent to k experts collects k rows.
    grad_x.index_add_(0, token, grad_buffer.reshape({-1, hidden}).index_select(0, position));
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// y [E, C, D] → out [T, D] = Σ gate·y[position] per token. Saves the gates, the indices and,
// when the gates need a gradient, the gathered rows y[position] [M, D] (not y: the backward
// would gather them again, and M <= E·C). `gate_needs_grad` comes from the caller: inside
// forward() the context has no graph node yet when nothing needs a gradient (evaluation, a
// frozen prefix), and asking it (`needs_input_grad`) throws.
class CombineFunction : public torch::autograd::Function<CombineFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& gate,
                            const at::Tensor& token, const at::Tensor& position,
                            int64_t num_tokens, bool gate_needs_grad) {
    const int64_t hidden = y.size(2);
    at::Tensor rows = y.reshape({-1, hidden}).index_select(0, position);  // [M, D]
    at::Tensor weighted;
    if (gate_needs_grad) {
      ctx->save_for_backward({rows, gate, token, position});
      weighted = rows * gate.unsqueeze(1);
    } else {
      ctx->save_for_backward({at::Tensor(), gate, token, position});
      weighted = rows.mul_(gate.unsqueeze(1));
    }
    ctx->saved_data["y_sizes"] = y.sizes();
    return at::zeros({num_tokens, hidden}, y.options()).index_add_(0, token, weighted);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const at::Tensor& gate = saved[1];
    const at::Tensor& token = saved[2];
    const at::Tensor& position = saved[3];
    const std::vector<int64_t> y_sizes = ctx->saved_data["y_sizes"].toIntVector();
    const int64_t hidden = y_sizes[2];
    at::Tensor grad_rows = grads[0].index_select(0, token);  // [M, D], grad_out[token]

    // Rowwise dot product of grad_out[token] and y[position].
    at::Tensor grad_gate = ctx->needs_input_grad(1) ? (rows * grad_rows).sum(1) : at::Tensor();
    at::Tensor grad_y;
    if (ctx->needs_input_grad(0)) {
      grad_rows.mul_(gate.unsqueeze(1));
      grad_y = at::empty(y_sizes, grad_rows.options());
      at::Tensor flat = grad_y.view({-1, hidden});
      flat.index_copy_(0, position, grad_rows);
      ZeroUnnamedRows(flat, position);  // slots no assignment reached get no gradient
    }
    return {grad_y, grad_gate, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void CheckColumn(const at::Tensor& column, const char* name, int64_t n) {
  TORCH_CHECK(column.defined() && column.dim() == 1 && column.size(0) == n,
              "MakeDispatchPlan: ", name, " must be [N] with N = ", n,
              " (the routing's assignments), got ",
              column.defined() ? column.sizes() : at::IntArrayRef{});
}

void CheckPlan(const DispatchPlan& plan, const at::Tensor& t, const char* caller) {
  TORCH_CHECK(plan.token.defined() && plan.position.defined() && plan.gate.defined(), caller,
              ": the plan is empty; build it with MakeDispatchPlan");
  TORCH_CHECK(t.device() == plan.token.device(), caller, ": input is on ", t.device(),
              " but the plan's indices are on ", plan.token.device());
}

}  // namespace

DispatchPlan MakeDispatchPlan(const Routing& routing, const SlotAssignment& slots,
                              int64_t num_tokens) {
  TORCH_CHECK(num_tokens >= 0, "MakeDispatchPlan: num_tokens must be >= 0, got ", num_tokens);
  TORCH_CHECK(slots.capacity >= 0, "MakeDispatchPlan: capacity must be >= 0, got ", slots.capacity);
  TORCH_CHECK(slots.dropped_per_expert.defined() && slots.dropped_per_expert.dim() == 1,
              "MakeDispatchPlan: slots.dropped_per_expert must be [E] (use AssignSlots)");
  const int64_t n = routing.size();
  CheckColumn(routing.token, "routing.token", n);
  CheckColumn(routing.expert, "routing.expert", n);
  CheckColumn(routing.gate, "routing.gate", n);
  CheckColumn(slots.slot, "slots.slot", n);
  TORCH_CHECK(routing.token.scalar_type() == at::kLong &&
                  routing.expert.scalar_type() == at::kLong &&
                  slots.slot.scalar_type() == at::kLong,
              "MakeDispatchPlan: routing.token, routing.expert and slots.slot must be int64");

  DispatchPlan plan;
  plan.num_tokens = num_tokens;
  plan.num_experts = slots.dropped_per_expert.size(0);
  plan.capacity = slots.capacity;
  if (routing.expert_load.defined()) {
    TORCH_CHECK(routing.expert_load.numel() == plan.num_experts,
                "MakeDispatchPlan: the routing has ", routing.expert_load.numel(),
                " experts but the slot assignment ", plan.num_experts);
  }
  if (n > 0) {
    TORCH_CHECK(routing.token.min().item<int64_t>() >= 0 &&
                    routing.token.max().item<int64_t>() < num_tokens,
                "MakeDispatchPlan: routing.token out of [0, ", num_tokens, ")");
  }

  at::Tensor kept = at::nonzero(slots.slot >= 0).view({-1});
  plan.token = routing.token.index_select(0, kept);
  plan.position =
      routing.expert.index_select(0, kept) * plan.capacity + slots.slot.index_select(0, kept);
  plan.gate = routing.gate.index_select(0, kept);
  return plan;
}

at::Tensor Dispatch(const at::Tensor& x, const DispatchPlan& plan) {
  CheckPlan(plan, x, "Dispatch");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == plan.num_tokens,
              "Dispatch: x must be [T, D] with T = ", plan.num_tokens, " (the plan's tokens), got ",
              x.sizes());
  return DispatchFunction::apply(x, plan.token, plan.position, plan.num_experts, plan.capacity);
}

at::Tensor Combine(const at::Tensor& y, const DispatchPlan& plan) {
  CheckPlan(plan, y, "Combine");
  TORCH_CHECK(y.dim() == 3 && y.size(0) == plan.num_experts && y.size(1) == plan.capacity,
              "Combine: y must be [E, C, D] with E = ", plan.num_experts,
              " and C = ", plan.capacity, " (the plan's), got ", y.sizes());
  // Routers keep fp32 gates (NOTE [router precision]); the sum is formed in y's dtype, and
  // autograd casts the gate's gradient back.
  const at::Tensor gate = plan.gate.to(y.scalar_type());
  const bool gate_needs_grad = at::GradMode::is_enabled() && gate.requires_grad();
  return CombineFunction::apply(y, gate, plan.token, plan.position, plan.num_tokens,
                                gate_needs_grad);
}

}  // namespace fulcrum::moe
