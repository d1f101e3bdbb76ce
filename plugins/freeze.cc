// The `freeze` plugin: layer freezing in the spirit of AutoFreeze (Liu et al. 2021) and
// Egeria (Wang et al. 2023), as DynMo §4.2.3 uses it: layers whose gradients have stopped
// changing stop training, front to back, and cost less from then on — no weight-gradient
// work, no gradient, no data-parallel reduction, no optimizer update, and the frozen
// prefix of the model runs no backward at all (NOTE [frozen prefix] in core/gpt_model.h).
//
// NOTE [freeze decisions]
// Every --freeze_interval iterations the plugin compares each trainable layer's mean
// gradient norm over the interval with the previous interval's: the change rate
// |m_k − m_{k−1}| / m_{k−1}. From the first layer not yet frozen upwards, layers whose rate
// is below --freeze_threshold freeze, stopping at the first that is not (a layer freezes
// only after every layer before it), and never beyond --freeze_max_fraction of the layers.
// Gradient norms are taken after the data-parallel reduction (PluginContext::
// LayerGradientSquares: this rank's parts of the reduced gradients, whole or the distributed
// optimizer's slices, over their holders) and summed as the global norm is — the experts'
// over the expert-parallel ranks, then over the model-parallel ranks (tensor-parallel
// shards; replicated tensors once) — so every rank of the job sees every layer's norm and
// decides the same. --freeze_schedule=ITER:LAYERS[;...] freezes
// given layers after given iterations instead (deterministic runs, tests).
//
// A layer is frozen after the optimizer step of the iteration that decided it. Its state is
// a one-element buffer of the layer ("freeze.frozen"), so it travels with the layer when it
// migrates and is saved in checkpoints; whenever the layer's state is loaded, its
// parameters stop requiring gradients again. When layer 0 is frozen the embedding lookup
// freezes with it (position embeddings, and untied word embeddings; tied word embeddings
// still learn as the output weight), so the frozen layers form a prefix no gradient enters.
// Each decision tells the balancer the model changed: frozen layers got cheaper.
#include <gflags/gflags.h>

#include <cmath>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/gpt_model.h"
#include "core/logging.h"
#include "core/status.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_int64(freeze_interval, 50,
             "freeze: compare the layers' gradient-norm change every this many iterations "
             "(DynMo: 50).");
DEFINE_double(freeze_threshold, 0.05,
              "freeze: a layer freezes when its mean gradient norm changed by less than this "
              "fraction since the last comparison (and every layer before it is frozen).");
DEFINE_double(freeze_max_fraction, 0.5, "freeze: at most this fraction of the layers freezes.");
DEFINE_string(freeze_schedule, "",
              "freeze: instead of the gradient rule, freeze given layers after given iterations: "
              "ITER:LAYERS[;ITER:LAYERS...], LAYERS like 0,1 or 0-3, e.g. '20:0-1;40:2'.");

namespace fulcrum::plugins {
namespace {

constexpr char kFrozenBuffer[] = "freeze.frozen";

struct FreezeOptions {
  int64_t interval = 50;
  double threshold = 0.05;
  double max_fraction = 0.5;
  std::map<int64_t, std::vector<int64_t>> schedule;  // Empty: the gradient rule.
};

absl::StatusOr<FreezeOptions> OptionsFromFlags(const ModelOptions& model) {
  FreezeOptions o;
  o.interval = FLAGS_freeze_interval;
  o.threshold = FLAGS_freeze_threshold;
  o.max_fraction = FLAGS_freeze_max_fraction;
  if (o.interval < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--freeze_interval=", o.interval, " must be ≥ 1"));
  }
  if (!(o.threshold >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--freeze_threshold=", o.threshold, " must be ≥ 0"));
  }
  if (!(o.max_fraction >= 0 && o.max_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--freeze_max_fraction=", o.max_fraction, " must be in [0, 1]"));
  }
  auto bad = [](absl::string_view part, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--freeze_schedule: '", part, "' ", why,
                                                   " (expected ITER:LAYERS;..., e.g. 20:0-1;40:2)"));
  };
  for (absl::string_view step : absl::StrSplit(FLAGS_freeze_schedule, ';', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(step, absl::MaxSplits(':', 1));
    int64_t iteration = 0;
    if (!absl::SimpleAtoi(parts.first, &iteration) || iteration < 1) {
      return bad(step, "has no iteration ≥ 1");
    }
    std::string bad_item;
    std::optional<std::vector<int64_t>> layers = ParseLayerList(parts.second, model.num_layers, &bad_item);
    if (!layers) {
      return bad(bad_item, absl::StrCat("is not a layer or range of layers in [0, ",
                                        model.num_layers, ")"));
    }
    std::vector<int64_t>& scheduled = o.schedule[iteration];
    scheduled.insert(scheduled.end(), layers->begin(), layers->end());
  }
  return o;
}

// Makes `layer` frozen (or keeps it trainable) as its buffer says.
void ApplyFrozenFlag(Unit& unit) {
  const at::Tensor flag = unit.FindBuffer(kFrozenBuffer);
  if (!flag.defined() || !flag.item<bool>()) return;
  for (Parameter& p : unit.parameters()) {
    p.value.mutable_grad() = at::Tensor();
    p.value.set_requires_grad(false);
  }
}

class FreezePlugin final : public Plugin {
 public:
  FreezePlugin(FreezeOptions options, int64_t num_layers)
      : options_(std::move(options)), num_layers_(num_layers) {}

  const char* name() const override { return "freeze"; }
  // No blocks of its own; a frozen layer's recomputation builds no weight gradients.
  bool SupportsRecompute() const override { return true; }
  // It reads no hidden states; a frozen prefix's shards build no graph as whole ones.
  bool SupportsSequenceParallel() const override { return true; }

  void EditLayer(TransformerLayer& layer, bool initialize) override {
    layer.AddBuffer(kFrozenBuffer, at::zeros({1}, at::kBool));
    layer.OnStateLoaded(ApplyFrozenFlag);
  }

  absl::Status AfterBackward(PluginContext& ctx) override {
    if (!options_.schedule.empty() || AtMaximum()) return absl::OkStatus();
    // Every layer's gradient norm this iteration (NOTE [freeze decisions]).
    const std::vector<double> squares = ctx.LayerGradientSquares();
    if (norm_sums_.empty()) norm_sums_.assign(num_layers_, 0.0);
    last_norms_.assign(num_layers_, 0.0);
    for (int64_t l = 0; l < num_layers_; ++l) {
      last_norms_[l] = std::sqrt(squares[l]);
      norm_sums_[l] += last_norms_[l];
    }
    ++iterations_summed_;
    return absl::OkStatus();
  }

  absl::Status AfterOptimizerStep(PluginContext& ctx) override {
    std::vector<int64_t> to_freeze;
    if (!options_.schedule.empty()) {
      auto it = options_.schedule.find(ctx.iteration());
      if (it != options_.schedule.end()) {
        for (int64_t l : it->second) {
          if (frozen_.count(l) == 0) to_freeze.push_back(l);
        }
      }
    } else if (ctx.iteration() % options_.interval == 0 && iterations_summed_ > 0) {
      to_freeze = DecideByGradients();
      if (to_freeze.empty() && ctx.is_logging_rank() && !last_rates_.empty()) {
        // Every comparison is visible, so a user sees how far the layers are from freezing.
        FULCRUM_LOG(INFO) << "freeze: iteration " << ctx.iteration() << ": no layer freezes "
                          << last_rates_ << ", threshold " << options_.threshold;
      }
    }
    if (to_freeze.empty()) return absl::OkStatus();
    Freeze(ctx, to_freeze);
    if (ctx.is_logging_rank()) {
      FULCRUM_LOG(INFO) << "freeze: iteration " << ctx.iteration() << ": froze layers "
                        << absl::StrJoin(to_freeze, ",") << " (" << frozen_.size() << " of "
                        << num_layers_ << " frozen; frozen prefix " << ctx.model().frozen_prefix()
                        << ")" << (last_rates_.empty() ? "" : absl::StrCat(" ", last_rates_));
    }
    ctx.ModelChanged(absl::StrCat("froze layers ", absl::StrJoin(to_freeze, ",")));
    return absl::OkStatus();
  }

  absl::Status AfterLoad(PluginContext& ctx) override {
    // Every stage knows the flags of its own layers; every rank needs all of them.
    std::vector<double> flags(num_layers_, 0.0);
    for (const auto& [index, layer] : ctx.model().layers()) {
      if (layer->tp_rank() == 0 && layer->FindBuffer(kFrozenBuffer).item<bool>()) flags[index] = 1.0;
    }
    ctx.SumOverModel(flags);
    frozen_.clear();
    for (int64_t l = 0; l < num_layers_; ++l) {
      if (flags[l] > 0) frozen_.insert(l);
    }
    ApplyPrefix(ctx.model());
    return absl::OkStatus();
  }

  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) override {
    (*record)["frozen_layers"] = static_cast<int64_t>(frozen_.size());
    // This iteration's gradient norm of each layer, when the gradient rule measured it.
    if (!last_norms_.empty()) (*record)["layer_grad_norms"] = last_norms_;
    last_norms_.clear();
    (*record)["frozen_prefix"] = ctx.model().frozen_prefix();
    if (!frozen_.empty()) absl::StrAppend(log_line, " | frozen ", frozen_.size());
    return absl::OkStatus();
  }

 private:
  bool AtMaximum() const {
    return static_cast<double>(frozen_.size()) >=
           std::floor(options_.max_fraction * static_cast<double>(num_layers_));
  }

  // NOTE [freeze decisions]: front to back, while the change rate is below the threshold.
  std::vector<int64_t> DecideByGradients() {
    std::vector<double> means(num_layers_);
    for (int64_t l = 0; l < num_layers_; ++l) means[l] = norm_sums_[l] / iterations_summed_;
    std::vector<int64_t> decided;
    last_rates_.clear();
    if (!previous_means_.empty()) {
      const int64_t limit =
          static_cast<int64_t>(std::floor(options_.max_fraction * static_cast<double>(num_layers_)));
      std::vector<std::string> rates;
      bool front = true;  // every layer before this one is frozen or freezes now
      for (int64_t l = 0; l < num_layers_; ++l) {
        if (frozen_.count(l) > 0) continue;
        const double rate = previous_means_[l] > 0
                                ? std::abs(means[l] - previous_means_[l]) / previous_means_[l]
                                : std::numeric_limits<double>::infinity();
        rates.push_back(absl::StrFormat("%d:%.3f", l, rate));
        // Only layers whose predecessors are all frozen (or freeze now) qualify.
        front = front && static_cast<int64_t>(frozen_.size() + decided.size()) == l &&
                static_cast<int64_t>(frozen_.size() + decided.size()) < limit &&
                rate < options_.threshold;
        if (front) decided.push_back(l);
      }
      last_rates_ = absl::StrCat("(gradient-norm change: ", absl::StrJoin(rates, " "), ")");
    }
    previous_means_ = means;
    std::fill(norm_sums_.begin(), norm_sums_.end(), 0.0);
    iterations_summed_ = 0;
    return decided;
  }

  void Freeze(PluginContext& ctx, const std::vector<int64_t>& layers) {
    for (int64_t l : layers) {
      frozen_.insert(l);
      auto it = ctx.model().layers().find(l);
      if (it == ctx.model().layers().end()) continue;  // another stage holds it
      TransformerLayer& layer = *it->second;
      layer.FindBuffer(kFrozenBuffer).fill_(true);
      ApplyFrozenFlag(layer);
    }
    ApplyPrefix(ctx.model());
  }

  // NOTE [frozen prefix]: the longest run of frozen layers from layer 0; the embedding
  // lookup freezes with it.
  void ApplyPrefix(GptModel& model) {
    int64_t prefix = 0;
    while (frozen_.count(prefix) > 0) ++prefix;
    model.set_frozen_prefix(prefix);
    if (prefix == 0 || model.embedding() == nullptr) return;
    for (Parameter& p : model.embedding()->parameters()) {
      const bool tied_word_embeddings = model.options().tie_embeddings && p.name == "word_embeddings.weight";
      if (tied_word_embeddings) continue;  // still the output weight
      p.value.mutable_grad() = at::Tensor();
      p.value.set_requires_grad(false);
    }
  }

  FreezeOptions options_;
  int64_t num_layers_;
  std::set<int64_t> frozen_;           // Every frozen layer of the model (all stages).
  std::vector<double> norm_sums_;      // Per layer: Σ gradient norms this interval.
  std::vector<double> last_norms_;     // Per layer: this iteration's norm (for Metrics).
  int64_t iterations_summed_ = 0;
  std::vector<double> previous_means_; // Per layer: the last interval's mean norm.
  std::string last_rates_;             // For the log.
};

absl::Status Validate(const PluginSetup& setup) { return OptionsFromFlags(setup.model).status(); }

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup& setup) {
  FULCRUM_ASSIGN_OR_RETURN(FreezeOptions options, OptionsFromFlags(setup.model));
  return std::unique_ptr<Plugin>(new FreezePlugin(std::move(options), setup.model.num_layers));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(freeze,
                        "layer freezing (AutoFreeze/Egeria, DynMo §4.2.3): layers whose gradient "
                        "norm stopped changing stop training, front to back, and cost less",
                        (PluginEntry{nullptr, Validate, Create,
                                    /*uses_expert_parallel_group=*/false, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
