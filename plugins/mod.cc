// The `mod` plugin: Mixture-of-Depths (Raposo et al. 2024, "Mixture-of-Depths: Dynamically
// allocating compute in transformer-based language models"), the dynamism DynMo's MoD case
// uses. In every --mod_layer_freq-th layer a router picks, per sequence, the top
// --mod_capacity fraction of the tokens (expert choice); only they run the layer's
// attention and MLP, their block output scaled by the router's gate; the others pass
// through on the residual stream. The layer really computes only the routed tokens (they
// are gathered, run, and scattered back), so its measured time falls with the capacity.
//
// NOTE [MoD routing]
// Layer l is routed iff (l + 1) % --mod_layer_freq == 0 (freq 2: every other layer, the
// first one dense, as Raposo et al.'s best configuration), or iff --mod_layers lists it. Router: a weight vector w of the
// layer ("mod.router.weight", [h]); each token's logit r = x·w. Training: the k =
// max(1, round(capacity × s)) tokens of each sequence with the largest r, kept in their
// order, attend causally among themselves and go through the MLP; the layer outputs
// x + σ(r) ⊙ f(x) for them and x for the others (f = TransformerLayer::Residual). σ, not
// the raw logit of the paper: the gate starts near 1/2 rather than near 0, so the routed
// blocks contribute from the first step (the gradient still reaches w through it).
//
// NOTE [MoD causal sampling]
// Top-k over a sequence looks at future tokens, which generation cannot. As Raposo et al.
// propose, a causal decision is trained beside the router and used outside training
// (evaluation), --mod_causal choosing which:
//   predictor  a small MLP (h → h/8 → 1, "mod.predictor.*") on the detached hidden states,
//              trained by binary cross-entropy to predict whether a token is in the top k;
//              it does not change the router's or the layer's gradients (the default);
//   aux_loss   the same binary cross-entropy on the router's own logits, so r > 0 itself
//              becomes the causal decision (this loss does reach the router).
// The loss, times --mod_aux_loss_coeff, joins the training loss inside the backward pass
// (NOTE [auxiliary losses] in core/aux_loss.h). In evaluation each token with a positive
// decision logit is computed, so the number per sequence varies: sequences run one by one.
//
// Layout: the router and predictor are replicated over tensor parallelism (identical
// inputs give identical choices on every shard); routing is per sequence, so data and
// pipeline parallelism see the same choices as one process. With rotary positions the routed
// tokens are rotated to their places in the sequence (ForwardContext::rotary_positions), not
// to 0..k−1. The parameters are
// the layer's own: they migrate with it and are saved in checkpoints.
#include <gflags/gflags.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/aux_loss.h"
#include "core/gpt_model.h"
#include "core/random.h"
#include "core/status.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_int64(mod_layer_freq, 2,
             "mod: route every this-many-th layer (layer l when (l + 1) % freq == 0; 2: every "
             "other layer, the first dense).");
DEFINE_string(mod_layers, "",
              "mod: the routed layers, e.g. 4-7 or 1,3 (instead of --mod_layer_freq).");
DEFINE_double(mod_capacity, 0.125,
              "mod: fraction of each sequence's tokens a routed layer computes (Raposo et al.: "
              "0.125), in (0, 1].");
DEFINE_string(mod_causal, "predictor",
              "mod: the causal decision used outside training: predictor (a small MLP on the "
              "detached hidden states) or aux_loss (the router's own logits, trained to predict "
              "top-k membership).");
DEFINE_double(mod_aux_loss_coeff, 0.01,
              "mod: weight of the causal decision's binary cross-entropy in the training loss.");

namespace fulcrum::plugins {
namespace {

constexpr char kAttachment[] = "mod";

struct ModOptions {
  int64_t layer_freq = 2;
  std::set<int64_t> layers;  // --mod_layers; empty: by layer_freq
  double capacity = 0.125;
  bool predictor = true;  // else aux_loss
  double aux_loss_coeff = 0.01;
};

absl::StatusOr<ModOptions> OptionsFromFlags(const ModelOptions& model) {
  ModOptions o;
  o.layer_freq = FLAGS_mod_layer_freq;
  o.capacity = FLAGS_mod_capacity;
  o.predictor = FLAGS_mod_causal == "predictor";
  o.aux_loss_coeff = FLAGS_mod_aux_loss_coeff;
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  if (o.layer_freq < 1) return bad(absl::StrCat("--mod_layer_freq=", o.layer_freq, " must be ≥ 1"));
  if (o.layer_freq > model.num_layers) {
    return bad(absl::StrCat("--mod_layer_freq=", o.layer_freq, " routes no layer of ",
                            model.num_layers));
  }
  if (!(o.capacity > 0 && o.capacity <= 1)) {
    return bad(absl::StrCat("--mod_capacity=", o.capacity, " must be in (0, 1]"));
  }
  if (FLAGS_mod_causal != "predictor" && FLAGS_mod_causal != "aux_loss") {
    return bad(absl::StrCat("--mod_causal='", FLAGS_mod_causal, "' must be predictor or aux_loss"));
  }
  if (!(o.aux_loss_coeff >= 0)) {
    return bad(absl::StrCat("--mod_aux_loss_coeff=", o.aux_loss_coeff, " must be ≥ 0"));
  }
  std::string bad_item;
  std::optional<std::vector<int64_t>> layers = ParseLayerList(FLAGS_mod_layers, model.num_layers, &bad_item);
  if (!layers) {
    return bad(absl::StrCat("--mod_layers: '", bad_item, "' is not a layer or range of layers in [0, ",
                            model.num_layers, ")"));
  }
  o.layers.insert(layers->begin(), layers->end());
  return o;
}

// A routed layer's parameters (handles into the layer) and what it computed last.
struct RoutedLayer {
  at::Tensor router;                      // [h]
  at::Tensor fc1_w, fc1_b, fc2_w, fc2_b;  // the predictor (undefined with aux_loss)
  int64_t computed = 0;                   // tokens computed in the last forward
  int64_t total = 0;                      // tokens seen in the last forward
};

class ModPlugin final : public Plugin {
 public:
  ModPlugin(ModOptions options, const ModelOptions& model)
      : options_(options), model_(model), num_layers_(model.num_layers) {}
  const char* name() const override { return "mod"; }
  // A recomputed layer routes the same tokens (a top-k of the same input through the same
  // router), sets the same counts, and only the recomputation's graph carries the router
  // loss (the first forward runs without autograd: WithAuxLoss adds nothing there).
  bool SupportsRecompute() const override { return true; }

  static bool Routed(const ModOptions& o, int64_t layer) {
    return o.layers.empty() ? (layer + 1) % o.layer_freq == 0 : o.layers.count(layer) > 0;
  }

  void EditLayer(TransformerLayer& layer, bool initialize) override {
    if (!Routed(options_, layer.layer_index())) return;
    const ModelOptions& model = model_;
    const int64_t h = model.hidden_size;
    auto add = [&](const std::string& name, at::IntArrayRef shape, double std, bool decay) {
      const at::ScalarType master = model.device_spec.master_dtype;
      at::Tensor init = !initialize    ? at::empty(shape, master)
                        : std > 0      ? NormalInit(model.seed, layer.GlobalName(name), shape, std)
                                       : at::zeros(shape, master);
      return at::Tensor(layer.AddParameter(name, init, decay));  // a handle (plugins/README.md)
    };
    auto state = std::make_shared<RoutedLayer>();
    state->router = add("mod.router.weight", {h}, model.init_method_std, true);
    if (options_.predictor) {
      const int64_t width = std::max<int64_t>(1, h / 8);
      state->fc1_w = add("mod.predictor.fc1.weight", {width, h}, model.init_method_std, true);
      state->fc1_b = add("mod.predictor.fc1.bias", {width}, 0.0, false);
      state->fc2_w = add("mod.predictor.fc2.weight", {1, width}, model.init_method_std, true);
      state->fc2_b = add("mod.predictor.fc2.bias", {1}, 0.0, false);
    }
    if (layer.forward_wrapper()) {
      throw std::logic_error(absl::StrCat(
          "--plugins: mod cannot route layer ", layer.layer_index(),
          ", which a plugin before it already wraps (e.g. early_exit): list mod first"));
    }
    layer.Attach(kAttachment, state);
    RoutedLayer* raw = state.get();  // the layer owns both the state and these closures
    const ModOptions options = options_;
    layer.SetForwardWrapper([raw, options](const TransformerLayer& self, const at::Tensor& hidden,
                                           const ForwardContext& ctx) {
      return ctx.training ? RouteTopK(options, *raw, self, hidden, ctx)
                          : RouteCausal(options, *raw, self, hidden, ctx);
    });
    layer.AddLoadFraction(TransformerLayer::LoadFraction::kTokens, [raw] {
      return raw->total > 0 ? static_cast<double>(raw->computed) / raw->total : 1.0;
    });
  }

  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) override {
    // Every routed layer's computed fraction in the last forward, over all stages.
    std::vector<double> computed(num_layers_, 0.0), total(num_layers_, 0.0);
    for (const auto& [index, layer] : ctx.model().layers()) {
      const RoutedLayer* state = layer->Attached<RoutedLayer>(kAttachment);
      if (state == nullptr || layer->tp_rank() != 0) continue;
      computed[index] = static_cast<double>(state->computed);
      total[index] = static_cast<double>(state->total);
    }
    ctx.SumOverModel(computed);
    ctx.SumOverModel(total);
    nlohmann::json tokens = nlohmann::json::object();
    double all_computed = 0, all_total = 0;
    for (int64_t l = 0; l < num_layers_; ++l) {
      if (!Routed(options_, l)) continue;
      tokens[absl::StrCat("layers.", l)] = {static_cast<int64_t>(computed[l]), static_cast<int64_t>(total[l])};
      all_computed += computed[l];
      all_total += total[l];
    }
    (*record)["mod_tokens"] = tokens;  // per routed layer: [computed, seen] in the last forward
    if (all_total > 0) {
      absl::StrAppend(log_line, absl::StrFormat(" | mod tokens %.3f", all_computed / all_total));
    }
    return absl::OkStatus();
  }

  std::vector<std::pair<std::string, std::string>> CheckpointShape() const override {
    return {{"mod_layer_freq", absl::StrCat(options_.layer_freq)},
            {"mod_layers", absl::StrJoin(options_.layers, ",")},
            {"mod_causal", options_.predictor ? "predictor" : "aux_loss"}};
  }

 private:
  // NOTE [MoD mixed precision]
  // Under --bf16 the router and the predictor compute in their fp32 weights' dtype from
  // widened tokens, as the MoE router does (NOTE [MoE mixed precision] in moe/moe_layer.cc):
  // which tokens a layer computes is a top-k over logits, and bf16 logits (8 bits of
  // mantissa) tie and swap neighbours that fp32 keeps apart. The gate multiplies the layer's
  // bf16 update in the tokens' dtype, so the residual stream stays bf16. With fp32 or fp64
  // activations every cast is a no-op.
  static at::Tensor RouterLogits(const RoutedLayer& state, const at::Tensor& hidden) {
    return at::matmul(hidden.to(state.router.scalar_type()), state.router);  // [s, b]
  }

  // The predictor's logit per token (NOTE [MoD causal sampling]); input detached.
  static at::Tensor PredictorLogits(const RoutedLayer& state, const at::Tensor& hidden) {
    at::Tensor hid =
        at::gelu(at::linear(hidden.detach().to(state.fc1_w.scalar_type()), state.fc1_w, state.fc1_b));
    return at::linear(hid, state.fc2_w, state.fc2_b).squeeze(-1);
  }

  // Training: the top k of each sequence (NOTE [MoD routing]).
  static at::Tensor RouteTopK(const ModOptions& o, RoutedLayer& state, const TransformerLayer& layer,
                              const at::Tensor& hidden, const ForwardContext& ctx) {
    const int64_t s = hidden.size(0), b = hidden.size(1), h = hidden.size(2);
    const at::Tensor logits = RouterLogits(state, hidden);  // [s, b], fp32 under --bf16
    const int64_t k = std::clamp<int64_t>(std::llround(o.capacity * static_cast<double>(s)), 1, s);
    // The chosen positions of each sequence, in sequence order (causal among themselves).
    const at::Tensor index = std::get<0>(std::get<1>(logits.detach().topk(k, /*dim=*/0)).sort(0));
    const at::Tensor index3 = index.unsqueeze(-1).expand({k, b, h});
    ForwardContext sub = ctx;
    if (ctx.token_positions.defined()) sub.token_positions = ctx.token_positions.gather(0, index);
    // Rotary positions: the routed tokens keep their places in the sequence.
    sub.rotary_positions = ctx.rotary_positions.defined() ? ctx.rotary_positions.gather(0, index) : index;
    const at::Tensor gate =  // [k, b, 1], in the tokens' dtype
        at::sigmoid(logits.gather(0, index)).unsqueeze(-1).to(hidden.scalar_type());
    const at::Tensor update = layer.Residual(hidden.gather(0, index3), sub) * gate;
    at::Tensor out = hidden.scatter_add(0, index3, update);
    state.computed = k * b;
    state.total = s * b;
    if (o.aux_loss_coeff > 0 && ctx.loss_scale > 0) {
      const at::Tensor chosen = at::zeros({s, b}, logits.options()).scatter(0, index, 1.0);
      const at::Tensor decision = o.predictor ? PredictorLogits(state, hidden) : logits;
      const at::Tensor loss =
          o.aux_loss_coeff * at::binary_cross_entropy_with_logits(decision, chosen);
      out = WithAuxLoss(out, loss, ctx.loss_scale * static_cast<double>(s * b));
    }
    return out;
  }

  // Outside training: the causal decision, token by token; sequences one by one.
  static at::Tensor RouteCausal(const ModOptions& o, RoutedLayer& state, const TransformerLayer& layer,
                                const at::Tensor& hidden, const ForwardContext& ctx) {
    const int64_t s = hidden.size(0), b = hidden.size(1);
    const at::Tensor logits = RouterLogits(state, hidden);  // [s, b]
    const at::Tensor decision = o.predictor ? PredictorLogits(state, hidden) : logits;
    std::vector<at::Tensor> columns;
    state.computed = 0;
    state.total = s * b;
    for (int64_t j = 0; j < b; ++j) {
      const at::Tensor x = hidden.select(1, j);  // [s, h]
      const at::Tensor index = decision.select(1, j).gt(0).nonzero().squeeze(-1);
      const int64_t k = index.size(0);
      if (k == 0) {
        columns.push_back(x);
        continue;
      }
      ForwardContext sub = ctx;
      sub.token_positions = at::Tensor();
      sub.rotary_positions = (ctx.rotary_positions.defined() ? ctx.rotary_positions.select(1, j).index_select(0, index)
                                                             : index).unsqueeze(1);
      const at::Tensor gate = at::sigmoid(logits.select(1, j).index_select(0, index))
                                  .unsqueeze(-1)
                                  .to(hidden.scalar_type());
      const at::Tensor update =
          layer.Residual(x.index_select(0, index).unsqueeze(1), sub).squeeze(1) * gate;
      columns.push_back(x.index_add(0, index, update));
      state.computed += k;
    }
    return at::stack(columns, 1);
  }

  ModOptions options_;
  ModelOptions model_;
  int64_t num_layers_;
};

absl::Status Validate(const PluginSetup& setup) { return OptionsFromFlags(setup.model).status(); }

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup& setup) {
  FULCRUM_ASSIGN_OR_RETURN(ModOptions options, OptionsFromFlags(setup.model));
  return std::unique_ptr<Plugin>(new ModPlugin(options, setup.model));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(mod,
                        "Mixture-of-Depths (Raposo et al. 2024): routed layers compute only the "
                        "top --mod_capacity of each sequence's tokens, the rest skip them",
                        (PluginEntry{nullptr, Validate, Create,
                                    /*uses_expert_parallel_group=*/false, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
