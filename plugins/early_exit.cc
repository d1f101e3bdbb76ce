// The `early_exit` plugin: confident tokens leave the network early (CALM, Schuster et al.
// 2022, "Confident Adaptive Language Modeling"; applied in training as DynMo's early-exit
// case, after ADP-C). Exit heads sit after the --early_exit_layers; each is the model's own
// final norm and output layer (tied or not), so it adds no vocabulary weights. Training
// adds each exit's cross-entropy to the loss, weighted by --early_exit_loss_weights; a
// token whose confidence at an exit reaches --early_exit_threshold is not computed by the
// later layers: its hidden state is propagated unchanged to the head, and the later
// layers run their queries, attention output and MLP on the still-active tokens only,
// their keys and values coming from every token's current state (the propagated ones for
// exited tokens, as CALM does). A layer's load is the fraction of tokens it computed.
//
// NOTE [early exit state]
// Which tokens have exited travels with the hidden states as the carried token state
// (NOTE [carried token state] in core/transformer_layer.h): the exit layer's index, or −1
// while active; under pipeline parallelism it crosses stages beside the activation, so a
// stage knows the exits decided on earlier stages. Every layer is wrapped: while no token
// has exited it is the plain layer, bit for bit; afterwards it computes the active tokens
// (TransformerLayer::ResidualAt, gathered per sequence and padded to the longest) and adds
// their update, leaving exited tokens as they were.
//
// NOTE [early exit heads]
// The exit heads need the final norm and the output weight on whichever stage holds an
// exit layer, and layers move between stages. So every rank keeps a copy of the head
// (a Head with its own output weight, this rank's vocabulary shard): after each optimizer
// step (and a checkpoint load) the last stage's values are summed over the pipeline into
// the copies (the others contribute zeros), and after the backward pass the copies'
// gradients are summed over the pipeline and the data-parallel replicas and added to the
// real head's reduced gradient (this rank's parts of it: NOTE [reduced gradients], so the
// distributed optimizer's slices too) — and, for a tied output weight, to the word
// embeddings on the first stage, so the tied pair stay equal. Cost: one output weight more per rank, two all-reduces of
// it per iteration.
//
// Confidence (--early_exit_confidence): `softmax`, the exit's largest next-token
// probability (over the whole vocabulary under tensor parallelism); or `state`, CALM's
// hidden-state saturation, the cosine similarity of the exit layer's output to its input.
// Exit losses are computed over the tokens active at the exit (an exited token's loss
// was counted where it exited) as a mean over the micro-batch's tokens, and join the loss
// inside the backward pass (NOTE [auxiliary losses] in core/aux_loss.h).
#include <gflags/gflags.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/aux_loss.h"
#include "core/gpt_model.h"
#include "core/parallel_context.h"
#include "core/status.h"
#include "core/tensor_parallel.h"
#include "core/transformer_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_string(early_exit_layers, "",
              "early_exit: the layers followed by an exit head, e.g. 1,3 or 0-4 (default: every "
              "layer but the last, as CALM).");
DEFINE_string(early_exit_loss_weights, "",
              "early_exit: each exit's weight in the training loss, one per exit layer, comma-"
              "separated (default: (l + 1) / num_layers for the exit after layer l, so weights "
              "grow with depth as CALM's and the final layer keeps weight 1).");
DEFINE_double(early_exit_threshold, 0.9,
              "early_exit: a token exits where its confidence reaches this; above 1 no token "
              "exits (the exit losses still train the heads).");
DEFINE_string(early_exit_confidence, "softmax",
              "early_exit: softmax (the exit's largest next-token probability) or state (CALM's "
              "hidden-state saturation: cosine of the layer's output to its input).");

namespace fulcrum::plugins {
namespace {

constexpr char kAttachment[] = "early_exit";
// A token's carried state while it has not exited (NOTE [early exit state]).
constexpr double kActive = -1.0;

struct EarlyExitOptions {
  std::vector<int64_t> layers;   // ascending
  std::vector<double> weights;   // one per layer
  double threshold = 0.9;
  bool softmax = true;           // else state saturation
};

absl::StatusOr<EarlyExitOptions> OptionsFromFlags(const ModelOptions& model) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(what); };
  EarlyExitOptions o;
  const int64_t n = model.num_layers;
  if (n < 2) return bad(absl::StrCat("--plugins=early_exit needs ≥ 2 layers, the model has ", n));
  std::string bad_item;
  auto layers = ParseLayerList(FLAGS_early_exit_layers, n, &bad_item);
  if (!layers) {
    return bad(absl::StrCat("--early_exit_layers: '", bad_item,
                            "' is not a layer or range of layers in [0, ", n, ")"));
  }
  if (layers->empty()) {
    for (int64_t l = 0; l + 1 < n; ++l) layers->push_back(l);
  }
  std::sort(layers->begin(), layers->end());
  layers->erase(std::unique(layers->begin(), layers->end()), layers->end());
  if (layers->back() == n - 1) {
    return bad(absl::StrCat("--early_exit_layers: ", n - 1,
                            " is the last layer, whose exit is the model's own head"));
  }
  o.layers = *layers;
  if (FLAGS_early_exit_loss_weights.empty()) {
    for (int64_t l : o.layers) o.weights.push_back(static_cast<double>(l + 1) / n);
  } else {
    for (absl::string_view item : absl::StrSplit(FLAGS_early_exit_loss_weights, ',')) {
      double w = 0;
      if (!absl::SimpleAtod(item, &w) || !(w >= 0) || !std::isfinite(w)) {
        return bad(absl::StrCat("--early_exit_loss_weights: '", item,
                                "' is not a finite weight ≥ 0"));
      }
      o.weights.push_back(w);
    }
    if (o.weights.size() != o.layers.size()) {
      return bad(absl::StrCat("--early_exit_loss_weights has ", o.weights.size(),
                              " weights for ", o.layers.size(), " exit layers (",
                              absl::StrJoin(o.layers, ","), ")"));
    }
  }
  o.threshold = FLAGS_early_exit_threshold;
  if (!(o.threshold > 0) || !std::isfinite(o.threshold)) {
    return bad(absl::StrCat("--early_exit_threshold=", o.threshold, " must be a finite number > 0"));
  }
  if (FLAGS_early_exit_confidence != "softmax" && FLAGS_early_exit_confidence != "state") {
    return bad(absl::StrCat("--early_exit_confidence='", FLAGS_early_exit_confidence,
                            "' must be softmax or state"));
  }
  o.softmax = FLAGS_early_exit_confidence == "softmax";
  return o;
}

// What one layer computed, summed over the micro-batches since the last report.
struct LayerCounts {
  double computed = 0;  // tokens the layer computed
  double seen = 0;      // tokens that passed through it
  double exited = 0;    // tokens that exited at this layer's head
  double loss_sum = 0;  // Σ exit cross-entropy over the tokens active at the exit
  double loss_tokens = 0;
};

struct ExitLayer {
  int64_t index = 0;
  bool is_exit = false;
  double weight = 0;
  LayerCounts train, eval;  // by ForwardContext::training
  double last_fraction = 1;  // computed / seen of the previous iteration's training forwards
  // The wrapper an earlier plugin set on the layer, run where the whole layer runs.
  TransformerLayer::ForwardWrapper inner;
};

// The rank's copy of the head and what the layers' wrappers share (NOTE [early exit heads]).
struct Shared {
  EarlyExitOptions options;
  ModelOptions model;
  // The layout of the last OnLayout (null: one process) and its tensor-parallel group.
  ParallelContext* parallel = nullptr;
  TensorParallelGroup* tp = nullptr;
  std::unique_ptr<Head> head;  // the copy, sharded over `tp`; built on first use (HeadCopy)
  bool synced = false;
};

// The rank's copy of the head for the current layout, built when first needed: its own
// output weight whether or not the model ties it (NOTE [early exit heads]).
Head& HeadCopy(Shared& shared) {
  if (shared.head == nullptr) {
    shared.head = std::make_unique<Head>(shared.model, shared.tp,
                                         /*mirror_word_embeddings=*/shared.model.tie_embeddings);
  }
  return *shared.head;
}

// Each sequence's active positions in ascending order, padded with inactive positions to
// the longest: index [k, b] and which entries are real, valid [k, b].
std::pair<at::Tensor, at::Tensor> ActiveIndex(const at::Tensor& active) {
  const int64_t s = active.size(0);
  const int64_t k = active.sum(0).max().item<int64_t>();
  const at::Tensor pos = at::arange(s, active.options().dtype(at::kLong)).unsqueeze(1).expand_as(active);
  // Active positions sort first, in order; then the others.
  const at::Tensor key = at::where(active, pos, pos + s);
  const at::Tensor index = std::get<0>(key.sort(0)).narrow(0, 0, k).remainder(s);
  return {index, active.gather(0, index)};
}

// The largest softmax probability of each row of vocabulary-parallel logits [..., V/tp].
at::Tensor MaxProbability(const at::Tensor& logits, TensorParallelGroup* tp) {
  at::Tensor max = std::get<0>(logits.max(-1, /*keepdim=*/true));
  if (tp != nullptr) tp->AllReduceMax(max);
  at::Tensor sum = (logits - max).exp().sum(-1);
  if (tp != nullptr) tp->AllReduceSum(sum);
  return sum.reciprocal();  // exp(max − logsumexp)
}

at::Tensor ExitForward(Shared& shared, ExitLayer& state, const TransformerLayer& layer,
                       const at::Tensor& hidden, const ForwardContext& ctx) {
  const int64_t s = hidden.size(0), b = hidden.size(1), h = hidden.size(2);
  // A recomputed layer (NOTE [activation recomputation]) decides the same exits from the
  // same input token state and counts nothing again; only its graph carries the exit loss
  // (the first forward ran without autograd).
  LayerCounts recomputed;
  LayerCounts& counts = ctx.recomputing ? recomputed : ctx.training ? state.train : state.eval;
  at::Tensor exit_state = ctx.token_state;
  at::Tensor out;
  at::Tensor index, valid;  // the active tokens, when some have exited
  const bool exited = exit_state.defined() && exit_state.ge(0).any().item<bool>();
  if (!exited) {
    out = state.inner ? state.inner(layer, hidden, ctx) : layer.PlainForward(hidden, ctx);
    counts.computed += static_cast<double>(s * b);
  } else if (state.inner) {
    // Another plugin's wrapper (Mixture-of-Depths) runs the layer on every token; the
    // exited ones keep their state (their compute is not saved on such a layer).
    const at::Tensor keep = exit_state.ge(0).unsqueeze(-1);
    out = at::where(keep, hidden, state.inner(layer, hidden, ctx));
    counts.computed += static_cast<double>(s * b);
    std::tie(index, valid) = ActiveIndex(exit_state.lt(0));
  } else {
    const at::Tensor active = exit_state.lt(0);
    std::tie(index, valid) = ActiveIndex(active);
    if (index.size(0) == 0) {
      out = hidden;
    } else {
      const at::Tensor index3 = index.unsqueeze(-1).expand({index.size(0), b, h});
      const at::Tensor update =
          layer.ResidualAt(hidden, index, ctx) * valid.unsqueeze(-1).to(hidden.scalar_type());
      out = hidden.scatter_add(0, index3, update);
    }
    counts.computed += active.sum().item<double>();
  }
  counts.seen += static_cast<double>(s * b);
  if (!state.is_exit) return out;

  // The exit head on the tokens active here.
  if (!index.defined()) {
    index = at::arange(s, out.options().dtype(at::kLong)).unsqueeze(1).expand({s, b});
    valid = at::ones({s, b}, out.options().dtype(at::kBool));
  }
  if (index.size(0) == 0) return out;
  const int64_t k = index.size(0);
  const at::Tensor index3 = index.unsqueeze(-1).expand({k, b, h});
  const at::Tensor x = out.gather(0, index3);
  const bool with_loss = ctx.labels.defined();
  const bool need_logits = with_loss || shared.options.softmax;
  at::Tensor logits;
  if (need_logits) logits = HeadCopy(shared).Logits(x, at::Tensor());  // [k, b, V/tp]
  if (with_loss) {
    const int64_t vocab_start =
        (shared.tp ? shared.tp->rank() : 0) * (shared.model.vocab_size / (shared.tp ? shared.tp->size() : 1));
    const at::Tensor losses =
        VocabParallelCrossEntropy(logits, ctx.labels.gather(0, index), vocab_start, shared.tp) *
        valid.to(logits.scalar_type());
    counts.loss_sum += losses.detach().sum().item<double>();
    counts.loss_tokens += valid.sum().item<double>();
    if (ctx.training && ctx.loss_scale > 0 && state.weight > 0) {
      const double tokens = static_cast<double>(s * b);
      out = WithAuxLoss(out, losses.sum() * (state.weight / tokens), ctx.loss_scale * tokens);
    }
  }
  at::Tensor confidence;
  {
    at::NoGradGuard no_grad;
    // NOTE [early exit mixed precision]: under --bf16 the confidence is computed from the
    // bf16 logits or states widened to the masters' fp32 — an exit is a threshold test, and
    // a bf16 softmax maximum or cosine (8 bits of mantissa: steps of 0.004 near 1) would
    // move tokens across a threshold such as 0.995. The exit head's loss is already fp32
    // (VocabParallelCrossEntropy widens). With fp32 or fp64 activations the casts are no-ops.
    const at::ScalarType wide = shared.model.device_spec.master_dtype;
    if (shared.options.softmax) {
      confidence = MaxProbability(logits.detach().to(wide), shared.tp);
    } else {
      confidence = at::cosine_similarity(x.detach().to(wide),
                                         hidden.gather(0, index3).detach().to(wide), -1);
    }
    const at::Tensor exits = valid & confidence.ge(shared.options.threshold);  // [k, b]
    at::Tensor next = exit_state.defined() ? exit_state.clone()
                                           : at::full({s, b}, kActive, out.options().dtype(at::kFloat));
    // Scatter the exits back to their positions (pads are never exits).
    const at::Tensor here = at::zeros({s, b}, out.options().dtype(at::kBool)).scatter(0, index, exits);
    next.masked_fill_(here, static_cast<double>(state.index));
    ctx.token_state = next;
    counts.exited += exits.sum().item<double>();
  }
  return out;
}

class EarlyExitPlugin final : public Plugin {
 public:
  explicit EarlyExitPlugin(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  const char* name() const override { return "early_exit"; }
  // ExitForward honours ForwardContext::recomputing; the input token state is restored.
  bool SupportsRecompute() const override { return true; }
  bool NeedsLabels() const override { return true; }
  bool CarriesTokenState() const override { return true; }
  double InitialTokenState() const override { return kActive; }

  // The head copy is sharded over the tensor-parallel group and summed over the pipeline
  // and data groups of the layout: a new layout (a live shrink) gets a new copy, filled from
  // the real head by the AfterLoad that follows (NOTE [early exit heads]).
  absl::Status OnLayout(ParallelContext* parallel) override {
    shared_->parallel = parallel;
    shared_->tp = parallel != nullptr ? parallel->tensor_parallel() : nullptr;
    shared_->head.reset();
    shared_->synced = false;
    return absl::OkStatus();
  }

  void EditLayer(TransformerLayer& layer, bool initialize) override {
    auto state = std::make_shared<ExitLayer>();
    state->index = layer.layer_index();
    const std::vector<int64_t>& exits = shared_->options.layers;
    auto it = std::find(exits.begin(), exits.end(), state->index);
    state->is_exit = it != exits.end();
    if (state->is_exit) state->weight = shared_->options.weights[it - exits.begin()];
    state->inner = layer.forward_wrapper();
    layer.Attach(kAttachment, state);
    ExitLayer* raw = state.get();  // the layer owns the state and the closures
    Shared* shared = shared_.get();  // the plugin outlives the model's layers
    layer.SetForwardWrapper([shared, raw](const TransformerLayer& self, const at::Tensor& hidden,
                                          const ForwardContext& ctx) {
      return ExitForward(*shared, *raw, self, hidden, ctx);
    });
    // This iteration's fraction once its forwards ran, else the last iteration's; on a
    // layer an earlier plugin wraps, exits save nothing (ExitForward runs the wrapper on
    // every token), so the fraction is 1 and the wrapper's own stands alone.
    layer.AddLoadFraction(TransformerLayer::LoadFraction::kTokens, [raw] {
      if (raw->inner) return 1.0;
      return raw->train.seen > 0 ? raw->train.computed / raw->train.seen : raw->last_fraction;
    });
  }

  absl::Status BeforeIteration(PluginContext& ctx) override {
    if (!shared_->synced) SyncHead(ctx);
    for (const auto& [index, layer] : ctx.model().layers()) {
      if (ExitLayer* state = layer->Attached<ExitLayer>(kAttachment)) {
        if (state->train.seen > 0) state->last_fraction = state->train.computed / state->train.seen;
        state->train = LayerCounts();
      }
    }
    return absl::OkStatus();
  }

  absl::Status AfterBackward(PluginContext& ctx) override {
    ReturnHeadGradients(ctx);
    return absl::OkStatus();
  }

  absl::Status AfterOptimizerStep(PluginContext& ctx) override {
    SyncHead(ctx);
    return absl::OkStatus();
  }

  absl::Status AfterLoad(PluginContext& ctx) override {
    SyncHead(ctx);
    return absl::OkStatus();
  }

  absl::Status Metrics(PluginContext& ctx, nlohmann::json* record, std::string* log_line) override {
    Report report = Gather(ctx, /*training=*/true);
    (*record)["early_exit_tokens"] = report.tokens;
    (*record)["early_exit_avg_layers"] = report.avg_layers;
    for (const auto& [name, value] : report.exit_losses.items()) (*record)[name] = value;
    absl::StrAppend(log_line, absl::StrFormat(" | exit avg layers %.2f", report.avg_layers));
    return absl::OkStatus();
  }

  absl::Status AfterEvaluation(PluginContext& ctx, nlohmann::json* record,
                               std::string* log_line) override {
    Report report = Gather(ctx, /*training=*/false);
    for (const auto& [index, layer] : ctx.model().layers()) {
      if (ExitLayer* state = layer->Attached<ExitLayer>(kAttachment)) state->eval = LayerCounts();
    }
    (*record)["valid_early_exit_avg_layers"] = report.avg_layers;
    (*record)["valid_early_exit_tokens"] = report.tokens;
    absl::StrAppend(log_line, absl::StrFormat(" | avg exit layers %.2f of %d", report.avg_layers,
                                              shared_->model.num_layers));
    return absl::OkStatus();
  }

 private:
  struct Report {
    nlohmann::json tokens = nlohmann::json::object();  // per layer [computed, seen, exited]
    nlohmann::json exit_losses = nlohmann::json::object();
    double avg_layers = 0;  // layers a token ran through, on average
  };

  // Every layer's counts over the whole model and every data-parallel replica (collective).
  Report Gather(PluginContext& ctx, bool training) {
    const int64_t n = shared_->model.num_layers;
    std::vector<double> values(5 * n, 0.0);
    for (const auto& [index, layer] : ctx.model().layers()) {
      const ExitLayer* state = layer->Attached<ExitLayer>(kAttachment);
      if (state == nullptr || layer->tp_rank() != 0) continue;
      const LayerCounts& c = training ? state->train : state->eval;
      const double v[5] = {c.computed, c.seen, c.exited, c.loss_sum, c.loss_tokens};
      for (int j = 0; j < 5; ++j) values[5 * index + j] = v[j];
    }
    ctx.SumOverModel(values);
    if (ctx.parallel() != nullptr) ctx.parallel()->SumOverDataParallel(values);  // every replica's tokens
    Report report;
    double seen = values[1];  // every token passes layer 0
    double layers_run = 0;
    double exited_so_far = 0;
    for (int64_t l = 0; l < n; ++l) {
      const double* v = &values[5 * l];
      report.tokens[absl::StrCat("layers.", l)] = {static_cast<int64_t>(v[0]),
                                                   static_cast<int64_t>(v[1]),
                                                   static_cast<int64_t>(v[2])};
      layers_run += v[2] * static_cast<double>(l + 1);
      exited_so_far += v[2];
      if (v[4] > 0) report.exit_losses[absl::StrCat("early_exit_loss.", l)] = v[3] / v[4];
    }
    layers_run += (seen - exited_so_far) * static_cast<double>(n);
    report.avg_layers = seen > 0 ? layers_run / seen : static_cast<double>(n);
    return report;
  }

  // The real head's tensors this rank holds, by the copy's parameter name (NOTE [early
  // exit heads]): the head's norm and output weight on the last stage, the word embeddings
  // where the output weight is tied to them.
  std::vector<std::pair<std::string, at::Tensor>> Owners(GptModel& model) const {
    std::vector<std::pair<std::string, at::Tensor>> owners;
    if (Head* head = model.head()) {
      // Named as the copy's: the copy has an output weight of the same kind (tied or not).
      for (Parameter& p : head->parameters()) owners.emplace_back(p.name, p.value);
    }
    if (shared_->model.tie_embeddings && model.embedding() != nullptr) {
      owners.emplace_back("word_embeddings_mirror.weight", model.embedding()->word_embeddings());
    }
    return owners;
  }

  Parameter& CopyOf(const std::string& name) {
    Parameter* p = HeadCopy(*shared_).FindParameter(name);
    TORCH_INTERNAL_ASSERT(p != nullptr, "early_exit: the head copy lacks ", name);
    return *p;
  }

  // The copy ← the last stage's head (summed over the pipeline; others add zeros).
  void SyncHead(PluginContext& ctx) {
    at::NoGradGuard no_grad;
    const auto owners = Owners(ctx.model());
    const bool last = ctx.model().head() != nullptr;
    for (Parameter& p : HeadCopy(*shared_).parameters()) {
      at::Tensor value = at::zeros_like(p.value);
      for (const auto& [name, tensor] : owners) {
        // On the last stage; with pp == 1 and a tied weight the embedding is the owner.
        if (name == p.name && last) {
          value.copy_(tensor);
          break;
        }
      }
      if (shared_->parallel != nullptr) {
        shared_->parallel->AllReduceSum(ParallelContext::GroupRole::kPipeline, value);
      }
      p.value.copy_(value);
    }
    shared_->synced = true;
  }

  // The copy's gradients → the real head (and tied word embeddings), then cleared: added
  // into this rank's parts of the owners' reduced gradients (NOTE [reduced gradients]; the
  // owned slices under the distributed optimizer).
  void ReturnHeadGradients(PluginContext& ctx) {
    at::NoGradGuard no_grad;
    const auto owners = Owners(ctx.model());
    ReducedGradients& reduced = ctx.gradients();
    for (Parameter& p : HeadCopy(*shared_).parameters()) {
      at::Tensor grad = p.value.grad().defined() ? p.value.grad() : at::zeros_like(p.value);
      if (shared_->parallel != nullptr) {
        shared_->parallel->AllReduceSum(ParallelContext::GroupRole::kPipeline, grad);
        shared_->parallel->AllReduceSum(ParallelContext::GroupRole::kData, grad);
      }
      const at::Tensor flat = grad.reshape({-1});
      for (const auto& [name, tensor] : owners) {
        if (name != p.name) continue;
        bool found = false;
        for (const GradientPart& part : reduced.parts()) {
          if (!part.param->value.is_same(tensor)) continue;
          part.grad.add_(flat.narrow(0, part.begin, part.end - part.begin));
          found = true;
        }
        // Whole gradients, and the owner has none (the main loss always reaches the head,
        // so only a test's context): the exits' is its gradient.
        if (!found && !reduced.sliced()) const_cast<at::Tensor&>(tensor).mutable_grad() = grad.clone();
      }
      p.value.mutable_grad() = at::Tensor();
    }
  }

  std::shared_ptr<Shared> shared_;
};

absl::Status Validate(const PluginSetup& setup) { return OptionsFromFlags(setup.model).status(); }

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup& setup) {
  auto shared = std::make_shared<Shared>();
  FULCRUM_ASSIGN_OR_RETURN(shared->options, OptionsFromFlags(setup.model));
  shared->model = setup.model;
  // One process until OnLayout says otherwise.
  return std::unique_ptr<Plugin>(new EarlyExitPlugin(std::move(shared)));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(early_exit,
                        "early exit (CALM, Schuster et al. 2022): exit heads after chosen layers; "
                        "confident tokens skip the later layers",
                        (PluginEntry{nullptr, Validate, Create,
                                    /*uses_expert_parallel_group=*/false, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
