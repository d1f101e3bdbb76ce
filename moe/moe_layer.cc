#include "moe/moe_layer.h"

#include <algorithm>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/aux_loss.h"
#include "core/linear.h"
#include "core/random.h"
#include "core/transformer_layer.h"
#include "core/unit.h"
#include "moe/assignment_cache.h"
#include "moe/capacity.h"
#include "moe/dispatch.h"
#include "moe/expert_linear.h"
#include "moe/expert_parallel.h"

// NOTE [MoE mixed precision]
// Under --bf16 the MoE layer follows the dense model's rule (NOTE [mixed precision] in
// core/linear.h): every parameter is an fp32 master; the experts' GEMMs run in the tokens'
// bf16 through LinearForward, which casts the weight where it is used and returns an fp32
// weight gradient. The router runs in fp32: the bf16 tokens are widened on entry
// (RouterInput), so the logits, the softmax and top-k, the gates, the balancing losses and
// the z-loss are all fp32 (NOTE [router precision] in moe/router.h) — Megatron-core keeps
// its router's probabilities and aux losses in fp32 over bf16 activations, and its
// --moe_router_dtype=fp32 widens the logits' GEMM too, which is what is done here always.
// The router's weights are used as the fp32 masters they are, not cast down like the
// experts'. Dispatch, the expert-parallel all-to-all and Combine keep the tokens' dtype, so
// bf16 rows travel (half the bytes); Combine casts the fp32 gates to it and autograd widens
// their gradient back. The aux losses join the backward in fp32 (AuxLossScaler). Tensors
// the layer makes take their dtype and device from the tensors at hand or from the unit
// (its master dtype and device), never from a literal, so fp32 runs are unchanged bit for
// bit. Counters and the assignment cache's table are bookkeeping on the CPU, not compute.

namespace fulcrum::moe {
namespace {

// The auxiliary losses every router may report, in the order the statistics carry them.
constexpr std::array<const char*, 4> kAuxLossNames = {"load_balancing_loss", "importance_loss",
                                                      "load_loss", "z_loss"};

class MoeLayer final : public FeedForward {
 public:
  MoeLayer(const MoeOptions& options, const ModelOptions& model, int64_t layer_index,
           Unit& unit, bool initialize, std::unique_ptr<Router> router,
           std::shared_ptr<ExpertExchange> exchange, const MoeGroups& groups)
      : options_(options),
        model_(model),
        layer_index_(layer_index),
        router_(std::move(router)),
        exchange_(std::move(exchange)),
        groups_(groups),
        loads_(at::zeros({options.num_experts}, at::kLong)) {
    // Router parameters and state join the layer's unit (RouterParameter).
    for (RouterParameter& p : router_->Parameters()) {
      *p.value = unit.AddParameter("mlp." + p.name, *p.value, p.weight_decay);
    }
    for (auto& [name, tensor] : router_->State()) unit.AddBuffer("mlp." + name, tensor);
    if (options.assignment_cache_threshold > 0) {
      cache_ = std::make_unique<AssignmentCache>(options.assignment_cache_positions, options.topk,
                                                 options.assignment_cache_threshold);
      cache_->Register(unit, "mlp.");
    }

    const int tp_rank = groups.tensor ? groups.tensor->rank() : 0;
    const int tp_size = groups.tensor ? groups.tensor->size() : 1;
    const int ep_rank = exchange_ ? exchange_->rank() : 0;
    const int ep_size = exchange_ ? exchange_->size() : 1;
    const int64_t d = model.hidden_size;
    const int64_t f = options.ffn_hidden_size > 0 ? options.ffn_hidden_size : model.ffn_hidden_size;
    const double std = model.init_method_std;
    const double out_std = std / std::sqrt(2.0 * model.num_layers);
    // NOTE [SwiGLU rows]: gate and up rows interleave, so the contiguous tensor-parallel
    // shard of fc1's 2F rows (2F/tp is even: F % tp == 0 is validated) holds whole pairs.
    const int64_t fc1_rows = model.swiglu ? 2 * f : f;
    local_experts_ = options.num_experts / ep_size;
    first_expert_ = ep_rank * local_experts_;
    auto add = [&](const std::string& name, at::IntArrayRef shape, double s, int64_t shard_dim,
                   bool weight_decay) -> at::Tensor& {
      at::Tensor full;
      if (!initialize) {
        std::vector<int64_t> local = shape.vec();
        if (shard_dim >= 0) local[shard_dim] /= tp_size;
        full = at::empty(local, at::TensorOptions(unit.params_dtype()));
      } else {
        // Masters in the unit's dtype (the spec's master dtype); AddParameter puts them on
        // the spec's device. bf16 compute casts them where used (RunExperts).
        full = s > 0 ? NormalInit(model.seed, unit.GlobalName(name), shape, s)
                     : at::zeros(shape, at::TensorOptions(unit.params_dtype()));
        full = ShardOf(full, shard_dim, tp_rank, tp_size);
      }
      return unit.AddParameter(name, full, weight_decay, shard_dim, /*mirror_of=*/"",
                               /*expert_parallel=*/true);
    };
    for (int64_t e = first_expert_; e < first_expert_ + local_experts_; ++e) {
      const std::string prefix = absl::StrCat("mlp.experts.", e, ".");
      Expert expert;
      expert.fc1_weight = add(prefix + "linear_fc1.weight", {fc1_rows, d}, std, 0, true);
      expert.fc2_weight = add(prefix + "linear_fc2.weight", {d, f}, out_std, 1, true);
      // --disable_bias_linear: no bias parameters at all (Mixtral's experts have none), so
      // checkpoints, optimizer state and migrations carry nothing for them.
      if (model.add_bias_linear) {
        expert.fc1_bias = add(prefix + "linear_fc1.bias", {fc1_rows}, 0, 0, false);
        expert.fc2_bias = add(prefix + "linear_fc2.bias", {d}, 0, -1, false);
      }
      experts_.push_back(std::move(expert));
    }
  }

  at::Tensor Forward(const at::Tensor& x, const ForwardContext& ctx) override {
    const int64_t d = x.size(-1);
    at::Tensor tokens = x.reshape({-1, d});
    const int64_t t = tokens.size(0);
    const int64_t k = options_.TopKAt(ctx.iteration);
    RouteContext route_ctx{ctx.training, ctx.iteration, ctx.first_sample, layer_index_, at::Tensor()};
    // NOTE [assignment caching]: in an epoch that routes by the cache, the experts of every
    // token met before are fixed before the router runs.
    const bool caching = cache_ != nullptr && ctx.training;
    at::Tensor positions, cached;
    bool by_cache = false, early = false;
    if (caching) {
      TORCH_CHECK(ctx.token_positions.defined() && ctx.token_positions.numel() == t,
                  "the MoE assignment cache needs the tokens' corpus positions "
                  "(ForwardContext::token_positions) for all ", t, " tokens");
      positions = ctx.token_positions.reshape({-1});
      cache_->BeginForward(ctx.epoch);
      cached = cache_->Lookup(positions);
      by_cache = cache_->active();
      if (by_cache) {
        route_ctx.fixed_experts = cached.to(tokens.device());
        // Batch-prioritized slots need the gates, per-expert buffers are planned after
        // routing; otherwise, when every token is cached, nothing waits for the router.
        early = !options_.batch_prioritized && !options_.per_expert_capacity &&
                cached.select(1, 0).ge(0).all().item<bool>();
      }
    }
    auto route = [&] {
      Routing r = router_->Route(tokens, k, route_ctx);
      return options_.batch_prioritized ? PrioritizeByConfidence(r) : r;
    };
    Routing routing;
    at::Tensor combined;
    if (early) {
      combined = CachedExperts(tokens, route_ctx.fixed_experts, route, &routing);
      if (!ctx.recomputing) ++early_micro_batches_;
    } else {
      routing = route();
      combined = options_.per_expert_capacity ? RaggedExperts(tokens, routing, k)
                                              : PaddedExperts(tokens, routing, k);
    }
    // NOTE [activation recomputation]: the recomputed forward records nothing again.
    if (caching && !ctx.recomputing) cache_->Record(positions, cached, routing.choice, by_cache);
    SlotAssignment& slots = last_slots_;

    if (ctx.training) {
      at::Tensor aux_total;
      for (const auto& [name, value] : routing.aux_losses) {
        aux_total = aux_total.defined() ? aux_total + value : value;
      }
      // NOTE [auxiliary losses] (core/aux_loss.h).
      combined = WithAuxLoss(combined, aux_total, ctx.loss_scale * static_cast<double>(t));
      if (!ctx.recomputing) {
        Accumulate(routing, slots, t);
        expert_rows_ += rows_this_call_;
      }
    }
    return combined.view(x.sizes());
  }

  // Every expert padded to the same capacity C (agreed over the expert-parallel group).
  at::Tensor PaddedExperts(const at::Tensor& tokens, const Routing& routing, int64_t k) {
    DispatchPlan plan = PlanPadded(routing, k, tokens.size(0));
    at::Tensor buffer = Dispatch(tokens, plan);  // [E, C, D]
    auto experts = [this](const at::Tensor& local) { return RunPaddedExperts(local); };
    if (exchange_ == nullptr) return Combine(experts(buffer), plan);
    if (options_.a2a_overlap_degree > 1) {
      return Combine(exchange_->OverlappedExperts(buffer, options_.a2a_overlap_degree, experts),
                     plan);
    }
    return Combine(exchange_->Gather(experts(exchange_->Scatter(buffer))), plan);
  }

  // The padded path when the cache fixes every token's experts: capacity, slots, dispatch
  // and the exchange need only the assignment list, which is the one the router will
  // return (TokenChoiceRouting's order over the fixed experts), so they go first and the
  // router runs while the rows are in flight (one rank: after the experts). The gates join
  // at the combine.
  at::Tensor CachedExperts(const at::Tensor& tokens, const at::Tensor& experts,
                           const std::function<Routing()>& route, Routing* routing) {
    const int64_t t = tokens.size(0);
    const int64_t k = experts.size(1);
    Routing fixed;
    fixed.token = at::arange(t, experts.options()).repeat({k});
    fixed.expert = experts.t().reshape({-1}).contiguous();
    fixed.gate = at::zeros({t * k}, tokens.options());  // placeholder: the plan's positions
    fixed.expert_load = at::bincount(fixed.expert, /*weights=*/{}, options_.num_experts);
    at::Tensor buffer = Dispatch(tokens, PlanPadded(fixed, k, t));  // [E, C, D]
    auto run = [this](const at::Tensor& local) { return RunPaddedExperts(local); };
    at::Tensor y;
    if (exchange_ == nullptr) {
      y = run(buffer);
      *routing = route();
    } else if (options_.a2a_overlap_degree > 1) {
      *routing = route();
      y = exchange_->OverlappedExperts(buffer, options_.a2a_overlap_degree, run);
    } else {
      std::function<at::Tensor()> arrived = exchange_->StartScatter(buffer);
      *routing = route();
      y = exchange_->Gather(run(arrived()));
    }
    TORCH_CHECK(routing->expert.equal(fixed.expert),
                "the router did not route to the cached experts it was given");
    return Combine(y, MakeDispatchPlan(*routing, last_slots_, t));
  }

  // The padded capacity of `assignments` (agreed over the expert-parallel group), their
  // slots (kept in last_slots_) and the dispatch plan over `t` tokens.
  DispatchPlan PlanPadded(const Routing& assignments, int64_t k, int64_t t) {
    CapacityMaxReduce max_reduce;
    if (exchange_ != nullptr && exchange_->size() > 1) {
      max_reduce = [this](int64_t need) { return exchange_->Max(need); };
    }
    const int64_t capacity =
        ExpertCapacity(options_.capacity_factor, k, t, assignments.expert_load, max_reduce);
    last_slots_ = AssignSlots(assignments, options_.num_experts, capacity);
    rows_this_call_ = 0;
    return MakeDispatchPlan(assignments, last_slots_, t);
  }

  // The local experts on their padded rows [E/n, n·C, D] → outputs of that shape; counts
  // the rows (Load()).
  at::Tensor RunPaddedExperts(const at::Tensor& local) {
    const std::vector<int64_t> sizes(local.size(0), local.size(1));
    rows_this_call_ += local.size(0) * local.size(1);
    return RunExperts(local.reshape({-1, local.size(2)}), sizes).view(local.sizes());
  }

  // Each expert's rows are only the assignments it keeps (MoeOptions::per_expert_capacity).
  at::Tensor RaggedExperts(const at::Tensor& tokens, const Routing& routing, int64_t k) {
    const int64_t t = tokens.size(0);
    const int64_t e_count = options_.num_experts;
    // The capacity is this micro-batch's own: no padding to agree on.
    const int64_t capacity =
        ExpertCapacity(options_.capacity_factor, k, t, routing.expert_load);
    last_slots_ = AssignSlots(routing, e_count, capacity);
    const at::Tensor rows = at::clamp_max(routing.expert_load, capacity);  // [E] kept rows
    const at::Tensor offsets = at::cumsum(rows, 0) - rows;
    const int64_t total = rows.sum().item<int64_t>();
    // The buffer is one "expert" of `total` rows to the index dispatch: positions are
    // expert offset + slot (slots of kept assignments are < min(load, C)).
    DispatchPlan plan;
    at::Tensor kept = at::nonzero(last_slots_.slot >= 0).view({-1});
    plan.token = routing.token.index_select(0, kept);
    at::Tensor expert = routing.expert.index_select(0, kept);
    plan.position = offsets.index_select(0, expert) + last_slots_.slot.index_select(0, kept);
    plan.gate = routing.gate.index_select(0, kept);
    plan.num_tokens = t;
    plan.num_experts = 1;
    plan.capacity = total;
    at::Tensor buffer = Dispatch(tokens, plan).view({total, tokens.size(1)});
    std::vector<int64_t> expert_rows;
    at::Tensor local;
    ExpertExchange::RaggedLayout layout;
    if (exchange_ != nullptr && exchange_->size() > 1) {
      layout = exchange_->PlanRagged(rows);
      local = exchange_->ScatterRagged(buffer, layout);
      expert_rows = layout.expert_rows;
    } else {
      local = buffer;
      const at::Tensor r = rows.contiguous();
      expert_rows.assign(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
    }
    rows_this_call_ = local.size(0);
    at::Tensor y = RunExperts(local, expert_rows);  // [Σ rows, D]
    if (exchange_ != nullptr && exchange_->size() > 1) y = exchange_->GatherRagged(y, layout);
    return Combine(y.unsqueeze(0), plan);
  }

  // The local experts on their rows: `rows` [Σ sizes, D] holds expert e's `sizes[e]` rows
  // after expert e−1's. Returns their outputs [Σ sizes, D], complete (tensor-parallel
  // partial sums reduced, biases added).
  at::Tensor RunExperts(at::Tensor rows, const std::vector<int64_t>& sizes) {
    if (groups_.tensor != nullptr) rows = groups_.tensor->CopyToRegion(rows);
    const bool sharded = groups_.tensor != nullptr && groups_.tensor->size() > 1;
    // Each projection is one grouped linear over all the local experts, with Linear's B/W
    // split (NOTE [grouped expert linear] in moe/expert_linear.h): one batched GEMM on CUDA,
    // the former per-expert GEMMs on the CPU.
    std::vector<at::Tensor> fc1_weights, fc1_biases, fc2_weights, fc2_biases;
    for (const Expert& expert : experts_) {
      fc1_weights.push_back(expert.fc1_weight);
      fc2_weights.push_back(expert.fc2_weight);
      if (expert.fc1_bias.defined()) fc1_biases.push_back(expert.fc1_bias);
      // Row-parallel fc2: its bias is added once, after the reduction.
      if (expert.fc2_bias.defined() && !sharded) fc2_biases.push_back(expert.fc2_bias);
    }
    at::Tensor h = ExpertLinear(rows, sizes, fc1_weights, fc1_biases);
    // The dense MLP's activation: GeLU (tanh with openai_gelu) or SwiGLU. On the CPU expert
    // by expert, as before: its vectorised loop computes a tensor's last few elements with
    // the scalar formula, so where an expert's rows end changes bits (on CUDA every element
    // takes the same formula, and one launch covers all the experts).
    if (BatchesExperts(rows)) {
      h = MlpActivation(model_, h);
    } else {
      // split_with_sizes, not one narrow per expert: its backward is a single cat of the
      // experts' gradients, where each narrow's would zero-fill a whole [Σ sizes, F]
      // gradient and autograd would add E of them (docs/PERF.md).
      std::vector<at::Tensor> activated;
      for (const at::Tensor& part : h.split_with_sizes(sizes)) {
        activated.push_back(MlpActivation(model_, part));
      }
      h = at::cat(activated);
    }
    at::Tensor y = ExpertLinear(h, sizes, fc2_weights, fc2_biases);
    if (groups_.tensor == nullptr) return y;
    y = groups_.tensor->ReduceFromRegion(y);
    if (!sharded || experts_.empty() || !experts_[0].fc2_bias.defined()) return y;
    std::vector<at::Tensor> biases;
    std::vector<int64_t> row_expert;
    for (size_t e = 0; e < experts_.size(); ++e) {
      biases.push_back(experts_[e].fc2_bias);
      row_expert.insert(row_expert.end(), sizes[e], static_cast<int64_t>(e));
    }
    // The fp32 master biases are cast to the rows' dtype, as LinearForward casts its own
    // (NOTE [mixed precision]); the index lives where the rows do.
    const at::Tensor index = at::tensor(row_expert, at::kLong).to(y.device());
    return y + at::stack(biases).index_select(0, index).to(y.scalar_type());
  }

  void AfterOptimizerStep() override {
    // One all-reduce over the data-parallel replicas (expert-parallel ranks included, as
    // they route other tokens): loads, drops, tokens, token-weighted aux losses.
    const int64_t e = options_.num_experts;
    const int64_t aux = static_cast<int64_t>(kAuxLossNames.size());
    const std::vector<int64_t> cache_counts =
        cache_ ? cache_->StepCounts() : std::vector<int64_t>{0, 0, 0};
    at::Tensor packed = at::zeros({e + 7 + aux}, at::kDouble);
    packed.narrow(0, 0, e).copy_(loads_);
    double* p = packed.data_ptr<double>();
    p[e] = static_cast<double>(dropped_);
    p[e + 1] = static_cast<double>(tokens_);
    for (size_t i = 0; i < kAuxLossNames.size(); ++i) p[e + 2 + i] = aux_weighted_[i];
    p[e + 2 + aux] = static_cast<double>(expert_rows_);
    for (int i = 0; i < 3; ++i) p[e + 3 + aux + i] = static_cast<double>(cache_counts[i]);
    p[e + 6 + aux] = static_cast<double>(early_micro_batches_);
    int replicas = 1;
    if (groups_.data != nullptr && groups_.data->size() > 1) {
      groups_.data->AllReduce(packed, parallel::ReduceOp::kSum);
      replicas = groups_.data->size();
    }
    at::Tensor global_load = packed.narrow(0, 0, e).round().to(at::kLong);
    router_->AfterOptimizerStep(global_load);
    std::vector<int64_t> global_cache_counts;
    for (int i = 0; i < 3; ++i) global_cache_counts.push_back(std::llround(p[e + 3 + aux + i]));
    if (cache_) cache_->AfterOptimizerStep(groups_.data, global_cache_counts);

    statistics_.clear();
    statistics_.push_back({"expert_tokens", std::vector<double>(p, p + e), /*per_layer=*/true});
    statistics_.push_back({"dropped_tokens", {p[e]}});
    const double tokens = std::max(p[e + 1], 1.0);
    for (size_t i = 0; i < kAuxLossNames.size(); ++i) {
      if (seen_[i]) statistics_.push_back({kAuxLossNames[i], {p[e + 2 + i] / tokens}});
    }
    if (cache_) {
      // Per layer: tokens met again whose experts changed, tokens met again, tokens routed
      // by the cache, micro-batches dispatched before the router ran (NOTE [assignment
      // caching]).
      statistics_.push_back({"assignment_cache",
                             {p[e + 3 + aux], p[e + 4 + aux], p[e + 5 + aux], p[e + 6 + aux]},
                             /*per_layer=*/true});
      early_micro_batches_ = 0;
    }
    last_expert_rows_ = p[e + 2 + aux] / replicas;
    expert_rows_ = 0;
    loads_.zero_();
    dropped_ = 0;
    tokens_ = 0;
    aux_weighted_.fill(0.0);
  }

  std::vector<BlockStatistic> Statistics() const override { return statistics_; }

  bool needs_token_positions() const override { return cache_ != nullptr; }

  double Load() const override { return last_expert_rows_; }

  // The step's counters as one fp64 vector: loads [E], dropped, tokens, aux sums, aux seen,
  // expert rows, micro-batches dispatched before routing. Counts stay exact through the fp32 of a migration up to 2^24.
  std::vector<std::pair<std::string, at::Tensor>> StepState() const override {
    const int64_t e = options_.num_experts;
    const int64_t aux = static_cast<int64_t>(kAuxLossNames.size());
    at::Tensor packed = at::zeros({e + 4 + 2 * aux}, at::kDouble);
    packed.narrow(0, 0, e).copy_(loads_);
    double* p = packed.data_ptr<double>();
    p[e] = static_cast<double>(dropped_);
    p[e + 1] = static_cast<double>(tokens_);
    for (int64_t i = 0; i < aux; ++i) {
      p[e + 2 + i] = aux_weighted_[i];
      p[e + 2 + aux + i] = seen_[i] ? 1.0 : 0.0;
    }
    p[e + 2 + 2 * aux] = static_cast<double>(expert_rows_);
    p[e + 3 + 2 * aux] = static_cast<double>(early_micro_batches_);
    std::vector<std::pair<std::string, at::Tensor>> state = {{"counters", packed}};
    if (cache_) {
      for (auto& entry : cache_->StepState()) state.push_back(std::move(entry));
    }
    return state;
  }

  void LoadStepState(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    const int64_t e = options_.num_experts;
    const int64_t aux = static_cast<int64_t>(kAuxLossNames.size());
    for (const auto& [name, tensor] : state) {
      if (name != "counters") continue;
      TORCH_CHECK(tensor.numel() == e + 4 + 2 * aux, "MoE step state of ", tensor.numel(),
                  " values, expected ", e + 4 + 2 * aux);
      at::Tensor packed = tensor.to(at::kDouble).contiguous();
      const double* p = packed.data_ptr<double>();
      loads_.copy_(packed.narrow(0, 0, e).round().to(at::kLong));
      dropped_ = std::llround(p[e]);
      tokens_ = std::llround(p[e + 1]);
      for (int64_t i = 0; i < aux; ++i) {
        aux_weighted_[i] = p[e + 2 + i];
        seen_[i] = p[e + 2 + aux + i] > 0.5;
      }
      expert_rows_ = std::llround(p[e + 2 + 2 * aux]);
      early_micro_batches_ = std::llround(p[e + 3 + 2 * aux]);
    }
    if (cache_) cache_->LoadStepState(state);
  }

 private:
  // The biases are undefined without ModelOptions::add_bias_linear.
  struct Expert {
    at::Tensor fc1_weight, fc1_bias, fc2_weight, fc2_bias;
  };

  void Accumulate(const Routing& routing, const SlotAssignment& slots, int64_t tokens) {
    loads_ += routing.expert_load.to(at::kCPU);
    dropped_ += slots.dropped;
    tokens_ += tokens;
    for (const auto& [name, value] : routing.aux_losses) {
      for (size_t i = 0; i < kAuxLossNames.size(); ++i) {
        if (name != kAuxLossNames[i]) continue;
        aux_weighted_[i] += value.item<double>() * static_cast<double>(tokens);
        seen_[i] = true;
      }
    }
  }

  MoeOptions options_;
  ModelOptions model_;  // MlpActivation's choice: swiglu, openai_gelu.
  int64_t layer_index_;
  std::unique_ptr<Router> router_;
  std::shared_ptr<ExpertExchange> exchange_;  // Null when ep == 1.
  std::unique_ptr<AssignmentCache> cache_;    // Null unless --moe_assignment_cache_threshold.
  int64_t early_micro_batches_ = 0;  // This step's micro-batches that took CachedExperts.
  MoeGroups groups_;
  int64_t local_experts_ = 0;
  int64_t first_expert_ = 0;
  std::vector<Expert> experts_;
  // This step's measurements so far (training micro-batches of this rank).
  at::Tensor loads_;  // [E] int64
  int64_t dropped_ = 0;
  int64_t tokens_ = 0;
  std::array<double, kAuxLossNames.size()> aux_weighted_{};
  std::array<bool, kAuxLossNames.size()> seen_{};
  std::vector<BlockStatistic> statistics_;
  SlotAssignment last_slots_;  // Of the last Forward.
  int64_t rows_this_call_ = 0;  // Rows the local experts multiplied in the last Forward.
  int64_t expert_rows_ = 0;    // Rows the local experts multiplied this step (training).
  double last_expert_rows_ = 0;  // The same for the last completed step.
};

}  // namespace

std::string MoeOptions::LayerFreqText() const {
  if (layer_pattern.empty()) return std::to_string(layer_freq);
  std::string text = "[";
  for (size_t i = 0; i < layer_pattern.size(); ++i) {
    absl::StrAppend(&text, i == 0 ? "" : ",", layer_pattern[i] ? 1 : 0);
  }
  return text + "]";
}

absl::Status ParseMoeLayerFreq(const std::string& text, MoeOptions* options) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--moe_layer_freq='", text, "' ", why,
                                                   " (expected N ≥ 1 or a list like [1,1,0,0])"));
  };
  options->layer_pattern.clear();
  if (!trimmed.empty() && trimmed.front() == '[') {
    if (trimmed.back() != ']') return bad("does not end with ']'");
    for (absl::string_view item :
         absl::StrSplit(trimmed.substr(1, trimmed.size() - 2), ',', absl::SkipWhitespace())) {
      item = absl::StripAsciiWhitespace(item);
      if (item != "0" && item != "1") return bad(absl::StrCat("has entry '", item, "', not 0 or 1"));
      options->layer_pattern.push_back(item == "1");
    }
    if (options->layer_pattern.empty()) return bad("is an empty list");
    return absl::OkStatus();
  }
  int64_t freq = 0;
  if (!absl::SimpleAtoi(trimmed, &freq) || freq < 1) return bad("is not an integer ≥ 1");
  options->layer_freq = freq;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> MoeShape(const MoeOptions& options,
                                                          const ModelOptions& model) {
  if (options.num_experts == 0) return {};
  const int64_t f = options.ffn_hidden_size > 0 ? options.ffn_hidden_size : model.ffn_hidden_size;
  std::vector<std::pair<std::string, std::string>> shape = {
          {"num_experts", std::to_string(options.num_experts)},
          {"moe_layer_freq", options.LayerFreqText()},
          {"moe_ffn_hidden_size", std::to_string(f)},
          {"moe_router", options.router}};
  if (options.assignment_cache_threshold > 0) {
    // The cache's table is state of the layers: present or not, and its size, must match.
    shape.emplace_back("moe_assignment_cache_threshold",
                       absl::StrCat("on (", options.assignment_cache_positions, " positions x k=",
                                    options.topk, ")"));
  }
  return shape;
}

absl::Status ValidateMoeOptions(const MoeOptions& options, const ModelOptions& model,
                                int expert_parallel_size, int tensor_parallel_size) {
  if (options.num_experts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_experts must be >= 0 (0 = dense), got ", options.num_experts));
  }
  if (options.num_experts == 0) {
    if (expert_parallel_size > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--expert_model_parallel_size=", expert_parallel_size, " needs MoE layers (--num_experts)"));
    }
    return absl::OkStatus();
  }
  if (options.layer_pattern.empty() && options.layer_freq < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_layer_freq must be >= 1, got ", options.layer_freq));
  }
  if (!options.layer_pattern.empty() &&
      static_cast<int64_t>(options.layer_pattern.size()) != model.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_layer_freq=", options.LayerFreqText(), " has ", options.layer_pattern.size(),
        " entries but the model has --num_layers=", model.num_layers, " (one 0/1 per layer)"));
  }
  if (!options.layer_pattern.empty() &&
      std::none_of(options.layer_pattern.begin(), options.layer_pattern.end(),
                   [](auto moe) { return static_cast<bool>(moe); })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_layer_freq=", options.LayerFreqText(),
        " makes no layer an MoE layer; mark at least one with 1, or drop --num_experts and "
        "--plugins=moe"));
  }
  if (options.num_experts % expert_parallel_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_experts=", options.num_experts, " is not divisible by --expert_model_parallel_size=",
        expert_parallel_size));
  }
  const int64_t f = options.ffn_hidden_size > 0 ? options.ffn_hidden_size : model.ffn_hidden_size;
  if (options.ffn_hidden_size < 0 || f % tensor_parallel_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_ffn_hidden_size=", f, " must be > 0 and divisible by --tensor_model_parallel_size=",
        tensor_parallel_size));
  }
  if (options.hierarchical_node_size < 0 ||
      (options.hierarchical_node_size > 1 && expert_parallel_size % options.hierarchical_node_size != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_hierarchical_a2a_node_size=", options.hierarchical_node_size,
        " must be 0 (flat) or divide --expert_model_parallel_size=", expert_parallel_size));
  }
  if (RouterRegistry::Global().Find(options.router) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--moe_router='", options.router,
                                                   "' is unknown; routers: ", RouterNames()));
  }
  for (const auto& [iteration, k] : options.topk_schedule) {
    if (iteration < 1 || k < 1 || k > options.num_experts || (options.router == "switch" && k != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--moe_router_topk_schedule: ", iteration, ":", k, " needs an iteration >= 1 and k in [1, ",
          options.router == "switch" ? int64_t{1} : options.num_experts, "]"));
    }
  }
  if (options.a2a_overlap_degree < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--moe_a2a_overlap_degree must be >= 1, got ",
                                                   options.a2a_overlap_degree));
  }
  if (options.a2a_overlap_degree > 1 &&
      (options.per_expert_capacity || options.hierarchical_node_size > 1)) {
    return absl::InvalidArgumentError(
        "--moe_a2a_overlap_degree > 1 chunks the padded flat exchange; it does not combine with "
        "--moe_per_expert_capacity or --moe_hierarchical_a2a_node_size");
  }
  if (absl::Status s = ValidateCapacityFactor(options.capacity_factor); !s.ok()) return s;
  if (!(options.assignment_cache_threshold >= 0 && options.assignment_cache_threshold <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--moe_assignment_cache_threshold must be in [0, 1] (0 = off), got ",
                     options.assignment_cache_threshold));
  }
  if (options.assignment_cache_threshold > 0) {
    if (!options.topk_schedule.empty()) {
      return absl::InvalidArgumentError(
          "--moe_assignment_cache_threshold caches k experts per token; it does not combine "
          "with --moe_router_topk_schedule");
    }
  }
  RouterOptions router = options.router_options;
  router.num_experts = options.num_experts;
  router.topk = options.topk;
  router.hidden_size = model.hidden_size;
  return ValidateRouterOptions(router);
}

absl::StatusOr<FeedForwardFactory> MakeMoeFactory(const MoeOptions& options,
                                                  const ModelOptions& model,
                                                  const MoeGroups& groups) {
  const int ep = groups.expert ? groups.expert->size() : 1;
  const int tp = groups.tensor ? groups.tensor->size() : 1;
  if (absl::Status s = ValidateMoeOptions(options, model, ep, tp); !s.ok()) return s;
  if (options.num_experts == 0) return FeedForwardFactory();
  // Fail now on an unknown router name rather than while building layer 0.
  RouterOptions router_options = options.router_options;
  router_options.num_experts = options.num_experts;
  router_options.topk = options.topk;
  router_options.hidden_size = model.hidden_size;
  router_options.seed = model.seed;
  if (options.assignment_cache_threshold > 0 && options.assignment_cache_positions <= 0) {
    return absl::InvalidArgumentError(
        "--moe_assignment_cache_threshold needs the training split's token count "
        "(MoeOptions::assignment_cache_positions, filled from the data)");
  }
  auto probe = MakeRouter(options.router, router_options);
  if (!probe.ok()) return probe.status();
  if (options.assignment_cache_threshold > 0 && !(*probe)->token_choice()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--moe_assignment_cache_threshold caches each token's experts; --moe_router=",
        options.router, " does not let tokens choose (use a token-choice router)"));
  }
  std::shared_ptr<ExpertExchange> exchange;
  if (ep > 1) {
    exchange = std::make_shared<ExpertExchange>(groups.expert, options.hierarchical_node_size);
  }
  return FeedForwardFactory([options, model, groups, exchange, router_options](
                                int64_t layer_index, Unit& unit,
                                bool initialize) -> std::unique_ptr<FeedForward> {
    if (!options.IsMoeLayer(layer_index)) return nullptr;
    RouterOptions r = router_options;
    r.init_scope = unit.GlobalName("mlp");
    auto router = MakeRouter(options.router, r);
    TORCH_CHECK(router.ok(), router.status().ToString());  // validated above
    return std::make_unique<MoeLayer>(options, model, layer_index, unit, initialize,
                                      std::move(router).value(), exchange, groups);
  });
}

}  // namespace fulcrum::moe
