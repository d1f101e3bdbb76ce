// Linear projection y = x·Wᵀ + b as a custom autograd function that can split its backward
// into the input gradient (B) and the weight gradient (W), the split zero-bubble pipeline
// schedules need (Qi et al., ICLR 2024, §2).
//
// NOTE [B/W split]
// While a WeightGradStore is active on the calling thread, the backward of Linear computes
// only grad_input and grad_bias (cheap) and queues a closure that computes grad_weight =
// grad_outputᵀ·x and accumulates it into weight.grad(). Running the queued closures later
// (the W action) gives gradients bit-identical to the fused backward: the same GEMM on the
// same operands, accumulated in the same order. Without an active store the backward is
// the ordinary fused one.
//
// NOTE [weight-gradient tags]
// Each queued closure carries the tag that was current (WeightGradStore::TagScope) on the
// thread that ran the layer's *forward*: the pipeline executor sets the global layer index
// around each transformer layer, so the time of a W action can be split per layer, and the
// closures of one layer can be run on their own (FlushTag) — e.g. to send a layer to another
// stage as soon as its own weight gradients are final. A weight belongs to one layer, so
// running one tag's closures before another's keeps every weight's accumulation order, and
// the gradients stay bit-identical.
//
// NOTE [mixed precision]
// Megatron's bf16 (--bf16, core/device.h): parameters stay fp32 leaves (the masters); each
// is cast to the activation's dtype where it is used, autocast style, and the gradient
// comes back fp32. Linear casts its weight inside the function — the GEMMs run in the
// input's dtype — and computes the weight gradient into the weight's dtype (bf16 operands
// accumulating in fp32: kernels::LinearWeightGrad) before it is returned or accumulated
// (fused or deferred alike, so the B/W split stays exact); biases
// and the other parameters go through autograd's own cast, whose backward widens. So
// .grad is fp32 and accumulates in fp32 over micro-batches (Megatron's main_grad), and the
// optimizer, the gradient reductions and the norm see only fp32. The norms compute in
// fp32 and return the compute dtype, the loss computes in fp32 from bf16 logits. With
// equal dtypes every cast is a no-op: fp32 and fp64 runs are bit-identical to before.
//
// NOTE [fused GeLU MLP]
// LinearGeluMlpForward is the local part of the GeLU MLP, gelu(x·W1ᵀ + b1)·W2ᵀ, as one
// autograd function whose GEMMs are core/kernels/linear_epilogue.h's: the forward fuses
// fc1's bias and GeLU into its GEMM (keeping the pre-activation), the backward fuses the
// GeLU's backward into fc2's input-gradient GEMM (and b1's gradient with it). Its two weight
// gradients go through LinearFunction's own code — the same closure on the same operands,
// fused or deferred into the active store with the tag of the forward, fc2's queued before
// fc1's (the order autograd runs the two Linears in) — so on the CPU, where every kernel is
// the plain LibTorch op the unfused layer runs, outputs and all gradients equal the
// unfused MLP's bit for bit, with or without the B/W split. What autograd keeps is the same
// as the unfused MLP's: x (fc1's input), pre (the GeLU's input) and h (fc2's input), the
// weights being leaves (measured with the c10 memory reporter the pipeline's activation
// meter uses: 50176 bytes for the test layer's forward, fused or not; on CUDA the fused
// forward's aux output is that same pre-activation). Saving pre only and recomputing h in
// the backward would save one [s, b, f/tp] tensor per layer, but under the B/W split h must
// live until the W pass anyway, so it is kept. b1 goes through autograd's cast like
// LinearForward's bias (NOTE [mixed precision]); its gradient, a sum over the folded rows,
// equals autograd's sum over (s, b) of the unfused bias add (the test compares them bit for
// bit: the reduction folds the two contiguous dimensions alike). TransformerLayer::Mlp
// uses it for GeLU (not SwiGLU) while no plugin replaces fc1 or fc2 (SetLinear); setting
// either slot — even to plain LinearForward, which is how the tests select the unfused
// path — gives the unfused MLP.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace c10 {
class DebugInfoGuard;  // c10/util/ThreadLocalDebugInfo.h
}  // namespace c10

namespace fulcrum {

namespace kernels {
class DeviceTimer;  // core/kernels/device_timer.h
}  // namespace kernels

/// Holds deferred weight-gradient computations (one store per micro-batch's backward).
/// Push may be called from autograd's device threads; Flush and FlushTag from one thread at
/// a time. Tags are per thread (set during the forward); the active store rides with the
/// thread that runs backward() into autograd's worker threads (NOTE [store across threads]).
class WeightGradStore {
 public:
  /// Tag of the closures of linear layers run outside any TagScope (embedding, head).
  static constexpr int64_t kNoTag = -1;

  WeightGradStore() = default;
  WeightGradStore(const WeightGradStore&) = delete;
  WeightGradStore& operator=(const WeightGradStore&) = delete;

  /// The store active on this thread — or, on an autograd worker thread, on the thread
  /// whose backward() it is running — or nullptr.
  static WeightGradStore* Active();

  /// Activates `store` on this thread, and on the autograd threads of any backward() it
  /// starts, for the scope's lifetime (restores the previous one).
  class Scope {
   public:
    explicit Scope(WeightGradStore* store);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    std::unique_ptr<c10::DebugInfoGuard> guard_;
  };

  /// The tag current on this thread (kNoTag outside any TagScope).
  static int64_t CurrentTag();

  /// Makes `tag` current on this thread for the scope's lifetime (restores the previous
  /// one): linear layers whose forward runs inside label their deferred weight gradients
  /// with it (NOTE [weight-gradient tags]).
  class TagScope {
   public:
    explicit TagScope(int64_t tag);
    ~TagScope();
    TagScope(const TagScope&) = delete;
    TagScope& operator=(const TagScope&) = delete;

   private:
    int64_t previous_;
  };

  /// Queues `task`, labelled `tag`; `bytes` is what it keeps alive until it runs (its
  /// operands), for memory accounting.
  void Push(std::function<void()> task, int64_t tag = kNoTag, int64_t bytes = 0);
  /// Runs and clears every queued computation, in queue order. With `ms_by_tag`, adds each
  /// computation's wall time to (*ms_by_tag)[its tag]. With `timer`, times each one as the
  /// interval `key_prefix` + its tag ("W/3/" + "5") instead: on a GPU the wall time would
  /// be the launch, the timer's events measure the work (NOTE [device timer] in
  /// core/kernels/device_timer.h); the caller Collects.
  void Flush(std::map<int64_t, double>* ms_by_tag = nullptr,
             kernels::DeviceTimer* timer = nullptr, const std::string& key_prefix = "");
  /// Runs and removes only the computations labelled `tag`, in queue order; the others stay
  /// queued in their order. Timed as Flush.
  void FlushTag(int64_t tag, std::map<int64_t, double>* ms_by_tag = nullptr,
                kernels::DeviceTimer* timer = nullptr, const std::string& key_prefix = "");
  /// FlushTag(*tag, ...) with a tag, Flush(...) without: what a caller walking the layers
  /// runs at each step (GptModel::ReportFinalGradients).
  void Run(std::optional<int64_t> tag, std::map<int64_t, double>* ms_by_tag = nullptr,
           kernels::DeviceTimer* timer = nullptr, const std::string& key_prefix = "") {
    if (tag.has_value()) {
      FlushTag(*tag, ms_by_tag, timer, key_prefix);
    } else {
      Flush(ms_by_tag, timer, key_prefix);
    }
  }
  size_t size() const { return tasks_.size(); }
  bool empty() const { return tasks_.empty(); }
  /// Bytes the queued computations keep alive (sum of their Push `bytes`).
  int64_t held_bytes() const { return held_bytes_; }

 private:
  struct Task {
    std::function<void()> run;
    int64_t tag;
    int64_t bytes;
  };
  // Runs `tasks` in order, timing them into `ms_by_tag` or `timer` when given.
  static void RunAll(std::vector<Task>& tasks, std::map<int64_t, double>* ms_by_tag,
                     kernels::DeviceTimer* timer, const std::string& key_prefix);

  std::vector<Task> tasks_;
  std::mutex push_mutex_;  // Push only (NOTE [store across threads]).
  int64_t held_bytes_ = 0;
};

/// `master` in `dtype` from the compute-copy cache (NOTE [compute copies of the weights] in
/// core/linear.cc): made once, refreshed in place when the master's version counter moved,
/// allocated unreported to the thread's memory reporter. The GEMMs here use it on
/// accelerators only (the CPU casts where it computes); public for its tests.
at::Tensor ComputeCopyOf(const at::Tensor& master, at::ScalarType dtype);

/// y = x·Wᵀ + b for x [..., in], W [out, in], b [out] (may be undefined). The result has x's
/// dtype; W and b may be wider masters (NOTE [mixed precision]).
at::Tensor LinearForward(const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& bias);

/// y = x·W[rows]ᵀ + b[rows] for `rows` [r] int64 (indices into W's first dimension): the
/// product with some of W's rows, e.g. only the query rows of a QKV weight. W's gradient
/// accumulates into those rows of W.grad (deferred under the B/W split like LinearForward's).
at::Tensor LinearRowsForward(const at::Tensor& input, const at::Tensor& weight,
                             const at::Tensor& bias, const at::Tensor& rows);

/// The local part of a GeLU MLP: gelu(x·W1ᵀ + b1)·W2ᵀ for x [..., h], W1 [f, h], b1 [f]
/// (may be undefined), W2 [h', f] → [..., h'], GeLU the tanh approximation when
/// `tanh_approx` (--openai_gelu). Equal, output and gradients bit for bit on the CPU, to
/// LinearForward(at::gelu(LinearForward(x, W1, b1)), W2, {}) (NOTE [fused GeLU MLP]).
at::Tensor LinearGeluMlpForward(const at::Tensor& input, const at::Tensor& fc1_weight,
                                const at::Tensor& fc1_bias, const at::Tensor& fc2_weight,
                                bool tanh_approx);

/// The weight gradient LinearForward's backward computes for (grad_output, input), in
/// `master`'s dtype: bf16 operands accumulate into fp32 for an fp32 master (NOTE [mixed
/// precision]). For layers that run their own GEMMs but keep Linear's gradients exactly,
/// e.g. moe/expert_linear.h's grouped experts.
at::Tensor LinearWeightGradient(const at::Tensor& grad_output, const at::Tensor& input,
                                at::ScalarType master);

/// Adds `grad` into `weight`'s .grad the way autograd's AccumulateGrad would (the first
/// gradient becomes .grad): what a deferred weight-gradient closure does when it runs
/// (NOTE [B/W split]).
void AccumulateWeightGradInto(const at::Tensor& weight, const at::Tensor& grad);

}  // namespace fulcrum
