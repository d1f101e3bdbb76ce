#include "core/optimizer/adamw.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <tuple>

#include "core/status.h"

namespace fulcrum {
namespace {

// Σ g² in fp64, in one pass over the gradient with no temporaries. The generic
// `g.to(kDouble).pow(2).sum()` it replaces on CPU fp32 allocated two fp64 copies of every
// gradient and read memory three times: 60–150 ms a step on gpt_8k at one thread, against
// 8–11 ms for PyTorch's clip_grad_norm_ (docs/PERF.md). Each fp32 square is exact in fp64;
// eight running sums keep the adds independent so the loop pipelines.
double SquaredSum(const at::Tensor& g) {
  if (!g.device().is_cpu() || g.scalar_type() != at::kFloat) {
    return g.to(at::kDouble).pow(2).sum().item<double>();
  }
  const at::Tensor c = g.contiguous();
  const float* x = c.data_ptr<float>();
  const int64_t n = c.numel();
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(x[i + j]) * static_cast<double>(x[i + j]);
  }
  for (; i < n; ++i) acc[0] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

// NOTE [gradient norm on a device]
// On the CPU each gradient's Σ g² is summed in turn (SquaredSum). A gradient on an
// accelerator is not read back one by one: that was one host synchronisation per parameter
// (292 a step on the 1.3B GPT, the GPU idle while the host waited and then launched the
// next; Kineto profile, docs/gpu-runs/2026-11-26c/). Their L2 norms come from one
// multi-tensor call in fp64 (_foreach_norm), are squared and summed on the device, and
// read once. fp64 as on the CPU; the summation order differs, so the last bits may.
double AdamW::GradSquaredSum(const std::vector<Unit*>& units, bool expert_parallel) {
  std::vector<at::Tensor> grads;
  for (Unit* unit : units) {
    for (const Parameter& p : unit->parameters()) {
      const at::Tensor& g = p.value.grad();
      if (!g.defined() || p.sharding.ReducedOverExpertData() != expert_parallel) continue;
      // NOTE [parameter sharding]: slices on every tensor-parallel rank, replicas once.
      if (!p.sharding.CountedOn(unit->tp_rank(), unit->tp_size())) continue;
      grads.push_back(g);
    }
  }
  return SumOfSquares(grads);
}

double AdamW::SumOfSquares(const std::vector<at::Tensor>& pieces) {
  double sum = 0.0;
  std::vector<at::Tensor> on_device;
  for (const at::Tensor& g : pieces) {
    if (g.device().is_cpu()) {
      sum += SquaredSum(g);
    } else {
      on_device.push_back(g);
    }
  }
  if (!on_device.empty()) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(on_device, 2, at::kDouble);
    sum += at::stack(norms).square().sum().item<double>();
  }
  return sum;
}

void AdamW::ScaleGradients(const std::vector<Unit*>& units, double factor) {
  for (Unit* unit : units) {
    for (Parameter& p : unit->parameters()) {
      at::Tensor& g = p.value.mutable_grad();
      if (g.defined()) g.mul_(factor);
    }
  }
}

double AdamW::ClipFactor(double grad_norm) const {
  if (options_.clip_grad <= 0) return 1.0;
  const double factor = options_.clip_grad / (grad_norm + 1e-6);
  return factor < 1.0 ? factor : 1.0;
}

StepResult FinishNorm(double local_sq, const std::vector<double>& sums, size_t dp_count,
                      ParallelContext& collectives) {
  std::vector<double> grad_sq{local_sq};
  grad_sq.insert(grad_sq.end(), sums.begin() + static_cast<std::ptrdiff_t>(dp_count), sums.end());
  collectives.SumOverModelParallel(grad_sq);
  StepResult result;
  result.grad_norm = std::sqrt(grad_sq[0]);
  result.data_parallel_sums.assign(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(dp_count));
  result.job_sums.assign(grad_sq.begin() + 1, grad_sq.end());
  return result;
}

absl::Status AdamW::BeginGradientReduction(const std::vector<Unit*>& units,
                                           ParallelContext& collectives) {
  using GroupRole = ParallelContext::GroupRole;
  std::vector<OverlappedReduction::Bucket> buckets;
  for (const GroupRole group : {GroupRole::kData, GroupRole::kExpertData}) {
    if (collectives.GroupSize(group) == 1) continue;
    const bool experts = group == GroupRole::kExpertData;
    auto candidate = [&](const Unit& unit, const Parameter& p) {
      return p.sharding.ReducedOverExpertData() == experts &&
             !collectives.SummedOverModelParallel(unit, p);
    };
    // A parameter trains if it does on some rank of the group (as GradientReducer's
    // presence agreement): every rank then cuts the same buckets.
    std::vector<const Parameter*> candidates;
    for (Unit* unit : units) {
      for (const Parameter& p : unit->parameters()) {
        if (candidate(*unit, p)) candidates.push_back(&p);
      }
    }
    if (candidates.empty()) continue;
    std::vector<bool> mine(candidates.size());
    for (size_t i = 0; i < candidates.size(); ++i) mine[i] = candidates[i]->value.requires_grad();
    const std::vector<bool> trains =
        collectives.AnyRank(group, mine, candidates.front()->value.device());
    std::set<const Parameter*> taken;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (trains[i]) taken.insert(candidates[i]);
    }
    std::vector<OverlappedReduction::Bucket> cut = OverlappedReduction::Cut(
        units, group, [&](const Unit&, const Parameter& p) { return taken.count(&p) > 0; },
        nullptr, options_.BucketBytes());
    for (OverlappedReduction::Bucket& b : cut) {
      b.presence = true;
      buckets.push_back(std::move(b));
    }
  }
  if (!buckets.empty()) overlap_.Begin(std::move(buckets));
  return absl::OkStatus();
}

absl::StatusOr<std::set<const Parameter*>> AdamW::FinishOverlappedReduction(
    ParallelContext& collectives) {
  FULCRUM_ASSIGN_OR_RETURN(const std::vector<at::Tensor> sums, overlap_.Finish(collectives));
  std::set<const Parameter*> reduced;
  at::NoGradGuard no_grad;
  const std::vector<OverlappedReduction::Bucket>& buckets = overlap_.buckets();
  for (size_t i = 0; i < buckets.size(); ++i) {
    const OverlappedReduction::Bucket& b = buckets[i];
    const at::Tensor counts = sums[i].narrow(0, b.size, static_cast<int64_t>(b.members.size()))
                                  .to(at::kFloat).cpu();
    for (size_t j = 0; j < b.members.size(); ++j) {
      Parameter& p = *b.members[j].param;
      reduced.insert(&p);
      // No rank had it: it stays undefined everywhere (as GradientReducer leaves it).
      if (counts.data_ptr<float>()[j] == 0) continue;
      at::Tensor& g = p.value.mutable_grad();
      if (!g.defined()) g = at::zeros_like(p.value);
      g.copy_(sums[i].narrow(0, b.members[j].offset, g.numel()).view_as(g));
    }
  }
  return reduced;
}

absl::StatusOr<StepResult> AdamW::ReduceAndStep(const std::vector<Unit*>& units,
                                                ParallelContext& collectives,
                                                const StepRequest& request) {
  // The job's sums ride along (NOTE [graceful stop]): summed over data parallelism with the
  // data-parallel ones, then over the model-parallel ranks with the gradient norm.
  const auto start = std::chrono::steady_clock::now();
  const size_t dp_count = request.data_parallel_sums.size();
  std::vector<double> sums = request.data_parallel_sums;
  sums.insert(sums.end(), request.job_sums.begin(), request.job_sums.end());
  if (overlap_.active()) {
    FULCRUM_ASSIGN_OR_RETURN(const std::set<const Parameter*> reduced,
                             FinishOverlappedReduction(collectives));
    collectives.AllReduceGradients(units, [&](const Parameter& p) { return reduced.count(&p) > 0; });
  } else {
    collectives.AllReduceGradients(units);
  }
  const double reduce_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  collectives.SumOverDataParallel(sums);
  if (request.after_reduce) {
    ReducedGradients whole(WholeGradientParts(units));
    FULCRUM_RETURN_IF_ERROR(request.after_reduce(whole));
  }
  // Sums of squared gradients: sharded parameters on every tensor-parallel rank, replicated
  // ones (identical on all ranks of the group) once (NOTE [parameter sharding]).
  std::vector<double> expert_sq{GradSquaredSum(units, true)};
  collectives.SumOverExpertParallel(expert_sq);
  StepResult result =
      FinishNorm(GradSquaredSum(units, false) + expert_sq[0], sums, dp_count, collectives);
  result.reduce_ms = reduce_ms;
  if (!std::isfinite(result.grad_norm)) return result;
  const double clip = ClipFactor(result.grad_norm);
  if (clip < 1.0) ScaleGradients(units, clip);
  Step(units, request.lr);
  for (Unit* unit : units) unit->ZeroGrad();
  result.stepped = true;
  return result;
}

// NOTE [fused AdamW on a device]
// The per-tensor update below is ~8 kernels per parameter; on a GPU that is thousands of
// small launches a step. There the parameters go to LibTorch's fused AdamW
// (at::_fused_adamw_, the kernel behind torch.optim.AdamW(fused=True)): one multi-tensor
// launch per group of parameters that share a step count, a weight decay, a device and a
// dtype. Its update is the same formula — w ← w − lr·λ·w; m, v as below; w ← w −
// (lr / (1 − β1ᵗ))·m / (√v / √(1 − β2ᵗ) + ε) — evaluated in fp32 registers, so its last bits
// may differ from the per-tensor ops (AdamWTest.FusedMatchesPerTensor states the bound). The
// CPU keeps the per-tensor ops: every bit-exact CPU test is written against them.
namespace {

struct FusedGroup {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
};

}  // namespace

void AdamW::Step(const std::vector<Unit*>& units, double lr) const {
  at::NoGradGuard no_grad;
  const double beta1 = options_.adam_beta1;
  const double beta2 = options_.adam_beta2;
  // (step, decays, device, dtype) → its parameters.
  std::map<std::tuple<int64_t, bool, std::string, at::ScalarType>, FusedGroup> fused;
  for (Unit* unit : units) {
    // A frozen unit (no parameter requires a gradient) takes no step at all.
    bool trainable = false;
    for (const Parameter& p : unit->parameters()) trainable = trainable || p.value.requires_grad();
    if (!trainable) continue;
    const int64_t step = unit->optimizer_step() + 1;
    unit->set_optimizer_step(step);
    for (Parameter& p : unit->parameters()) {
      const at::Tensor& grad = p.value.grad();
      // A frozen parameter is never updated, even if a gradient reached it.
      if (!grad.defined() || !p.value.requires_grad()) continue;
      at::Tensor& exp_avg = p.OptimizerState(kExpAvg);
      at::Tensor& exp_avg_sq = p.OptimizerState(kExpAvgSq);
      if (!exp_avg.defined() || !exp_avg_sq.defined()) {
        exp_avg = at::zeros_like(p.value, at::MemoryFormat::Contiguous);
        exp_avg_sq = at::zeros_like(p.value, at::MemoryFormat::Contiguous);
      }
      const bool decays = p.weight_decay && options_.weight_decay != 0.0;
      const bool fuse = kernel_ == Kernel::kFused ||
                        (kernel_ == Kernel::kAuto && !p.value.device().is_cpu());
      if (fuse && p.value.is_contiguous() && grad.is_contiguous() &&
          grad.scalar_type() == p.value.scalar_type() && grad.device() == p.value.device()) {
        FusedGroup& group =
            fused[{step, decays, p.value.device().str(), p.value.scalar_type()}];
        group.params.push_back(p.value);
        group.grads.push_back(grad);
        group.exp_avgs.push_back(exp_avg);
        group.exp_avg_sqs.push_back(exp_avg_sq);
        continue;
      }
      Update(p.value, grad, exp_avg, exp_avg_sq, step, lr, decays);
    }
  }
  for (auto& [key, group] : fused) {
    const auto& [step, decays, device, dtype] = key;
    // The kernel reads the step count (already advanced) from a tensor per parameter.
    const at::Tensor step_count = at::full({}, static_cast<double>(step),
                                           at::TensorOptions().dtype(at::kFloat).device(
                                               group.params.front().device()));
    const std::vector<at::Tensor> steps(group.params.size(), step_count);
    at::_fused_adamw_(group.params, group.grads, group.exp_avgs, group.exp_avg_sqs,
                      /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                      decays ? options_.weight_decay : 0.0, options_.adam_eps,
                      /*amsgrad=*/false, /*maximize=*/false);
    // The fused kernel writes the weights without bumping their version counters (unlike
    // the per-tensor ops): bumped here, or the compute copies of the weights (NOTE
    // [compute copies of the weights], core/linear.cc) would stay the old weights — what
    // the first GPU run of this path did (MixedPrecisionTest.GpuBf16LossesFollowTheCpuBf16).
    for (const at::Tensor& param : group.params) torch::autograd::impl::bump_version(param);
  }
}

void AdamW::Update(at::Tensor value, const at::Tensor& grad, at::Tensor exp_avg,
                   at::Tensor exp_avg_sq, int64_t step, double lr, bool decays) const {
  const double beta1 = options_.adam_beta1;
  const double beta2 = options_.adam_beta2;
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const double step_size = lr / bias_correction1;
  const double sqrt_bc2 = std::sqrt(bias_correction2);
  // Decoupled decay first, on the pre-update weights: w ← w·(1 − lr·λ).
  if (decays) value.mul_(1.0 - lr * options_.weight_decay);
  exp_avg.mul_(beta1).add_(grad, 1.0 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / sqrt_bc2).add_(options_.adam_eps);
  value.addcdiv_(exp_avg, denom, -step_size);
}

int64_t AdamW::StateBytes(const std::vector<Unit*>& units) const {
  int64_t bytes = 0;
  for (Unit* unit : units) {
    for (const Parameter& p : unit->parameters()) {
      for (const auto& [slot, t] : p.optimizer_state) {
        if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
      }
    }
  }
  return bytes;
}

}  // namespace fulcrum
