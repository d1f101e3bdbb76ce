#include "core/linear.h"

#include <torch/csrc/autograd/custom_function.h>

namespace fulcrum {
namespace {

thread_local WeightGradStore* t_active_store = nullptr;

// Accumulates `grad` into `weight`'s .grad the way autograd's AccumulateGrad would.
void AccumulateInto(const at::Tensor& weight, const at::Tensor& grad) {
  at::Tensor& slot = const_cast<at::Tensor&>(weight).mutable_grad();
  if (slot.defined()) {
    slot.add_(grad);
  } else {
    slot = grad;
  }
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight) {
    ctx->save_for_backward({input, weight});
    return at::matmul(input, weight.t());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad_out = grads[0].contiguous();
    const int64_t out_features = weight.size(0);
    const int64_t in_features = weight.size(1);

    at::Tensor grad_input = at::matmul(grad_out, weight);
    // Weight gradient: grad_outᵀ·x over all leading dimensions, in one GEMM.
    auto weight_grad = [grad_out, input, out_features, in_features]() {
      return at::matmul(grad_out.reshape({-1, out_features}).t(),
                        input.reshape({-1, in_features}));
    };
    at::Tensor grad_weight;
    if (WeightGradStore* store = WeightGradStore::Active()) {
      // Deferred (see NOTE [B/W split]); autograd receives no gradient for the weight.
      store->Push([weight, weight_grad]() { AccumulateInto(weight, weight_grad()); });
    } else if (weight.requires_grad()) {
      grad_weight = weight_grad();
    }
    return {grad_input, grad_weight};
  }
};

}  // namespace

WeightGradStore* WeightGradStore::Active() { return t_active_store; }

WeightGradStore::Scope::Scope(WeightGradStore* store) : previous_(t_active_store) {
  t_active_store = store;
}

WeightGradStore::Scope::~Scope() { t_active_store = previous_; }

void WeightGradStore::Flush() {
  // Swap first: a task never re-enters the store, but Flush must leave it empty even if
  // a task throws.
  std::vector<std::function<void()>> tasks;
  tasks.swap(tasks_);
  for (auto& task : tasks) task();
}

at::Tensor LinearForward(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& bias) {
  at::Tensor out = LinearFunction::apply(input, weight);
  // The bias is an ordinary autograd op: its gradient is a cheap reduction done in B.
  return bias.defined() ? out + bias : out;
}

}  // namespace fulcrum
