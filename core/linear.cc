#include "core/linear.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/custom_function.h>

#include <chrono>
#include <optional>
#include <unordered_map>

#include "core/kernels/device_timer.h"
#include "core/kernels/linear_epilogue.h"

namespace fulcrum {
namespace {

// NOTE [store across threads]
// On the CPU autograd runs a backward's nodes on the thread that called backward(); for
// CUDA tensors it runs them on its own per-device worker thread. A thread_local active
// store is therefore invisible exactly where a GPU backward computes weight gradients: they
// were applied at once and the B/W split silently did nothing (an H100 run found it:
// ExpertLinearCudaTest). The store is instead held in c10's ThreadLocalDebugInfo, which
// the autograd engine captures with the rest of the caller's thread-local state
// (at::ThreadLocalState) and installs on its worker threads for that backward. The slot
// used is PRODUCER_INFO, which c10 reserves for the application (LibTorch itself leaves it
// empty); a Scope pushes a new entry, so scopes nest and threads stay apart.
struct ActiveStore final : c10::DebugInfoBase {
  explicit ActiveStore(WeightGradStore* s) : store(s) {}
  WeightGradStore* store;
};
constexpr c10::DebugInfoKind kStoreSlot = c10::DebugInfoKind::PRODUCER_INFO;

thread_local int64_t t_current_tag = WeightGradStore::kNoTag;

constexpr const char* kTagKey = "weight_grad_tag";

// NOTE [compute copies of the weights]
// Under --bf16 every GEMM casts its fp32 master weight to bf16 where it is used (NOTE [mixed
// precision]): in the forward and again in the backward of every micro-batch — on the 1.3B
// GPT 8 casts of each weight a step, ~29 ms of an H100's 437 (Kineto profile,
// docs/gpu-runs/2026-11-26c/). On an accelerator the cast is kept instead, as Megatron keeps
// its bf16 model weights beside the fp32 masters: one compute copy per master weight, valid
// while the master's version counter (bumped by every in-place write: the optimizer's step,
// a checkpoint's copy_, pruning's mask) has not moved since it was made. A stale copy is
// refreshed in place (no allocation), so after the first step a layer's copies are written
// once per optimizer step and read by every micro-batch. Costs the copies' memory (2 bytes per
// weight in bf16). The copies are allocated and freed unreported to the thread's memory
// reporter — they are weights, not activations (NOTE [activation memory] in
// pipeline/stage_executor.h) — and dropped once their master is gone (a layer that left
// the stage). The CPU casts where it computes, as before: its bit-exact and memory tests
// are written on that, and there the cast is cheap beside the GEMM.
class ComputeCopies {
 public:
  static ComputeCopies& Global() {
    static ComputeCopies* copies = new ComputeCopies();
    return *copies;
  }

  at::Tensor Get(const at::Tensor& master, at::ScalarType dtype) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t version = master._version();
    auto it = entries_.find(master.unsafeGetTensorImpl());
    if (it != entries_.end() && !it->second.master.expired() &&
        it->second.data == master.data_ptr() && it->second.copy.scalar_type() == dtype &&
        it->second.copy.sizes() == master.sizes()) {
      Entry& entry = it->second;
      if (entry.version != version) {
        Quiet quiet;
        at::NoGradGuard no_grad;
        entry.copy.copy_(master);
        entry.version = version;
      }
      return entry.copy;
    }
    Quiet quiet;  // the allocation and any copies the sweep frees go unreported
    if (++inserts_ % 256 == 0) Sweep();
    at::Tensor copy = master.detach().to(dtype);
    entries_.insert_or_assign(
        master.unsafeGetTensorImpl(),
        Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(master.getIntrusivePtr()), version,
              master.data_ptr(), copy});
    return copy;
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> master;
    int64_t version = 0;
    const void* data = nullptr;
    at::Tensor copy;
  };
  // Hides this thread's memory reporter while it lives.
  struct Unreported final : c10::MemoryReportingInfoBase {
    bool memoryProfilingEnabled() const override { return false; }
    void reportMemoryUsage(void*, int64_t, size_t, size_t, c10::Device) override {}
  };
  struct Quiet {
    c10::DebugInfoGuard guard{c10::DebugInfoKind::PROFILER_STATE, std::make_shared<Unreported>()};
  };
  void Sweep() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = it->second.master.expired() ? entries_.erase(it) : std::next(it);
    }
  }

  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  int64_t inserts_ = 0;
};

// `weight` in `dtype` for a GEMM (NOTE [compute copies of the weights]).
at::Tensor ForCompute(const at::Tensor& weight, at::ScalarType dtype) {
  if (weight.scalar_type() == dtype) return weight;
  if (weight.device().is_cpu()) return weight.to(dtype);
  return ComputeCopies::Global().Get(weight, dtype);
}

}  // namespace

at::Tensor ComputeCopyOf(const at::Tensor& master, at::ScalarType dtype) {
  return ComputeCopies::Global().Get(master, dtype);
}

namespace {

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Accumulates `grad` into `weight`'s .grad the way autograd's AccumulateGrad would.
void AccumulateInto(const at::Tensor& weight, const at::Tensor& grad) {
  at::Tensor& slot = const_cast<at::Tensor&>(weight).mutable_grad();
  if (slot.defined()) {
    slot.add_(grad);
  } else {
    slot = grad;
  }
}

// The weight gradient of y = x·Wᵀ for `grad_out`: grad_outᵀ·x over all leading dimensions,
// in one GEMM whose result has the master dtype, so what accumulates over micro-batches is
// fp32 (NOTE [mixed precision]). bf16 operands accumulate into an fp32 result — cuBLASLt's
// on CUDA (Megatron's fused main_grad accumulation), the same product in fp32 on the CPU;
// fp32/fp64 operands take exactly the plain GEMM (core/kernels/linear_epilogue.h). Fused or
// deferred, the same closure runs on the same saved tensors, so the B/W split stays exact.
std::function<at::Tensor()> WeightGradOf(const at::Tensor& grad_out, const at::Tensor& input,
                                         at::ScalarType master) {
  const bool widen = master == at::kFloat && input.scalar_type() != at::kFloat;
  return [grad_out, input, master, widen]() {
    return kernels::LinearWeightGrad(grad_out, input, /*want_bias_grad=*/false, widen)
        .grad_weight.to(master);
  };
}

// NOTE [gradient accumulation fusion]
// On a GPU, once a weight's .grad exists (the second micro-batch on), its gradient is
// accumulated by the GEMM itself — C = grad_outᵀ·x + C, beta = 1, into the fp32 .grad
// (kernels::AccumulateWeightGrad; Megatron's gradient_accumulation_fusion) — instead of a
// GEMM into a temporary and an add over the whole weight, autograd's AccumulateGrad or ours.
// The fused backward then hands autograd no gradient for the weight (it is already in
// .grad). The CPU keeps the product and the add: its bit-exact tests are written on them.
bool AccumulatesInGemm(const at::Tensor& weight) {
  const at::Tensor& slot = weight.grad();
  return weight.is_cuda() && slot.defined() && slot.is_contiguous() &&
         slot.scalar_type() == weight.scalar_type();
}

// Adds the weight gradient into weight.grad: in the GEMM where it can (above), else the
// product then AccumulateInto.
void AccumulateWeightGradInto(const at::Tensor& weight, const at::Tensor& grad_out,
                              const at::Tensor& input) {
  if (AccumulatesInGemm(weight)) {
    kernels::AccumulateWeightGrad(grad_out, input, const_cast<at::Tensor&>(weight).mutable_grad());
    return;
  }
  AccumulateInto(weight, WeightGradOf(grad_out, input, weight.scalar_type())());
}

// The gradient of `weight` in y = x·Wᵀ for `grad_out` (contiguous): returned for autograd
// to accumulate, or — while a store is active — queued with `tag` and the bytes it holds
// (NOTE [B/W split]), undefined then and for a frozen weight (no W work for it). Every
// autograd function here with a full weight takes its weight gradients through this one
// place, so the fused and the deferred gradient are the same closure.
at::Tensor WeightGradOrDefer(const at::Tensor& weight, const at::Tensor& grad_out,
                             const at::Tensor& input, int64_t tag) {
  if (!weight.requires_grad()) return at::Tensor();
  if (WeightGradStore* store = WeightGradStore::Active()) {
    // Deferred; autograd receives no gradient for the weight.
    store->Push([weight, grad_out, input]() { AccumulateWeightGradInto(weight, grad_out, input); },
                tag, Bytes(grad_out) + Bytes(input));
    return at::Tensor();
  }
  if (AccumulatesInGemm(weight)) {  // NOTE [gradient accumulation fusion]
    AccumulateWeightGradInto(weight, grad_out, input);
    return at::Tensor();
  }
  return WeightGradOf(grad_out, input, weight.scalar_type())();
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight) {
    ctx->save_for_backward({input, weight});
    // NOTE [weight-gradient tags]: the tag of the layer whose forward this is.
    ctx->saved_data[kTagKey] = WeightGradStore::CurrentTag();
    // NOTE [mixed precision]: the GEMM runs in the input's dtype; the master weight is
    // saved, not its cast (the backward casts again rather than hold a second copy).
    return at::matmul(input, ForCompute(weight, input.scalar_type()).t());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad_out = grads[0].contiguous();

    // A first trainable layer after a frozen prefix needs no input gradient (NOTE [frozen
    // prefix] in core/gpt_model.h).
    at::Tensor grad_input = ctx->needs_input_grad(0)
                                ? at::matmul(grad_out, ForCompute(weight, grad_out.scalar_type()))
                                : at::Tensor();
    at::Tensor grad_weight =
        WeightGradOrDefer(weight, grad_out, input, ctx->saved_data[kTagKey].toInt());
    return {grad_input, grad_weight};
  }
};

// y = x·W[rows]ᵀ: the gradient of W lands in its `rows` only (index_add into W's .grad),
// deferred under the B/W split like LinearFunction's.
class LinearRowsFunction : public torch::autograd::Function<LinearRowsFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& rows) {
    // The selected rows in the input's dtype (NOTE [mixed precision]).
    const at::Tensor selected = weight.index_select(0, rows).to(input.scalar_type());
    ctx->save_for_backward({input, weight, selected});
    ctx->saved_data["rows"] = rows;
    ctx->saved_data[kTagKey] = WeightGradStore::CurrentTag();
    return at::matmul(input, selected.t());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& selected = saved[2];
    const at::Tensor rows = ctx->saved_data["rows"].toTensor();
    const at::Tensor grad_out = grads[0].contiguous();
    at::Tensor grad_input = ctx->needs_input_grad(0) ? at::matmul(grad_out, selected) : at::Tensor();
    // LinearFunction's weight gradient, landing in `rows` only.
    const std::function<at::Tensor()> rows_grad = WeightGradOf(grad_out, input, weight.scalar_type());
    auto into_rows = [weight, rows](const at::Tensor& g) {
      at::Tensor& slot = const_cast<at::Tensor&>(weight).mutable_grad();
      if (!slot.defined()) slot = at::zeros_like(weight);
      slot.index_add_(0, rows, g);
    };
    at::Tensor grad_weight;
    if (!weight.requires_grad()) {
      // Frozen: no weight gradient.
    } else if (WeightGradStore* store = WeightGradStore::Active()) {
      store->Push([into_rows, rows_grad]() { into_rows(rows_grad()); },
                  ctx->saved_data[kTagKey].toInt(), Bytes(grad_out) + Bytes(input));
    } else {
      grad_weight = at::zeros_like(weight).index_add_(0, rows, rows_grad());
    }
    return {grad_input, grad_weight, at::Tensor()};
  }
};

// NOTE [fused GeLU MLP]: h = gelu(x·W1ᵀ + b1), y = h·W2ᵀ through the fused epilogues, the
// weight gradients through WeightGradOrDefer like LinearFunction's. `bias` arrives in the
// input's dtype (cast by autograd outside, as LinearForward's bias); the weights are the
// masters, cast here as LinearFunction casts its weight.
class LinearGeluMlpFunction : public torch::autograd::Function<LinearGeluMlpFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& fc1_weight,
                            const std::optional<at::Tensor>& fc1_bias,
                            const at::Tensor& fc2_weight, bool tanh_approx) {
    const at::ScalarType dtype = input.scalar_type();
    kernels::LinearGeluOutput fc1 = kernels::LinearBiasGeluForward(
        input, ForCompute(fc1_weight, dtype), fc1_bias.value_or(at::Tensor()), tanh_approx);
    // What the unfused MLP keeps: fc1's input, the GeLU's input and fc2's input (the
    // weights are leaves, saved without a copy).
    ctx->save_for_backward({input, fc1_weight, fc2_weight, fc1.pre_activation, fc1.output});
    ctx->saved_data[kTagKey] = WeightGradStore::CurrentTag();
    ctx->saved_data["tanh_approx"] = tanh_approx;
    ctx->saved_data["has_bias"] = fc1_bias.has_value();
    return at::matmul(fc1.output, ForCompute(fc2_weight, dtype).t());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& fc1_weight = saved[1];
    const at::Tensor& fc2_weight = saved[2];
    const at::Tensor& pre = saved[3];
    const at::Tensor& h = saved[4];
    const int64_t tag = ctx->saved_data[kTagKey].toInt();
    const at::Tensor grad_out = grads[0].contiguous();
    const at::ScalarType dtype = grad_out.scalar_type();
    // needs_input_grad counts the tensor inputs only: 2 is the bias when there is one.
    const bool want_bias_grad = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    kernels::GeluInputGrad fc2_back =
        kernels::LinearGeluInputGrad(grad_out, ForCompute(fc2_weight, dtype), pre,
                                     ctx->saved_data["tanh_approx"].toBool(), want_bias_grad);
    const at::Tensor grad_pre = fc2_back.grad_pre_activation.contiguous();
    // fc2's weight gradient before fc1's: the order autograd runs the unfused Linears in,
    // so a deferred queue holds the same closures in the same order.
    at::Tensor grad_fc2_weight = WeightGradOrDefer(fc2_weight, grad_out, h, tag);
    at::Tensor grad_input =
        ctx->needs_input_grad(0) ? at::matmul(grad_pre, ForCompute(fc1_weight, dtype)) : at::Tensor();
    at::Tensor grad_fc1_weight = WeightGradOrDefer(fc1_weight, grad_pre, input, tag);
    return {grad_input, grad_fc1_weight, fc2_back.grad_bias, grad_fc2_weight, at::Tensor()};
  }
};

}  // namespace

WeightGradStore* WeightGradStore::Active() {
  const auto* active = dynamic_cast<const ActiveStore*>(c10::ThreadLocalDebugInfo::get(kStoreSlot));
  return active != nullptr ? active->store : nullptr;
}

WeightGradStore::Scope::Scope(WeightGradStore* store)
    : guard_(std::make_unique<c10::DebugInfoGuard>(kStoreSlot,
                                                   std::make_shared<ActiveStore>(store))) {}

WeightGradStore::Scope::~Scope() = default;

int64_t WeightGradStore::CurrentTag() { return t_current_tag; }

WeightGradStore::TagScope::TagScope(int64_t tag) : previous_(t_current_tag) { t_current_tag = tag; }

WeightGradStore::TagScope::~TagScope() { t_current_tag = previous_; }

void WeightGradStore::Push(std::function<void()> task, int64_t tag, int64_t bytes) {
  // A graph with CPU and CUDA nodes runs both at once (the caller's thread and the device's).
  std::lock_guard<std::mutex> lock(push_mutex_);
  tasks_.push_back(Task{std::move(task), tag, bytes});
  held_bytes_ += bytes;
}

void WeightGradStore::RunAll(std::vector<Task>& tasks, std::map<int64_t, double>* ms_by_tag,
                             kernels::DeviceTimer* timer, const std::string& key_prefix) {
  using Clock = std::chrono::steady_clock;
  // As inside autograd's backward: the closures' operands are saved activations that
  // require grad, and a weight gradient computed in grad mode would too (it would record
  // a graph, and the optimizers' out= kernels refuse such tensors).
  at::NoGradGuard no_grad;
  for (Task& task : tasks) {
    if (timer != nullptr) {
      const std::string key = key_prefix + std::to_string(task.tag);
      timer->Start(key);
      task.run();
      timer->Stop(key);
      continue;
    }
    if (ms_by_tag == nullptr) {
      task.run();
      continue;
    }
    const auto start = Clock::now();
    task.run();
    (*ms_by_tag)[task.tag] +=
        std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }
}

void WeightGradStore::Flush(std::map<int64_t, double>* ms_by_tag, kernels::DeviceTimer* timer,
                            const std::string& key_prefix) {
  // Swap first: a task never re-enters the store, but Flush must leave it empty even if
  // a task throws.
  std::vector<Task> tasks;
  tasks.swap(tasks_);
  held_bytes_ = 0;
  RunAll(tasks, ms_by_tag, timer, key_prefix);
}

void WeightGradStore::FlushTag(int64_t tag, std::map<int64_t, double>* ms_by_tag,
                               kernels::DeviceTimer* timer, const std::string& key_prefix) {
  std::vector<Task> selected;
  std::vector<Task> rest;
  for (Task& task : tasks_) {
    if (task.tag == tag) {
      held_bytes_ -= task.bytes;
      selected.push_back(std::move(task));
    } else {
      rest.push_back(std::move(task));
    }
  }
  tasks_.swap(rest);
  RunAll(selected, ms_by_tag, timer, key_prefix);
}

at::Tensor LinearForward(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& bias) {
  at::Tensor out = LinearFunction::apply(input, weight);
  // The bias is an ordinary autograd op: its gradient is a cheap reduction done in B. Cast
  // to the output's dtype (autograd's cast widens its gradient back to the master's).
  return bias.defined() ? out + bias.to(out.scalar_type()) : out;
}

at::Tensor LinearRowsForward(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& rows) {
  at::Tensor out = LinearRowsFunction::apply(input, weight, rows);
  return bias.defined() ? out + bias.index_select(0, rows).to(out.scalar_type()) : out;
}

at::Tensor LinearGeluMlpForward(const at::Tensor& input, const at::Tensor& fc1_weight,
                                const at::Tensor& fc1_bias, const at::Tensor& fc2_weight,
                                bool tanh_approx) {
  TORCH_CHECK(fc1_weight.dim() == 2 && fc2_weight.dim() == 2 &&
                  fc2_weight.size(1) == fc1_weight.size(0),
              "LinearGeluMlpForward: fc2's weight must be [out, ", fc1_weight.size(0),
              "] for fc1's weight ", fc1_weight.sizes(), ", got ", fc2_weight.sizes());
  // The bias through autograd's cast, as LinearForward's (NOTE [mixed precision]); an
  // autograd function takes a missing tensor as an empty optional, not an undefined tensor.
  std::optional<at::Tensor> bias;
  if (fc1_bias.defined()) bias = fc1_bias.to(input.scalar_type());
  return LinearGeluMlpFunction::apply(input, fc1_weight, bias, fc2_weight, tanh_approx);
}

at::Tensor LinearWeightGradient(const at::Tensor& grad_output, const at::Tensor& input,
                                at::ScalarType master) {
  return WeightGradOf(grad_output, input, master)();  // LinearFunction's, for other files
}

void AccumulateWeightGradInto(const at::Tensor& weight, const at::Tensor& grad) {
  AccumulateInto(weight, grad);
}

}  // namespace fulcrum
