// bench_dynamism: what each dynamism plugin does to a layer's cost, and what the balancer
// then does with the unequal pipeline it makes. Two tables:
//
// 1. Layer. One transformer layer of --hidden/--heads/--ffn (by default a gpt_20m layer:
//    512 wide, 8 heads, FFN 2048) on --seq x --micro_batch tokens, built through the plugin
//    registry exactly as fulcrum_train builds it, in these configurations:
//      dense       no plugin
//      prune@S     the prune plugin, one pruning step to sparsity S (its own BeforeIteration
//                  with --prune_start_iter=--prune_end_iter=0): the global magnitude
//                  threshold, the masks, and sparse compute where it pays (core/sparse_linear.h)
//      frozen      the freeze plugin freezing the layer (--freeze_schedule=1:0 and its own
//                  AfterOptimizerStep): the layer is the model's frozen prefix, so it runs
//                  its forward without autograd and has no backward at all
//      mod@C       the mod plugin routing the layer at capacity C (--capacities)
//      exit@A      the early_exit plugin, the layer after an exit (layer 1 of 2, exit after
//                  layer 0) with the fraction A of each sequence's tokens still active
//                  (--active; the others marked exited at random positions): queries and
//                  MLP on the active tokens, keys and values of all
//    and, in a second table at --attention_seq tokens per sequence against its own dense
//    layer, the sparse_attention plugin at each of --buckets (blocks of --attention_block).
//    Each repetition times, per configuration, the forward (F), the backward with a
//    WeightGradStore active (B: input gradients; the weight-gradient GEMMs are queued) and
//    the store's flush (W), as a zero-bubble stage runs them. Configurations alternate
//    within each repetition; medians are shown with the ratio to dense F+B+W. Before timing,
//    each pruned layer's sparsity is measured from its weights and its output is compared
//    with a plain dense layer holding the same (masked) weights. The "work" column is what
//    the plugin says the layer computed: weights kept, tokens routed (the layer's load), or
//    attention scores computed out of s^2 per head (the attention core's load).
//    Goals: a 90%-pruned layer, a frozen-prefix layer and a layer computing 25% of the
//    tokens (mod, early exit) each <= 0.4x dense.
//
// 2. Pipeline (--pipeline). pp=2, two ranks x one thread, where a plugin makes the stages
//    unequal, with --rebalancer=none against the partition balancer: it runs
//    fulcrum_bench_balance (built next to this tool) with the plugin's flags, which prints
//    bubble ratio, iteration time and imbalance side by side (none, partition, diffusion)
//    and checks that the losses agree. The plugin cases: freeze (layers 0..2 of 8 frozen
//    after iteration 1, so stage 0 keeps three forward-only layers), mod (layers 4..7
//    routed at capacity 0.125, so stage 1's layers compute an eighth of the tokens),
//    early_exit (one exit after layer 3 with the state-saturation confidence, so the
//    tokens that exit there skip stage 1) and sparse_attention (every layer, 4 buckets).
//
//   build/bin/fulcrum_bench_dynamism [--hidden=512] [--heads=8] [--ffn=2048] [--seq=256]
//       [--micro_batch=4] [--sparsity=0.5,0.8,0.9] [--capacities=0.5,0.25,0.125]
//       [--active=0.5,0.25,0.125]
//       [--attention_seq=1024] [--buckets=2,4,8] [--attention_block=64] [--threads=1,2]
//       [--reps=7] [--warmup=2]
//       [--pipeline=true] [--pipeline_rounds=2] [--pipeline_iters=30]
//
// Exit codes: 0 done (goals are reported, not enforced), 2 bad flags, 1 a check failed
// (a pruned layer's sparsity or output is off, or the pipeline benchmark failed).
#include <gflags/gflags.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/gpt_model.h"
#include "core/linear.h"
#include "core/plugin.h"
#include "core/status.h"
#include "core/threads.h"
#include "plugins/plugin_registry.h"
#include "recipes/cli.h"
#include "tools/internal/bench_util.h"

DEFINE_int64(hidden, 512, "Hidden size of the measured layer (gpt_20m: 512).");
DEFINE_int64(heads, 8, "Attention heads (gpt_20m: 8).");
DEFINE_int64(ffn, 2048, "FFN hidden size (gpt_20m: 2048).");
DEFINE_int64(seq, 256, "Sequence length (gpt_20m: 256).");
DEFINE_int64(micro_batch, 4, "Micro-batch size (gpt_20m: 4).");
DEFINE_string(sparsity, "0.5,0.8,0.9", "Sparsities the prune plugin prunes the layer to.");
DEFINE_string(capacities, "0.5,0.25,0.125", "Capacities of the mod plugin's routed layer.");
DEFINE_string(active, "0.5,0.25,0.125",
              "Fractions of tokens still active (not exited) at the early_exit plugin's layer.");
DEFINE_int64(attention_seq, 1024,
             "Sequence length of the sparse-attention table (its own dense reference); 0 skips it.");
DEFINE_string(buckets, "2,4,8", "Bucket counts of the sparse_attention plugin.");
DEFINE_int64(attention_block, 64, "--sparse_attention_block of the sparse-attention table.");
DEFINE_string(threads, "1,2", "Intra-op thread counts, one table each.");
DEFINE_int32(reps, 7, "Timed repetitions (medians shown).");
DEFINE_int32(warmup, 2, "Untimed repetitions first.");
DEFINE_bool(pipeline, true, "Also run the pp=2 table (fulcrum_bench_balance with plugin flags).");
DEFINE_int32(pipeline_rounds, 2, "--rounds of the pipeline table.");
DEFINE_int32(pipeline_iters, 30, "--train_iters of each pipeline run.");

DECLARE_int64(prune_start_iter);
DECLARE_int64(prune_end_iter);
DECLARE_int64(prune_interval);
DECLARE_double(prune_initial_sparsity);
DECLARE_double(prune_final_sparsity);
DECLARE_string(freeze_schedule);
DECLARE_int64(mod_layer_freq);
DECLARE_double(mod_capacity);
DECLARE_int64(sparse_attention_buckets);
DECLARE_string(early_exit_layers);
DECLARE_double(early_exit_threshold);
DECLARE_int64(sparse_attention_block);

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kGoalSparsity = 0.9;
constexpr double kGoalRatio = 0.4;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

ModelOptions LayerOptions(int64_t seq) {
  ModelOptions o;
  o.num_layers = 1;
  o.hidden_size = FLAGS_hidden;
  o.num_attention_heads = FLAGS_heads;
  o.ffn_hidden_size = FLAGS_ffn;
  o.seq_length = seq;
  o.vocab_size = 128;  // No embedding or head is built; the model only checks it.
  return o;
}

// One configuration: a one-layer stage (no embedding, no head) built with its plugins.
struct Config {
  std::string name;
  std::shared_ptr<PluginSet> plugins;  // null: dense
  std::unique_ptr<GptModel> model;
  double target = 0;                   // the sparsity asked of the prune plugin
  double sparsity = 0;                 // measured from the weights
  double goal_work = -1;               // the fraction of work the goal is checked at
  /// early_exit: the carried token state its layer receives (NOTE [carried token state]).
  at::Tensor token_state;
  std::vector<double> f, b, w;
};

ForwardContext TrainingContext() { return ForwardContext{true, 1, 0, 1.0, {}, 0}; }

ForwardContext ContextOf(const Config& c) {
  ForwardContext ctx = TrainingContext();
  if (c.token_state.defined()) ctx.token_state = c.token_state;
  return ctx;
}

// Exactly round(active x s) active tokens in each of b sequences, at random positions; the
// others exited at layer 0.
at::Tensor ExitState(double active, int64_t seq, int64_t b) {
  const int64_t k = std::clamp<int64_t>(std::llround(active * static_cast<double>(seq)), 1, seq);
  torch::manual_seed(11);
  const at::Tensor order = std::get<1>(at::rand({seq, b}).sort(0));
  return at::zeros({seq, b}, at::kFloat).scatter(0, order.narrow(0, 0, k), -1.0);
}

absl::StatusOr<std::shared_ptr<PluginSet>> Plugins(const std::string& name,
                                                   const ModelOptions& options) {
  plugins::PluginSetup setup;
  setup.model = options;
  return plugins::MakePlugins({name}, setup);
}

// The prunable weights' zero fraction (the four projections of the layer).
double Sparsity(const GptModel& model) {
  double zeros = 0, all = 0;
  for (const auto& [index, layer] : model.layers()) {
    for (LinearSlot slot : {LinearSlot::kQkv, LinearSlot::kProj, LinearSlot::kFc1,
                            LinearSlot::kFc2}) {
      const at::Tensor& w = layer->weight(slot);
      zeros += static_cast<double>((w == 0).sum().item<int64_t>());
      all += static_cast<double>(w.numel());
    }
  }
  return zeros / all;
}

absl::StatusOr<Config> MakeConfig(const std::string& kind, double knob, int64_t seq) {
  const double sparsity = knob;
  const ModelOptions options = LayerOptions(seq);
  const StageSpec stage{0, 1, /*has_embedding=*/false, /*has_head=*/false};
  Config c;
  if (kind == "dense") {
    c.name = "dense";
    c.model = std::make_unique<GptModel>(options, stage);
  } else if (kind == "prune") {
    c.name = absl::StrFormat("prune@%.2f", sparsity);
    c.target = sparsity;
    FLAGS_prune_start_iter = 0;
    FLAGS_prune_end_iter = 0;
    FLAGS_prune_interval = 1;
    FLAGS_prune_initial_sparsity = sparsity;
    FLAGS_prune_final_sparsity = sparsity;
    FULCRUM_ASSIGN_OR_RETURN(c.plugins, Plugins("prune", options));
    c.model = std::make_unique<GptModel>(options, stage, nullptr, c.plugins);
    PluginContext ctx(1, *c.model, nullptr, nullptr);
    FULCRUM_RETURN_IF_ERROR(c.plugins->BeforeIteration(ctx));  // the step at t0 = 0
  } else if (kind == "frozen") {
    c.name = "frozen";
    FLAGS_freeze_schedule = "1:0";
    FULCRUM_ASSIGN_OR_RETURN(c.plugins, Plugins("freeze", options));
    c.model = std::make_unique<GptModel>(options, stage, nullptr, c.plugins);
    PluginContext ctx(1, *c.model, nullptr, nullptr);
    FULCRUM_RETURN_IF_ERROR(c.plugins->AfterOptimizerStep(ctx));
    if (c.model->frozen_prefix() != 1 || c.model->input_needs_grad()) {
      return absl::InternalError("the freeze plugin did not make the layer a frozen prefix");
    }
  } else if (kind == "mod") {
    c.name = absl::StrFormat("mod@%.3f", knob);
    FLAGS_mod_layer_freq = 1;  // the one layer is routed
    FLAGS_mod_capacity = knob;
    FULCRUM_ASSIGN_OR_RETURN(c.plugins, Plugins("mod", options));
    c.model = std::make_unique<GptModel>(options, stage, nullptr, c.plugins);
  } else if (kind == "early_exit") {
    c.name = absl::StrFormat("exit@%.3f", knob);
    ModelOptions two = options;
    two.num_layers = 2;
    FLAGS_early_exit_layers = "0";
    FLAGS_early_exit_threshold = 2;  // the exits are given (token_state), none decided here
    FULCRUM_ASSIGN_OR_RETURN(c.plugins, Plugins("early_exit", two));
    c.model = std::make_unique<GptModel>(two, StageSpec{1, 2, false, false}, nullptr, c.plugins);
    c.token_state = ExitState(knob, seq, FLAGS_micro_batch);
  } else if (kind == "sparse_attention") {
    c.name = absl::StrFormat("buckets=%d", static_cast<int>(knob));
    FLAGS_sparse_attention_buckets = static_cast<int64_t>(knob);
    FLAGS_sparse_attention_block = FLAGS_attention_block;
    FULCRUM_ASSIGN_OR_RETURN(c.plugins, Plugins("sparse_attention", options));
    c.model = std::make_unique<GptModel>(options, stage, nullptr, c.plugins);
  }
  c.sparsity = Sparsity(*c.model);
  return c;
}

// The same function through plain dense products: a model without plugins holding the
// configuration's weights. Returns max |difference| / (max |reference| + 1).
double CheckAgainstDense(const Config& c, const at::Tensor& hidden, int64_t seq) {
  GptModel dense(LayerOptions(seq), StageSpec{0, 1, false, false});
  at::NoGradGuard no_grad;
  const TransformerLayer& from = *c.model->layers().begin()->second;
  TransformerLayer& to = *dense.layers().at(0);
  for (Parameter& p : to.parameters()) {
    for (const Parameter& q : from.parameters()) {
      if (q.name == p.name) p.value.copy_(q.value);
    }
  }
  const at::Tensor got = c.model->ForwardLayers(hidden, TrainingContext());
  const at::Tensor want = dense.ForwardLayers(hidden, TrainingContext());
  return (got - want).abs().max().item<double>() / (want.abs().max().item<double>() + 1.0);
}

// One F, B, W measurement of `c` (appended to its vectors when `record`).
void RunOnce(Config& c, const at::Tensor& input, const at::Tensor& grad_out, bool record) {
  c.model->ZeroGrad();
  const at::Tensor hidden = input.detach().requires_grad_(c.model->input_needs_grad());
  WeightGradStore store;
  const auto t0 = Clock::now();
  at::Tensor out;
  {
    WeightGradStore::Scope scope(&store);
    out = c.model->ForwardLayers(hidden, ContextOf(c));
  }
  const auto t1 = Clock::now();
  if (out.requires_grad()) {
    WeightGradStore::Scope scope(&store);
    out.backward(grad_out);
  }
  const auto t2 = Clock::now();
  store.Flush();
  const auto t3 = Clock::now();
  if (record) {
    c.f.push_back(Ms(t0, t1));
    c.b.push_back(Ms(t1, t2));
    c.w.push_back(Ms(t2, t3));
  }
}

// A configuration to build: a plugin kind and its knob.
struct Spec {
  std::string kind;
  double knob = 0;
};

// One table: the configurations of `specs` (the first must be dense) on `seq` tokens per
// sequence, interleaved, with the checks that apply to each kind.
bool LayerTable(const std::string& title, int threads, int64_t seq, const std::vector<Spec>& specs) {
  SetComputeThreads(threads);
  double load = 0;
  bench::ReadLoadAverage(&load);
  std::printf("\n== %s, seq %ld, %d thread(s), load average before %.2f\n", title.c_str(), seq,
              threads, load);
  std::vector<Config> configs;
  for (const Spec& spec : specs) {
    absl::StatusOr<Config> c = MakeConfig(spec.kind, spec.knob, seq);
    if (!c.ok()) {
      std::fprintf(stderr, "bench_dynamism: %s: %s\n", spec.kind.c_str(), c.status().ToString().c_str());
      return false;
    }
    if (spec.kind == "prune" && std::abs(spec.knob - kGoalSparsity) < 1e-9) c->goal_work = 1 - spec.knob;
    if (spec.kind == "frozen") c->goal_work = 0;
    if ((spec.kind == "mod" || spec.kind == "early_exit") && std::abs(spec.knob - 0.25) < 1e-9) {
      c->goal_work = 0.25;
    }
    configs.push_back(*std::move(c));
  }

  torch::manual_seed(7);
  const at::Tensor input = torch::randn({seq, FLAGS_micro_batch, FLAGS_hidden});
  const at::Tensor grad_out = torch::randn({seq, FLAGS_micro_batch, FLAGS_hidden});
  bool ok = true;
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    if (specs[i].kind != "prune" && specs[i].kind != "dense" && specs[i].kind != "frozen") continue;
    // Pruned and frozen layers compute the dense function of their weights: checked here.
    const double error = CheckAgainstDense(c, input, seq);
    // The plugin prunes exactly round(S x weights) of the layer's four weights; the others
    // hold no zero (random initial values).
    const bool sparsity_ok = std::abs(c.sparsity - c.target) < 1e-6;
    const bool error_ok = error <= 1e-5;
    ok = ok && sparsity_ok && error_ok;
    std::printf("  %-12s measured sparsity %.4f%s, output vs dense products of the same weights %.1e%s\n",
                c.name.c_str(), c.sparsity, sparsity_ok ? "" : " (WRONG)", error,
                error_ok ? "" : " (TOO LARGE)");
  }
  for (int rep = 0; rep < FLAGS_warmup + FLAGS_reps; ++rep) {
    for (Config& c : configs) RunOnce(c, input, grad_out, rep >= FLAGS_warmup);
  }
  std::printf("config       |      F       B       W   F+B+W | work | ratio to dense F+B+W | goal\n");
  const double dense_sum =
      bench::Median(configs[0].f) + bench::Median(configs[0].b) + bench::Median(configs[0].w);
  const double dense_scores = static_cast<double>(FLAGS_micro_batch * FLAGS_heads * seq * seq);
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const double f = bench::Median(c.f), b = bench::Median(c.b), w = bench::Median(c.w);
    const double ratio = (f + b + w) / dense_sum;
    // What the plugin says the layer computed: weights kept, tokens routed, attention
    // scores computed (of s^2 per head), from the layer's own load report.
    double work = 1.0;
    const std::string& kind = specs[i].kind;
    if (kind == "prune") work = 1 - c.sparsity;
    if (kind == "mod") work = c.model->layers().at(0)->Load();
    if (kind == "early_exit") work = c.model->layers().at(1)->Load();
    if (kind == "sparse_attention") work = c.model->layers().at(0)->Load() / dense_scores;
    std::string goal;
    if (c.goal_work >= 0) {
      goal = absl::StrFormat("%s (<= %.2f)", ratio <= kGoalRatio ? "met" : "NOT MET", kGoalRatio);
    }
    std::printf("%-12s | %6.1f  %6.1f  %6.1f  %6.1f | %4.2f | %20.2f | %s\n", c.name.c_str(), f, b,
                w, f + b + w, kind == "frozen" ? 0.0 : work, ratio, goal.c_str());
  }
  bench::ReadLoadAverage(&load);
  std::printf("times in ms, medians of %d; load average after %.2f\n", FLAGS_reps, load);
  return ok;
}

bool PipelineTable(const std::string& bin_dir) {
  const std::string missing = bench::MissingTools(
      bin_dir, {"fulcrum_bench_balance", "fulcrum_launch", "fulcrum_train"});
  if (!missing.empty()) {
    std::fprintf(stderr, "bench_dynamism: %s\n", missing.c_str());
    return false;
  }
  struct Case {
    std::string plugin, model_flags;
  };
  const std::vector<Case> cases = {
      {"freeze", "--num_layers=8 --plugins=freeze --freeze_schedule=1:0-2"},
      {"mod", "--num_layers=8 --plugins=mod --mod_layers=4-7 --mod_capacity=0.125"},
      // One exit after layer 3: the tokens confident there skip stage 1's layers 4..7.
      {"early_exit", "--num_layers=8 --plugins=early_exit --early_exit_layers=3 "
                     "--early_exit_confidence=state --early_exit_threshold=0.9"},
      // Every layer sparse: the stages stay nearly equal (bucket sizes differ per layer).
      {"sparse_attention", "--num_layers=8 --plugins=sparse_attention"},
  };
  bool ok = true;
  for (const Case& c : cases) {
    std::printf("\n== pipeline, pp=2, plugin %s: fulcrum_bench_balance, none vs partition vs diffusion\n",
                c.plugin.c_str());
    std::fflush(stdout);
    const std::vector<std::string> args = {
        bin_dir + "/fulcrum_bench_balance", "--configs=none,partition,diffusion", "--recipe=tiny",
        absl::StrCat("--model_flags=", c.model_flags),
        absl::StrCat("--rounds=", FLAGS_pipeline_rounds),
        absl::StrCat("--train_iters=", FLAGS_pipeline_iters), "--skip_iters=6",
        "--before_iters=2", "--repack_row=false"};
    std::printf("%s\n", bench::ShellCommand(args).c_str());
    std::fflush(stdout);
    const int code = std::system(bench::ShellCommand(args).c_str());
    if (code != 0) {
      std::fprintf(stderr, "bench_dynamism: the %s pipeline run failed (status %d)\n",
                   c.plugin.c_str(), code);
      ok = false;
    }
  }
  return ok;
}

// Comma-separated numbers of --`flag`, each in [lo, hi]; nullopt after printing the error.
std::optional<std::vector<double>> ParseNumbers(const char* flag, const std::string& text, double lo,
                                                double hi) {
  std::vector<double> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    double v = 0;
    if (!absl::SimpleAtod(part, &v) || !(v >= lo && v <= hi)) {
      std::fprintf(stderr, "bench_dynamism: --%s: '%s' is not in [%g, %g]\n", flag,
                   std::string(part).c_str(), lo, hi);
      return std::nullopt;
    }
    out.push_back(v);
  }
  return out;
}

int Main(const std::string& bin_dir) {
  const auto sparsities = ParseNumbers("sparsity", FLAGS_sparsity, 1e-9, 1 - 1e-9);
  const auto capacities = ParseNumbers("capacities", FLAGS_capacities, 1e-9, 1);
  const auto active = ParseNumbers("active", FLAGS_active, 1e-9, 1);
  const auto buckets = ParseNumbers("buckets", FLAGS_buckets, 1, 4096);
  if (!sparsities || !capacities || !active || !buckets) return bench::kUsageError;
  std::string error;
  std::optional<std::vector<int>> threads = bench::ParseInts("threads", FLAGS_threads, 1, &error);
  if (!threads) {
    std::fprintf(stderr, "bench_dynamism: %s\n", error.c_str());
    return bench::kUsageError;
  }
  if (FLAGS_reps < 1 || FLAGS_warmup < 0 || FLAGS_attention_seq < 0) {
    std::fprintf(stderr, "bench_dynamism: --reps must be >= 1, --warmup and --attention_seq >= 0\n");
    return bench::kUsageError;
  }
  std::printf(
      "fulcrum_bench_dynamism: one transformer layer (hidden %ld, %ld heads, FFN %ld), micro-batch "
      "%ld, fp32, %d usable cores\n"
      "F forward, B backward with the weight-gradient GEMMs queued, W their flush; work: the "
      "fraction the plugin computes (weights kept, tokens routed, attention scores of s^2);\n"
      "goals: prune@%.2f, frozen and mod@0.250 <= %.2fx dense F+B+W\n",
      FLAGS_hidden, FLAGS_heads, FLAGS_ffn, FLAGS_micro_batch, bench::UsableCores(), kGoalSparsity,
      kGoalRatio);
  std::vector<Spec> layer = {{"dense", 0}};
  for (double s : *sparsities) layer.push_back({"prune", s});
  layer.push_back({"frozen", 0});
  for (double c : *capacities) layer.push_back({"mod", c});
  for (double a : *active) layer.push_back({"early_exit", a});
  std::vector<Spec> attention = {{"dense", 0}};
  for (double b : *buckets) attention.push_back({"sparse_attention", b});
  bool ok = true;
  for (int t : *threads) {
    ok = LayerTable("prune, freeze, mod, early exit", t, FLAGS_seq, layer) && ok;
    if (FLAGS_attention_seq > 0) {
      ok = LayerTable("sparse_attention", t, FLAGS_attention_seq, attention) && ok;
    }
  }
  if (FLAGS_pipeline) ok = PipelineTable(bin_dir) && ok;
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_dynamism";
  help.usage =
      "fulcrum_bench_dynamism: per-layer F+B+W of a dense, pruned, frozen, routed (mod),\n"
      "early-exit and sparse-attention layer built by the plugins, and a pp=2 run where a\n"
      "plugin makes the stages unequal, with and without the partition balancer (through\n"
      "fulcrum_bench_balance, built next to it).\n\n"
      "  fulcrum_bench_dynamism [--hidden=512] [--threads=1,2] [--reps=7] [--pipeline=true]\n"
      "  fulcrum_bench_dynamism --threads=1 --reps=5 --pipeline=false     the layer tables only\n\n"
      "The plugins' own flags are accepted too (under \"Plugins\" below); each table sets the\n"
      "ones it varies.\n"
      "Exit status: 0 done (goals are reported, not enforced), 2 bad flags, 1 a check failed\n"
      "(a pruned layer's sparsity or output is off, or the pipeline benchmark failed).\n";
  help.groups = {
      {"Layer", {"hidden", "heads", "ffn", "seq", "micro_batch"}},
      {"Plugin configurations", {"sparsity", "capacities", "active", "attention_seq", "buckets",
                                 "attention_block"}},
      {"Timing", {"threads", "reps", "warmup"}},
      {"Pipeline table", {"pipeline", "pipeline_rounds", "pipeline_iters"}},
  };
  help.per_file_dir = "plugins";
  help.per_file_title = "Plugins";
  if (std::optional<int> code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *code;
  }
  return fulcrum::Main(fulcrum::bench::BinDir(argv[0]));
}
