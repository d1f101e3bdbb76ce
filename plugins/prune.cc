// The `prune` plugin: gradual global magnitude pruning (Zhu & Gupta 2017, as DynMo §5.1
// uses it) of the QKV, attention-output and both MLP weights of every layer, with sparse
// compute once a weight is sparse enough, so pruned layers really get cheaper and the
// balancers see it.
//
// NOTE [pruning schedule]
// At iterations t = t0, t0 + Δt, ..., t_end (--prune_start_iter, --prune_interval,
// --prune_end_iter) the target sparsity is S_t = S_f + (S_i − S_f)(1 − (t − t0)/(t_end − t0))³
// (S_i --prune_initial_sparsity, S_f --prune_final_sparsity); after iteration t's optimizer
// step (t0 = 0: before the first iteration, on the initial weights) exactly round(S_t · N)
// of the N prunable weights of the whole model are zero. The formula is followed to t_end
// inclusive (DynMo's code stops one step short, at 78.75% for 90%).
//
// NOTE [global threshold]
// The threshold is global over the distributed model — every stage, every tensor-parallel
// shard — and exact, the same as one process computes on the same weights: the k-th
// smallest |w| found from two histograms of the magnitudes' bit patterns (16 bits each; four
// for fp64), each summed over the model-parallel ranks (PluginContext::SumOverModel), so no
// rank gathers weights. Non-negative floats order like their bit patterns. Weights equal to
// the threshold are pruned until exactly k are: in the canonical order model-parallel rank,
// layer, weight, element. Already pruned weights (zeros) come first, so masks only grow.
//
// NOTE [masks]
// A pruned weight is exactly zero and stays zero: its gradient is masked after every
// backward (AfterBackward), its Adam moments are zeroed when it is pruned, and decoupled
// decay keeps a zero at zero. So the weights themselves carry the masks: after a checkpoint
// load or a migration a layer re-derives them (w ≠ 0) in an OnStateLoaded callback — nothing
// extra is saved or moved, and any layout loads them. (An unpruned weight that training
// drove to exactly 0.0 would count as pruned from the next derivation on; in fp32 that has
// no measurable chance.)
//
// NOTE [sparse compute]
// A weight whose density falls below the measured crossover (core/sparse_linear.h,
// SparseIsFaster) computes its forward, input gradient and weight gradient only at its
// nonzeros (SparseLinearForward, B/W split honoured); denser weights use the dense product
// of the masked weight. The sparse structure is rebuilt at each pruning step and its values
// re-read after every optimizer step. MoE layers' experts are not pruned (their attention
// weights are).
#include <gflags/gflags.h>

#include <array>
#include <cmath>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/gpt_model.h"
#include "core/linear.h"
#include "core/logging.h"
#include "core/sparse_linear.h"
#include "core/status.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_int64(prune_start_iter, 0,
             "prune: first pruning step t0 (after that iteration's optimizer step; 0 = on the "
             "initial weights).");
DEFINE_int64(prune_end_iter, 0, "prune: last pruning step; the final sparsity is reached there.");
DEFINE_int64(prune_interval, 1, "prune: iterations between pruning steps (Δt).");
DEFINE_double(prune_initial_sparsity, 0.0, "prune: sparsity S_i of the schedule at t0.");
DEFINE_double(prune_final_sparsity, 0.9, "prune: sparsity S_f reached at --prune_end_iter.");
DEFINE_bool(prune_sparse_compute, true,
            "prune: compute sparse-enough weights' products at their nonzeros only (else always "
            "the dense product of the masked weight).");

namespace fulcrum::plugins {
namespace {

constexpr char kAttachment[] = "prune";
constexpr std::array<LinearSlot, 4> kSlots = {LinearSlot::kQkv, LinearSlot::kProj, LinearSlot::kFc1,
                                              LinearSlot::kFc2};
constexpr int kHistogramBits = 16;
constexpr int64_t kBins = int64_t{1} << kHistogramBits;

struct PruneOptions {
  int64_t start = 0;
  int64_t end = 0;
  int64_t interval = 1;
  double initial = 0.0;
  double final = 0.9;
  bool sparse_compute = true;
};

absl::StatusOr<PruneOptions> OptionsFromFlags() {
  PruneOptions o{FLAGS_prune_start_iter, FLAGS_prune_end_iter,   FLAGS_prune_interval,
                 FLAGS_prune_initial_sparsity, FLAGS_prune_final_sparsity, FLAGS_prune_sparse_compute};
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.start < 0) return bad(absl::StrCat("--prune_start_iter=", o.start, " must be ≥ 0"));
  if (o.end < o.start) {
    return bad(absl::StrCat("--prune_end_iter=", o.end, " is before --prune_start_iter=", o.start));
  }
  if (o.interval < 1) return bad(absl::StrCat("--prune_interval=", o.interval, " must be ≥ 1"));
  if ((o.end - o.start) % o.interval != 0) {
    return bad(absl::StrCat("--prune_end_iter=", o.end, " − --prune_start_iter=", o.start,
                            " is not a multiple of --prune_interval=", o.interval));
  }
  if (!(o.final >= 0 && o.final < 1)) {
    return bad(absl::StrCat("--prune_final_sparsity=", o.final, " must be in [0, 1)"));
  }
  if (!(o.initial >= 0 && o.initial <= o.final)) {
    return bad(absl::StrCat("--prune_initial_sparsity=", o.initial, " must be in [0, ",
                            "--prune_final_sparsity=", o.final, "]"));
  }
  return o;
}

// NOTE [pruning schedule]
bool IsPruningStep(const PruneOptions& o, int64_t t) {
  return t >= o.start && t <= o.end && (t - o.start) % o.interval == 0;
}

double TargetSparsity(const PruneOptions& o, int64_t t) {
  if (o.end == o.start) return o.final;
  const double progress = static_cast<double>(t - o.start) / static_cast<double>(o.end - o.start);
  return o.final + (o.initial - o.final) * std::pow(1.0 - progress, 3);
}

// A layer's pruning state, derived from its weights (NOTE [masks]).
struct LayerPrune {
  std::array<at::Tensor, 4> mask;  // bool [out, in]; undefined: nothing pruned (or no slot)
  std::array<std::shared_ptr<SparseWeight>, 4> sparse;  // Set when sparse compute pays.
  std::array<bool, 4> present{};   // The layer has this weight (not MoE experts).
  std::array<int64_t, 4> size{};   // Elements of each weight (this rank's shard).
  std::array<int64_t, 4> kept{};   // Of which unpruned.
};

// The magnitude of element i of `w` as an order-preserving key (NOTE [global threshold]).
// Read on the host: a weight on a GPU is copied once per pruning step (pruning is rare).
struct Keys {
  explicit Keys(const at::Tensor& weight) : w(weight.to(at::kCPU).contiguous()) {
    is_double = w.scalar_type() == at::kDouble;
  }
  int64_t size() const { return w.numel(); }
  uint64_t operator[](int64_t i) const {
    if (is_double) {
      uint64_t bits;
      std::memcpy(&bits, w.data_ptr<double>() + i, sizeof(bits));
      return bits & 0x7FFFFFFFFFFFFFFFULL;
    }
    uint32_t bits;
    std::memcpy(&bits, w.data_ptr<float>() + i, sizeof(bits));
    return bits & 0x7FFFFFFFu;
  }
  at::Tensor w;
  bool is_double = false;
};

double KeyValue(uint64_t key, bool is_double) {
  if (is_double) {
    double v;
    std::memcpy(&v, &key, sizeof(v));
    return v;
  }
  const uint32_t bits = static_cast<uint32_t>(key);
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

LayerPrune* StateOf(const TransformerLayer& layer) { return layer.Attached<LayerPrune>(kAttachment); }

class PrunePlugin final : public Plugin {
 public:
  explicit PrunePlugin(PruneOptions options) : options_(options) {}
  const char* name() const override { return "prune"; }
  // Its sparse products record nothing in the forward: a recomputed layer computes the same.
  bool SupportsRecompute() const override { return true; }
  // Its products run inside the tensor-parallel regions, on the whole sequence.
  bool SupportsSequenceParallel() const override { return true; }

  void EditLayer(TransformerLayer& layer, bool initialize) override {
    auto state = std::make_shared<LayerPrune>();
    layer.Attach(kAttachment, state);
    for (size_t i = 0; i < kSlots.size(); ++i) {
      state->present[i] = layer.weight(kSlots[i]).defined();
      if (!state->present[i]) continue;
      // NOTE [sparse compute]: the sparse product while the structure exists.
      layer.SetLinear(kSlots[i], [state, i](const at::Tensor& x, const at::Tensor& w,
                                             const at::Tensor& b) {
        if (state->sparse[i] != nullptr) return SparseLinearForward(x, state->sparse[i], w, b);
        return LinearForward(x, w, b);
      });
    }
    const bool sparse_compute = options_.sparse_compute;
    layer.OnStateLoaded([sparse_compute](Unit& unit) {
      auto& self = static_cast<TransformerLayer&>(unit);
      Derive(self, sparse_compute, /*masks=*/nullptr);
    });
    for (size_t i = 0; i < kSlots.size(); ++i) {
      if (state->present[i]) state->size[i] = state->kept[i] = layer.weight(kSlots[i]).numel();
    }
    if (layer.feed_forward() == nullptr) {
      // The kept fraction of the layer's prunable weights: what the balancer may expect.
      LayerPrune* raw = state.get();  // The layer owns both the reporter and the state.
      layer.AddLoadFraction(TransformerLayer::LoadFraction::kWeights, [raw] {
        double kept = 0, all = 0;
        for (size_t i = 0; i < kSlots.size(); ++i) {
          all += static_cast<double>(raw->size[i]);
          kept += static_cast<double>(raw->kept[i]);
        }
        return all > 0 ? kept / all : 1.0;
      });
    }
  }

  absl::Status BeforeIteration(PluginContext& ctx) override {
    // t0 = 0: the first pruning step is on the initial weights.
    if (ctx.iteration() == 1 && options_.start == 0 && !pruned_at_start_) {
      pruned_at_start_ = true;
      return Prune(ctx, 0);
    }
    return absl::OkStatus();
  }

  absl::Status AfterBackward(PluginContext& ctx) override {
    // NOTE [masks]: pruned weights get no gradient. Each part of a reduced gradient this
    // rank holds (whole, or the distributed optimizer's slice) takes its part of the mask.
    at::NoGradGuard no_grad;
    std::map<const Parameter*, at::Tensor> masks;
    for (const auto& [index, layer] : ctx.model().layers()) {
      LayerPrune* state = StateOf(*layer);
      for (size_t i = 0; state != nullptr && i < kSlots.size(); ++i) {
        if (!state->mask[i].defined()) continue;
        if (const Parameter* p = layer->FindParameter(LinearSlotName(kSlots[i]))) {
          masks[p] = state->mask[i].reshape({-1});
        }
      }
    }
    for (const GradientPart& part : ctx.gradients().parts()) {
      auto it = masks.find(part.param);
      if (it != masks.end()) part.grad.mul_(it->second.narrow(0, part.begin, part.end - part.begin));
    }
    return absl::OkStatus();
  }

  absl::Status AfterOptimizerStep(PluginContext& ctx) override {
    // The sparse structures mirror the weights the step changed.
    for (const auto& [index, layer] : ctx.model().layers()) {
      LayerPrune* state = StateOf(*layer);
      for (size_t i = 0; state != nullptr && i < kSlots.size(); ++i) {
        if (state->sparse[i] != nullptr) {
          state->sparse[i]->RefreshValues(layer->weight(kSlots[i]));
        }
      }
    }
    if (ctx.iteration() > 0 && IsPruningStep(options_, ctx.iteration())) {
      return Prune(ctx, ctx.iteration());
    }
    return absl::OkStatus();
  }

  absl::Status AfterLoad(PluginContext& ctx) override {
    pruned_at_start_ = ctx.iteration() > 0;
    return absl::OkStatus();
  }

  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) override {
    // The whole model's sparsity and each layer's kept fraction (density), counted over
    // every stage and shard (collective): [pruned, size] then [kept, size] per layer.
    const int64_t layers = ctx.model().options().num_layers;
    std::vector<double> counts(2 + 2 * layers, 0.0);
    ForEachWeight(ctx, [&](TransformerLayer&, size_t index, const at::Tensor&, LayerPrune& state,
                           size_t i) {
      counts[0] += static_cast<double>(state.size[i] - state.kept[i]);
      counts[1] += static_cast<double>(state.size[i]);
      counts[2 + 2 * index] += static_cast<double>(state.kept[i]);
      counts[3 + 2 * index] += static_cast<double>(state.size[i]);
    });
    ctx.SumOverModel(counts);
    const double sparsity = counts[1] > 0 ? counts[0] / counts[1] : 0.0;
    (*record)["sparsity"] = sparsity;
    nlohmann::json density = nlohmann::json::object();
    for (int64_t l = 0; l < layers; ++l) {
      const double size = counts[3 + 2 * l];
      if (size > 0) density[absl::StrCat("layers.", l)] = counts[2 + 2 * l] / size;
    }
    (*record)["prune_layer_density"] = std::move(density);
    if (last_step_ == ctx.iteration()) {
      (*record)["prune_threshold"] = last_threshold_;
      (*record)["prune_target_sparsity"] = last_target_;
    }
    if (sparsity > 0) absl::StrAppend(log_line, absl::StrFormat(" | sparsity %.3f", sparsity));
    return absl::OkStatus();
  }

 private:
  // Calls fn(layer, layer index, weight, state, slot) for every prunable weight this rank
  // holds, in the canonical order (layer, slot).
  template <typename Fn>
  static void ForEachWeight(PluginContext& ctx, Fn fn) {
    for (const auto& [index, layer] : ctx.model().layers()) {
      LayerPrune* state = StateOf(*layer);
      if (state == nullptr) continue;
      for (size_t i = 0; i < kSlots.size(); ++i) {
        if (state->present[i]) fn(*layer, static_cast<size_t>(index), layer->weight(kSlots[i]), *state, i);
      }
    }
  }

  // Rebuilds a layer's masks (from `masks` when given, else from its weights) and sparse
  // structures.
  static void Derive(TransformerLayer& layer, bool sparse_compute,
                     const std::array<at::Tensor, 4>* masks) {
    LayerPrune* state = StateOf(layer);
    if (state == nullptr) return;
    for (size_t i = 0; i < kSlots.size(); ++i) {
      state->mask[i] = at::Tensor();
      state->sparse[i] = nullptr;
      if (!state->present[i]) continue;
      const at::Tensor& w = layer.weight(kSlots[i]);
      state->kept[i] = state->size[i] = w.numel();
      at::Tensor mask = masks != nullptr ? (*masks)[i] : w.ne(0);
      if (!mask.defined()) continue;
      const int64_t kept = mask.sum().item<int64_t>();
      state->kept[i] = kept;
      if (kept == mask.numel()) continue;  // nothing pruned: the dense path as it was
      state->mask[i] = mask;
      const double density = static_cast<double>(kept) / static_cast<double>(mask.numel());
      // The sparse kernels (core/sparse_linear.h) are CPU code: on a GPU a pruned weight
      // takes the dense product of the masked weight.
      if (sparse_compute && w.is_cpu() && SparseIsFaster(w.size(0), w.size(1), density)) {
        state->sparse[i] = std::make_shared<SparseWeight>(w, mask);
      }
    }
  }

  // One pruning step to the schedule's target (NOTE [global threshold]).
  absl::Status Prune(PluginContext& ctx, int64_t t) {
    const double target = TargetSparsity(options_, t);
    std::vector<double> total{0};
    bool is_double = false;
    ForEachWeight(ctx, [&](TransformerLayer&, size_t, const at::Tensor& w, LayerPrune&, size_t) {
      total[0] += static_cast<double>(w.numel());
      is_double = w.scalar_type() == at::kDouble;
    });
    ctx.SumOverModel(total);
    const int64_t k = std::llround(target * total[0]);
    if (k == 0) {
      if (ctx.is_logging_rank()) {
        FULCRUM_LOG(INFO) << "prune: iteration " << t << ": target sparsity 0, nothing pruned";
      }
      return absl::OkStatus();
    }
    // The k-th smallest key, 16 bits at a time from the top.
    const int key_bits = is_double ? 64 : 32;
    uint64_t prefix = 0;
    int64_t rank = k;  // 1-based rank of the threshold among the keys with the prefix so far
    for (int shift = key_bits - kHistogramBits; shift >= 0; shift -= kHistogramBits) {
      std::vector<double> histogram(kBins, 0.0);
      const int high = shift + kHistogramBits;
      ForEachWeight(ctx, [&](TransformerLayer&, size_t, const at::Tensor& w, LayerPrune&, size_t) {
        const Keys keys(w);
        for (int64_t e = 0; e < keys.size(); ++e) {
          const uint64_t key = keys[e];
          if (high < 64 && (key >> high) != prefix) continue;
          histogram[(key >> shift) & (kBins - 1)] += 1;
        }
      });
      ctx.SumOverModel(histogram);
      int64_t bin = 0;
      for (; bin < kBins; ++bin) {
        const int64_t here = static_cast<int64_t>(histogram[bin]);
        if (rank <= here) break;
        rank -= here;
      }
      if (bin == kBins) return absl::InternalError("pruning threshold search lost its rank");
      prefix = (prefix << kHistogramBits) | static_cast<uint64_t>(bin);
    }
    const uint64_t threshold = prefix;
    // `rank` weights equal to the threshold are pruned, in the canonical order.
    std::vector<double> ties(ctx.model_parallel_size(), 0.0);
    ForEachWeight(ctx, [&](TransformerLayer&, size_t, const at::Tensor& w, LayerPrune&, size_t) {
      const Keys keys(w);
      for (int64_t e = 0; e < keys.size(); ++e) ties[ctx.model_parallel_rank()] += keys[e] == threshold;
    });
    ctx.SumOverModel(ties);
    double before = 0;
    for (int r = 0; r < ctx.model_parallel_rank(); ++r) before += ties[r];
    int64_t allowance = std::max<int64_t>(0, std::min<int64_t>(rank - static_cast<int64_t>(before),
                                                                static_cast<int64_t>(ties[ctx.model_parallel_rank()])));
    // Masks, weights and moments (this rank's parts of them: whole, or the distributed
    // optimizer's slices; every slot of the state is per element of the weight).
    at::NoGradGuard no_grad;
    FULCRUM_ASSIGN_OR_RETURN(std::vector<MomentSlice> state_parts, ctx.OptimizerStateParts());
    std::multimap<const Parameter*, const MomentSlice*> parts_of;
    for (const MomentSlice& part : state_parts) parts_of.emplace(part.param, &part);
    for (const auto& [index, layer] : ctx.model().layers()) {
      LayerPrune* state = StateOf(*layer);
      if (state == nullptr) continue;
      std::array<at::Tensor, 4> masks;
      for (size_t i = 0; i < kSlots.size(); ++i) {
        if (!state->present[i]) continue;
        const at::Tensor& w = layer->weight(kSlots[i]);
        const Keys keys(w);
        at::Tensor mask = at::empty(w.sizes(), at::kBool);
        bool* m = mask.data_ptr<bool>();
        for (int64_t e = 0; e < keys.size(); ++e) {
          const uint64_t key = keys[e];
          bool keep = key > threshold;
          if (key == threshold) {  // a tie: pruned while this rank's allowance lasts
            keep = allowance <= 0;
            if (!keep) --allowance;
          }
          m[e] = keep;
        }
        mask = mask.to(w.device());
        const at::Tensor keep = mask.to(w.scalar_type());
        w.mul_(keep);
        if (const Parameter* p = layer->FindParameter(LinearSlotName(kSlots[i]))) {
          const at::Tensor flat_keep = keep.reshape({-1});
          const auto [first, last] = parts_of.equal_range(p);
          for (auto it = first; it != last; ++it) {
            const MomentSlice& part = *it->second;
            for (const auto& [slot, state] : part.state) {
              state.mul_(flat_keep.narrow(0, part.begin, part.end - part.begin));
            }
          }
        }
        masks[i] = mask;
      }
      Derive(*layer, options_.sparse_compute, &masks);
    }
    last_step_ = ctx.iteration();
    last_threshold_ = KeyValue(threshold, is_double);
    last_target_ = target;
    if (ctx.is_logging_rank()) {
      FULCRUM_LOG(INFO) << absl::StrFormat(
          "prune: iteration %d: %d of %d weights pruned (target sparsity %.4f), threshold %.6g",
          t, k, static_cast<int64_t>(total[0]), target, last_threshold_);
    }
    ctx.ModelChanged(absl::StrFormat("pruned to sparsity %.3f", target));
    return absl::OkStatus();
  }

  PruneOptions options_;
  bool pruned_at_start_ = false;
  int64_t last_step_ = -1;
  double last_threshold_ = 0;
  double last_target_ = 0;
};

absl::Status Validate(const PluginSetup&) { return OptionsFromFlags().status(); }

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup&) {
  FULCRUM_ASSIGN_OR_RETURN(PruneOptions options, OptionsFromFlags());
  return std::unique_ptr<Plugin>(new PrunePlugin(options));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(prune,
                        "gradual global magnitude pruning (Zhu & Gupta; DynMo §5.1) of the "
                        "attention and MLP weights, with sparse compute: pruned layers get cheaper",
                        (PluginEntry{nullptr, Validate, Create,
                                    /*uses_expert_parallel_group=*/false, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
