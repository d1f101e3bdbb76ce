// fulcrum_sim: the pipeline simulator at scales our two-core machines cannot run (DESIGN.md
// "Scale"). Every number it prints is SIMULATED: per-layer costs from a named case (measured
// plugin behaviour on a FLOP model, tools/internal/sim_cases.h) or from a real run's
// --load_trace, through the schedules and the balancers fulcrum_train uses
// (dynamic/simulation.h).
//
//   fulcrum_sim --case=all                       the DynMo table: its six cases, 16-24 stages
//   fulcrum_sim --case=pruning --per_iteration   one case, iteration by iteration
//   fulcrum_sim --trace=run.jsonl                replay a run (and compare with what it measured)
//   fulcrum_sim --trace=run.jsonl --scale_layers=48 --scale_hidden=1024 --stages=24
//   ... --repack                                 GPUs over time after re-packing
//   ... --output=sim.jsonl                       per-iteration results, for fulcrum_plot
//   fulcrum_sim --schedules                      1F1B, ZB-H1, interleaved 1F1B, ZB-V side by
//                                                side at 16 and 24 stages (--stages for others)
//
// Exit codes: 0 done, 2 bad flags or inputs (one line, before any work), 1 a simulation or
// the write of --output failed. --output is written atomically (a temporary file renamed over
// it) once every simulation succeeded, and never onto an input: a failed run leaves the
// previous file as it was.
#include <gflags/gflags.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/file_system.h"
#include "dynamic/balance_problem.h"
#include "dynamic/balancing_rebalancer.h"
#include "dynamic/partition.h"
#include "dynamic/simulation.h"
#include "dynamic/trace_replay.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"
#include "recipes/cli.h"
#include "tools/internal/sim_cases.h"

DEFINE_string(case, "", "Named cases, comma-separated, or 'all': moe, moe_calibrated, pruning, "
              "freezing, freezing_free, sparse_attention, early_exit, mod (DynMo's six at DynMo's "
              "scale; moe_calibrated scales the measured expert imbalance until the best static "
              "placement idles 25%, DynMo's figure; freezing_free counts a frozen layer free, as "
              "DynMo's load model does).");
DEFINE_string(trace, "", "Replay a fulcrum_train --load_trace file instead of a case.");
DEFINE_string(moe_metrics, "",
              "fulcrum_train --metrics_file of a MoE run whose expert_tokens give the MoE case's "
              "per-layer token imbalance (default: tools/profiles/moe.jsonl, compiled in).");
DEFINE_double(moe_amplitude, 1.0,
              "The moe case's imbalance scaled: each layer's max/mean expert load r becomes "
              "1 + K (r - 1) (1: as measured).");
DEFINE_string(early_exit_metrics, "",
              "fulcrum_train --metrics_file of a --plugins=early_exit run whose per-layer token "
              "counts give the early-exit case (default: tools/profiles/early_exit.jsonl).");
DEFINE_string(prune_metrics, "",
              "fulcrum_train --metrics_file of a --plugins=prune run whose per-layer densities at "
              "each pruning step give the pruning case (default: tools/profiles/prune.jsonl).");
DEFINE_string(sparse_attention_metrics, "",
              "fulcrum_train --metrics_file of a --plugins=sparse_attention run whose per-layer "
              "score densities give the sparse-attention case (default: "
              "tools/profiles/sparse_attention.jsonl).");
DEFINE_string(strategies, "", "Strategies to compare, comma-separated names (default: all six: "
              "uniform, params, partition-time, diffusion-time, partition-params, diffusion-params).");
DEFINE_int64(iterations, 100, "Simulated iterations per case (each case maps its schedule onto them).");
DEFINE_int32(stages, 0,
             "Pipeline stages (0: the case's, or the trace's). Without --microbatches it also "
             "sets the micro-batch count: 4 per stage for a case, the trace's micro-batches per "
             "stage (rounded up) for a trace.");
DEFINE_int32(microbatches, 0,
             "Micro-batches per iteration (0: 4 per stage for a case or --schedules, the trace's "
             "for a trace; both at --stages when given).");
DEFINE_string(schedule, "", "Schedule: 1f1b, zbh1, zbh2, zbv (empty: zbh1 for cases, the trace's).");
DEFINE_int64(case_layers, 0,
             "Transformer layers of a case's model (0: the case's own, 32 or 48; with --schedules, "
             "4 per stage, so that each of 2 virtual stages has layers to move).");
DEFINE_bool(schedules, false,
            "Instead of --case/--trace: compare 1F1B, ZB-H1, interleaved 1F1B and ZB-H1 (2 chunks "
            "per stage) and ZB-V at unit costs and at the dense GPT's costs, with the layers spread uniformly "
            "over the virtual stages (not balanced), at 16 and 24 stages (or --stages), "
            "--microbatches (0: 4 per stage). With --case, then each case's dynamic costs under "
            "1F1B, ZB-H1, interleaved 1F1B and ZB-V, uniform and balanced (Partition, Diffusion).");
DEFINE_int32(rebalance_interval, 1, "Balancers decide every this many iterations (and after a change).");
DEFINE_double(rebalance_min_gain, 0.05, "Balancers' minimum predicted gain (hysteresis).");
DEFINE_int32(rebalance_window, 3, "Balancers' median window of measured iterations.");
DEFINE_double(p2p_bandwidth_gbps, 50, "Point-to-point bandwidth between stages, GB/s.");
DEFINE_double(p2p_latency_us, 10, "Point-to-point latency, µs.");
DEFINE_double(p2p_bytes, -1, "Bytes of one activation transfer (-1: the case's bf16 activation; "
              "0 for traces unless given).");
DEFINE_double(migration_bandwidth_gbps, 50, "Layer migration bandwidth, GB/s.");
DEFINE_double(migration_latency_us, 10, "Layer migration latency per layer, µs.");
DEFINE_double(device_tflops, 400, "Assumed sustained TFLOP/s per GPU of the cases' FLOP model.");
DEFINE_int64(vocab, 50304,
             "Vocabulary of the cases' GPT: its LM head (2·b·s·h·V FLOPs in each of F, B, W) sits on "
             "the last stage; 0 leaves the head's cost out (as if it were spread over the stages, "
             "e.g. vocabulary parallelism), isolating the dynamism's own imbalance.");
DEFINE_int64(scale_layers, 0, "Scale a trace to this many layers (NOTE [trace scaling]).");
DEFINE_int64(scale_hidden, 0, "...and this hidden size (needs --trace_hidden, --trace_seq).");
DEFINE_int64(trace_hidden, 0, "Hidden size of the traced model (for scaling).");
DEFINE_int64(trace_seq, 0, "Sequence length of the traced model (for scaling).");
DEFINE_bool(repack, false,
            "Also show the stages (GPUs) over time that re-packing keeps: fulcrum_train's "
            "--repack=auto decision on each iteration of the best balanced run.");
DEFINE_double(repack_slack, 0.05,
              "Re-packing may raise the predicted iteration time by at most this fraction "
              "(--repack_max_slowdown).");
DEFINE_bool(per_iteration, false, "Print every iteration of every strategy.");
DEFINE_string(output, "", "Write per-iteration results as JSON lines here (for fulcrum_plot), "
              "atomically and only when every simulation succeeded; never onto an input.");

namespace fulcrum {
namespace {

constexpr int kUsageError = 2;
using dynamic::Placement;
using dynamic::SimulatedRun;

std::string Ranges(const Placement& p) { return dynamic::FormatPlacement(p); }

dynamic::BalancerOptions Options() {
  dynamic::BalancerOptions o;
  o.interval = FLAGS_rebalance_interval;
  o.min_gain = FLAGS_rebalance_min_gain;
  o.load.window = FLAGS_rebalance_window;
  return o;
}

// The strategies of --strategies; InvalidArgument naming an unknown one.
// The strategies `names` names (comma-separated --strategies keys); all six when empty.
absl::StatusOr<std::vector<dynamic::Strategy>> StrategiesNamed(const std::string& names) {
  std::vector<dynamic::Strategy> all = dynamic::StandardStrategies();
  const std::vector<std::string> keys = {"uniform", "params", "partition-time", "diffusion-time",
                                         "partition-params", "diffusion-params"};
  if (names.empty()) return all;
  std::vector<dynamic::Strategy> out;
  for (absl::string_view name : absl::StrSplit(names, ',')) {
    auto it = std::find(keys.begin(), keys.end(), name);
    if (it == keys.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--strategies: '", name, "' is not one of ",
                                                     absl::StrJoin(keys, ", ")));
    }
    out.push_back(all[it - keys.begin()]);
  }
  return out;
}

absl::StatusOr<std::vector<dynamic::Strategy>> Strategies() { return StrategiesNamed(FLAGS_strategies); }

// The stages re-packing keeps over `balanced` (dynamic::RepackedStages: fulcrum_train's
// --repack=auto decision on each iteration's placement and costs, --repack_slack as the
// allowed slowdown): their mean and the series "iterations a-b: k".
std::pair<double, std::string> Repack(const dynamic::Scenario& s, const SimulatedRun& balanced) {
  dynamic::RepackOptions options;
  options.max_slowdown = FLAGS_repack_slack;
  const absl::StatusOr<std::vector<int>> stages = dynamic::RepackedStages(s, balanced, options);
  if (!stages.ok() || stages->empty()) {
    return {0.0, stages.ok() ? "no iterations" : std::string(stages.status().message())};
  }
  double sum = 0;
  std::string series;
  int64_t from = balanced.iterations.front().iteration;
  for (size_t i = 0; i < stages->size(); ++i) {
    sum += (*stages)[i];
    const bool last = i + 1 == stages->size();
    if (last || (*stages)[i + 1] != (*stages)[i]) {
      const int64_t to = balanced.iterations[i].iteration;
      absl::StrAppend(&series, series.empty() ? "" : ", ", from, "-", to, ": ", (*stages)[i]);
      if (!last) from = balanced.iterations[i + 1].iteration;
    }
  }
  return {sum / static_cast<double>(stages->size()), series};
}

// Appends the JSON lines of `run` to `out` (null: no --output).
void WriteOutput(std::string* out, const std::string& scenario, const SimulatedRun& run) {
  if (out == nullptr) return;
  for (const dynamic::SimulatedIteration& it : run.iterations) {
    nlohmann::json ranges = nlohmann::json::array();
    for (const dynamic::StageRange& r : it.placement) ranges.push_back({r.begin, r.end});
    nlohmann::json line = {{"source", "fulcrum_sim"},  {"scenario", scenario},
                           {"strategy", run.strategy}, {"iteration", it.iteration},
                           {"stage_ranges", ranges},   {"stage_ms", it.stage_busy_ms},
                           {"bubble_ratio", it.bubble_ratio}, {"iteration_ms", it.iteration_ms},
                           {"layers_moved", it.layers_moved}, {"bytes_migrated", it.bytes_migrated}};
    if (!it.note.empty()) line["note"] = it.note;
    absl::StrAppend(out, line.dump(), "\n");
  }
}

void PrintIterations(const SimulatedRun& run) {
  std::printf("  %s, per iteration (simulated): iteration | ran on | bubble | ms | moved (bytes)\n",
              run.strategy.c_str());
  for (const dynamic::SimulatedIteration& it : run.iterations) {
    std::printf("    %4lld  %s  %.3f  %.2f  %lld (%.0f)%s%s\n", static_cast<long long>(it.iteration),
                Ranges(it.placement).c_str(), it.bubble_ratio, it.iteration_ms,
                static_cast<long long>(it.layers_moved), it.bytes_migrated,
                it.note.empty() ? "" : "  ", it.note.c_str());
  }
}

// Runs every strategy on `s`; prints a line each; returns the runs (by strategy name).
absl::StatusOr<std::vector<SimulatedRun>> RunAll(const dynamic::Scenario& s, std::string* out) {
  std::vector<SimulatedRun> runs;
  absl::StatusOr<std::vector<dynamic::Strategy>> strategies = Strategies();
  if (!strategies.ok()) return strategies.status();  // CheckFlags found it first.
  for (const dynamic::Strategy& strategy : *strategies) {
    absl::StatusOr<SimulatedRun> run = dynamic::SimulateRun(s, strategy, Options());
    if (!run.ok()) return run.status();
    WriteOutput(out, s.name, *run);
    runs.push_back(*std::move(run));
  }
  return runs;
}

void PrintRuns(const std::vector<SimulatedRun>& runs, double tokens_per_iteration) {
  for (const SimulatedRun& r : runs) {
    std::printf("  %-20s %10.1f ms  bubble %.3f  %7.3f it/s%s  moved %4lld layers (%.2f GB)  "
                "decisions %.2f ms  migration %.2f ms  final %s\n",
                r.strategy.c_str(), r.total_ms, r.mean_bubble_ratio, r.iterations_per_second(),
                tokens_per_iteration > 0
                    ? absl::StrFormat("  %9.0f tok/s", tokens_per_iteration * r.iterations_per_second()).c_str()
                    : "",
                static_cast<long long>(r.layers_moved), r.bytes_migrated / 1e9, r.decision_ms,
                r.migration_ms, Ranges(r.iterations.back().next_placement).c_str());
    if (FLAGS_per_iteration) PrintIterations(r);
  }
}

// A static placement (uniform, params), or a balancer deciding on measured times.
bool IsStatic(const SimulatedRun& r) {
  return r.strategy.rfind("uniform", 0) == 0 || r.strategy.rfind("params", 0) == 0;
}
bool BalancesByTime(const SimulatedRun& r) {
  return r.strategy.find("by time") != std::string::npos;
}

const SimulatedRun* Best(const std::vector<SimulatedRun>& runs, bool is_static) {
  const SimulatedRun* best = nullptr;
  for (const SimulatedRun& r : runs) {
    const bool r_static = IsStatic(r);
    if (r_static != is_static) continue;
    if (!is_static && !BalancesByTime(r)) continue;
    if (best == nullptr || r.total_ms < best->total_ms) best = &r;
  }
  return best;
}

// OK when `s` can be simulated: its schedule exists for its stages and micro-batches, and
// every stage gets a layer. Checked before the work, so a bad layout is a usage error.
absl::Status CheckScenario(const dynamic::Scenario& s) {
  if (absl::StatusOr<pipeline::Schedule> schedule =
          pipeline::MakeSchedule(s.schedule, s.num_stages, s.num_microbatches);
      !schedule.ok()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("schedule '%s' with %d stages and %d micro-batches (--schedule, --stages, "
                        "--microbatches): %s",
                        s.schedule, s.num_stages, s.num_microbatches, schedule.status().message()));
  }
  const int64_t layers = s.costs(1).num_layers();
  if (layers < s.num_stages) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d layers cannot fill %d stages (--stages): every stage needs a layer", layers,
        s.num_stages));
  }
  return absl::OkStatus();
}

// A measured input of the cases: loaded from `path` when the flag `flag` gives one (an error
// names the flag), else the profile compiled in (parsed only then); `*source` says which.
template <typename T, typename Load>
absl::Status MeasuredInput(const char* flag, const std::string& path, Load load,
                           const sim::Measured<T>& (*compiled)(), T* value, std::string* source) {
  if (path.empty()) {
    *value = compiled().value;
    *source = compiled().source;
    return absl::OkStatus();
  }
  absl::StatusOr<T> loaded = load(path);
  if (!loaded.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", loaded.status().message()));
  }
  *value = *std::move(loaded);
  *source = path;
  return absl::OkStatus();
}

// NOTE [three numbers]
// DynMo's table mixes two kinds of figure (issue 25): its MoE and MoD speedups are what
// balancing alone gains on the same dynamic model (their idle fractions give them:
// (1−0.08)/(1−0.25) = 1.23), its pruning, freezing, sparse-attention and early-exit figures
// also count the dynamism's own saving against a dense model. Each case here prints both:
//   S_bal   = T(best static placement, dynamic costs) / T(best time balancer, same costs)
//   S_dyn   = T(best static, dense model) / T(best static, dynamic costs)
//   S_total = S_bal × S_dyn = T(best static, dense) / T(best balancer, dynamic)
// and the bound of S_bal, T(best static) / T(oracle) (NOTE [oracle placement] in
// dynamic/simulation.cc), beside DynMo's figure and the name of the one it compares to.
// The cases' options from the flags; the measured inputs (--moe_metrics,
// --early_exit_metrics, --prune_metrics, --sparse_attention_metrics) read here: a bad one is
// a usage error naming it.
absl::StatusOr<sim::CaseOptions> CaseOptionsFromFlags() {
  sim::CaseOptions options;
  options.iterations = FLAGS_iterations;
  options.num_stages = FLAGS_stages;
  options.num_microbatches = FLAGS_microbatches;
  options.layers = FLAGS_case_layers;
  options.moe_amplitude = FLAGS_moe_amplitude;
  if (!FLAGS_schedule.empty()) options.schedule = FLAGS_schedule;
  options.shape.device_tflops = FLAGS_device_tflops;
  options.shape.vocab = FLAGS_vocab;
  options.network.p2p_bandwidth_gbps = FLAGS_p2p_bandwidth_gbps;
  options.network.p2p_latency_us = FLAGS_p2p_latency_us;
  options.network.migration_bandwidth_gbps = FLAGS_migration_bandwidth_gbps;
  options.network.migration_latency_us = FLAGS_migration_latency_us;
  // Each measured input from its flag's file, else the profile compiled in.
  if (absl::Status s = MeasuredInput("--moe_metrics", FLAGS_moe_metrics, sim::LoadExpertImbalance,
                                     sim::MeasuredExpertImbalance, &options.expert_imbalance,
                                     &options.expert_imbalance_source);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = MeasuredInput("--early_exit_metrics", FLAGS_early_exit_metrics,
                                     sim::LoadExitFractions, sim::MeasuredExitFractions,
                                     &options.exit_fractions, &options.exit_fractions_source);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = MeasuredInput("--prune_metrics", FLAGS_prune_metrics, sim::LoadPruneProfile,
                                     sim::MeasuredPruneProfile, &options.prune_profile,
                                     &options.prune_profile_source);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = MeasuredInput("--sparse_attention_metrics", FLAGS_sparse_attention_metrics,
                                     sim::LoadAttentionDensity, sim::MeasuredAttentionDensity,
                                     &options.attention_density,
                                     &options.attention_density_source);
      !s.ok()) {
    return s;
  }
  return options;
}

std::vector<std::string> CaseNamesFromFlag() {
  if (FLAGS_case == "all") return sim::CaseNames();
  return absl::StrSplit(FLAGS_case, ',');
}

// A case built and, where measured, its scenario checked: InvalidArgument naming it
// otherwise (a usage error, found before any work).
absl::StatusOr<sim::NamedCase> CheckedCase(const std::string& name, const sim::CaseOptions& options) {
  absl::StatusOr<sim::NamedCase> made = sim::MakeCase(name, options);
  if (!made.ok() || !made->measured) return made;
  if (absl::Status st = CheckScenario(made->scenario); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat("--case=%s at %d stages: %s", name,
                                                      made->scenario.num_stages, st.message()));
  }
  return made;
}

// The per-phase rows of a case (NOTE [three numbers], per phase): each phase's best static
// and best time-balanced run are chosen on the phase's own iterations (so a phase row may
// name other strategies than the whole run's), the balanced runs as they ran through the
// phases before (their placement on entering a phase is what the phase before left), the
// oracle's iterations the bound; `dense_per_iteration` the dense model's best static time.
std::vector<std::string> PhaseRows(const sim::NamedCase& c, const std::vector<SimulatedRun>& runs,
                                   const SimulatedRun& oracle, double dense_per_iteration) {
  std::vector<std::string> rows;
  for (const sim::CasePhase& phase : c.phases) {
    std::optional<sim::PhaseSlice> fixed, balanced;
    for (const SimulatedRun& r : runs) {
      const bool is_static = IsStatic(r);
      if (!is_static && !BalancesByTime(r)) continue;
      const sim::PhaseSlice slice = sim::SliceOf(r, phase);
      std::optional<sim::PhaseSlice>& best = is_static ? fixed : balanced;
      if (!best || slice.ms < best->ms) best = slice;
    }
    if (!fixed || !balanced || balanced->ms <= 0) continue;
    const sim::PhaseSlice bound = sim::SliceOf(oracle, phase);
    const double n = static_cast<double>(phase.last - phase.first + 1);
    std::string s_dyn = "  -  ", s_total = "  -  ";
    if (dense_per_iteration > 0) {
      s_dyn = absl::StrFormat("%5.2fx", dense_per_iteration * n / fixed->ms);
      s_total = absl::StrFormat("%5.2fx", dense_per_iteration * n / balanced->ms);
    }
    rows.push_back(absl::StrFormat(
        "  %-15s idle %4.1f%% -> %4.1f%% (oracle %4.1f%%)  S_bal %5.2fx (bound %5.2fx)  S_dyn %s  "
        "S_total %s  (iterations %lld-%lld)",
        phase.label, 100 * fixed->bubble, 100 * balanced->bubble, 100 * bound.bubble,
        fixed->ms / balanced->ms, fixed->ms / bound.ms, s_dyn, s_total,
        static_cast<long long>(phase.first), static_cast<long long>(phase.last)));
  }
  return rows;
}

// The time of the best static placement (uniform or by parameters) of the case's dense
// model; 0 when neither simulates.
double BestStaticDenseMs(const sim::NamedCase& c, const sim::CaseOptions& options) {
  const dynamic::Scenario dense = sim::DenseScenario(c, options);
  double best = 0;
  for (int k : {0, 1}) {
    absl::StatusOr<SimulatedRun> d = dynamic::SimulateRun(dense, dynamic::StandardStrategies()[k], Options());
    if (d.ok() && (best == 0 || d->total_ms < best)) best = d->total_ms;
  }
  return best;
}

// One case of the DynMo table: its runs printed, its row (and its phases' rows) appended to
// `table`. An error names the case.
absl::Status SimulateCase(const sim::NamedCase& c, const sim::CaseOptions& options,
                          std::string* out, std::vector<std::string>* table) {
  const std::string& name = c.name;
  std::printf("\n== %s\n", name.c_str());
  if (!c.measured) {
    std::printf("  %s\n", c.why_not.c_str());
    table->push_back(absl::StrFormat("%-17s %-52s | DynMo: %s", name,
                                     "NOT MEASURED YET (see above)", c.dynmo));
    return absl::OkStatus();
  }
  std::printf("  %d stages, %lld layers, %d micro-batches, %s. Costs: %s\n", c.scenario.num_stages,
              static_cast<long long>(c.scenario.costs(1).num_layers()), c.scenario.num_microbatches,
              c.scenario.schedule.c_str(), c.provenance.c_str());
  absl::StatusOr<std::vector<SimulatedRun>> runs = RunAll(c.scenario, out);
  if (!runs.ok()) return absl::InternalError(absl::StrCat(name, ": ", runs.status().message()));
  PrintRuns(*runs, c.scenario.tokens_per_iteration);
  const SimulatedRun* fixed = Best(*runs, true);
  const SimulatedRun* balanced = Best(*runs, false);
  if (fixed == nullptr || balanced == nullptr) return absl::OkStatus();
  // Issue 25's three numbers (NOTE [three numbers] above RunCases).
  absl::StatusOr<SimulatedRun> oracle =
      dynamic::SimulateRun(c.scenario, dynamic::OracleStrategy(), Options());
  if (!oracle.ok()) {
    return absl::InternalError(absl::StrCat(name, ": oracle: ", oracle.status().message()));
  }
  std::printf("  %-20s %10.1f ms  bubble %.3f  (each iteration on its own best placement, moved "
              "for free: the bound of S_bal)\n",
              "oracle", oracle->total_ms, oracle->mean_bubble_ratio);
  const double s_bal = fixed->total_ms / balanced->total_ms;
  const double s_bal_bound = fixed->total_ms / oracle->total_ms;
  std::string s_dyn = "  -  ", s_total = "  -  ";
  const double dense_static = c.versus_dense ? BestStaticDenseMs(c, options) : 0;
  if (dense_static > 0) {
    s_dyn = absl::StrFormat("%5.2fx", dense_static / fixed->total_ms);
    s_total = absl::StrFormat("%5.2fx", dense_static / balanced->total_ms);
    std::printf("  dense model, best static placement: %.1f ms\n", dense_static);
  }
  std::string gpus = "-";
  double gpus_after = c.scenario.num_stages;
  if (FLAGS_repack) {
    const auto [mean, series] = Repack(c.scenario, *balanced);
    gpus = absl::StrFormat("%.1f", mean);
    gpus_after = mean;
    std::printf("  re-packed stages over iterations (the --repack=auto decision, slowdown <= %.0f%%): %s; "
                "mean %.1f of %d\n",
                100 * FLAGS_repack_slack, series.c_str(), mean, c.scenario.num_stages);
  }
  const double overhead = balanced->total_ms > 0
                              ? 100 * (balanced->decision_ms + balanced->migration_ms) / balanced->total_ms
                              : 0;
  const double tokens_per_gpu =
      c.scenario.tokens_per_iteration * balanced->iterations_per_second() / gpus_after;
  table->push_back(absl::StrFormat(
      "%-17s idle %4.1f%% -> %4.1f%% (oracle %4.1f%%)  S_bal %5.2fx (bound %5.2fx)  S_dyn %s  "
      "S_total %s  GPUs %2d -> %-4s %7.0f tok/s/GPU  ovh %4.2f%% | DynMo: %s -- compare: %s",
      name, 100 * fixed->mean_bubble_ratio, 100 * balanced->mean_bubble_ratio,
      100 * oracle->mean_bubble_ratio, s_bal, s_bal_bound, s_dyn, s_total,
      c.scenario.num_stages, gpus, tokens_per_gpu, overhead, c.dynmo, c.dynmo_compares));
  std::printf("  best static: %s; best balanced: %s (decisions %.1f ms measured, migration %.1f ms "
              "= bytes / bandwidth)\n",
              fixed->strategy.c_str(), balanced->strategy.c_str(), balanced->decision_ms,
              balanced->migration_ms);
  const double iterations = static_cast<double>(fixed->iterations.size());
  const double dense_per_iteration = iterations > 0 ? dense_static / iterations : 0;
  for (std::string& row : PhaseRows(c, *runs, *oracle, dense_per_iteration)) {
    table->push_back(std::move(row));
  }
  return absl::OkStatus();
}

int RunCases(std::string* out) {
  absl::StatusOr<sim::CaseOptions> made_options = CaseOptionsFromFlags();
  if (!made_options.ok()) {
    std::fprintf(stderr, "%s\n", std::string(made_options.status().message()).c_str());
    return kUsageError;
  }
  const sim::CaseOptions& options = *made_options;
  const std::vector<std::string> names = CaseNamesFromFlag();
  // Every case is built and checked before any is simulated: a bad name or layout is a
  // usage error, found before the work.
  std::vector<sim::NamedCase> cases;
  for (const std::string& name : names) {
    absl::StatusOr<sim::NamedCase> made = CheckedCase(name, options);
    if (!made.ok()) {
      std::fprintf(stderr, "%s\n", std::string(made.status().message()).c_str());
      return kUsageError;
    }
    cases.push_back(*std::move(made));
  }
  std::vector<std::string> table;
  const auto start = std::chrono::steady_clock::now();
  std::printf("fulcrum_sim: SIMULATED, not measured on GPUs. GPT hidden %lld, %lld heads, seq %lld, "
              "micro-batch %lld, vocab %lld; %lld simulated iterations per case; %s; %.0f TFLOP/s "
              "assumed; p2p %.0f GB/s + %.0f us; migration %.0f GB/s\n",
              static_cast<long long>(options.shape.hidden), static_cast<long long>(options.shape.heads),
              static_cast<long long>(options.shape.seq_length),
              static_cast<long long>(options.shape.micro_batch), static_cast<long long>(options.shape.vocab),
              static_cast<long long>(options.iterations), options.schedule.c_str(),
              options.shape.device_tflops, options.network.p2p_bandwidth_gbps,
              options.network.p2p_latency_us, options.network.migration_bandwidth_gbps);
  for (const sim::NamedCase& c : cases) {
    if (absl::Status s = SimulateCase(c, options, out, &table); !s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  std::printf(
      "\nDynMo table (SIMULATED; idle = mean idle fraction of the stages, best static -> best "
      "time balancer (the oracle's); S_bal = T(best static) / T(best balanced), both on the "
      "dynamic costs, bound = T(best static) / T(oracle); S_dyn = T(dense, best static) / "
      "T(dynamic, best static): the dynamism's own saving; S_total = S_bal x S_dyn; tok/s/GPU "
      "of the balanced run on the GPUs it keeps; ovh = decision time measured + migration "
      "bytes / bandwidth, of the balanced run's time; 'compare' names which of ours DynMo's "
      "figure measures; the indented rows below a case are its phases, the same runs' "
      "iterations in each, best static and best balanced chosen per phase):\n");
  for (const std::string& row : table) std::printf("  %s\n", row.c_str());
  std::printf("(%.1f s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}

int RunTrace(std::string* out) {
  absl::StatusOr<dynamic::LoadTrace> trace = dynamic::ReadLoadTrace(FLAGS_trace);
  if (!trace.ok()) {
    std::fprintf(stderr, "--trace: %s\n", std::string(trace.status().message()).c_str());
    return kUsageError;
  }
  dynamic::Scenario s = dynamic::ScenarioFromTrace(*trace, FLAGS_trace);
  s.network.p2p_bandwidth_gbps = FLAGS_p2p_bandwidth_gbps;
  s.network.p2p_latency_us = FLAGS_p2p_latency_us;
  s.network.p2p_bytes = std::max(0.0, FLAGS_p2p_bytes);
  s.network.migration_bandwidth_gbps = FLAGS_migration_bandwidth_gbps;
  s.network.migration_latency_us = FLAGS_migration_latency_us;
  const bool scaled = FLAGS_scale_layers > 0 || FLAGS_scale_hidden > 0 || FLAGS_stages > 0;
  if (FLAGS_scale_layers > 0 || FLAGS_scale_hidden > 0) {
    if (FLAGS_trace_hidden <= 0 || FLAGS_trace_seq <= 0) {
      std::fprintf(stderr, "--scale_layers/--scale_hidden need --trace_hidden and --trace_seq "
                           "(the traced model's hidden size and sequence length)\n");
      return kUsageError;
    }
    const int64_t layers = FLAGS_scale_layers > 0 ? FLAGS_scale_layers : trace->num_layers();
    const int64_t hidden = FLAGS_scale_hidden > 0 ? FLAGS_scale_hidden : FLAGS_trace_hidden;
    auto base = s.costs;
    const int64_t from_hidden = FLAGS_trace_hidden, seq = FLAGS_trace_seq;
    s.costs = [base, from_hidden, layers, hidden, seq](int64_t i) {
      return dynamic::ScaleCosts(base(i), from_hidden, layers, hidden, seq);
    };
  }
  if (scaled) s.initial_placement.clear();  // Another layout: start from the even split.
  if (FLAGS_stages > 0 && FLAGS_stages != s.num_stages && FLAGS_microbatches == 0) {
    // The trace's micro-batch count belongs to its stage count: keep its micro-batches per
    // stage (what fills the pipeline, and so its bubble) on the new count, as a case keeps
    // "4 per stage"; rounded up, never fewer per stage than the trace ran.
    const int64_t traced = s.num_microbatches;
    s.num_microbatches = static_cast<int>(
        (traced * FLAGS_stages + s.num_stages - 1) / s.num_stages);
  }
  if (FLAGS_stages > 0) s.num_stages = FLAGS_stages;
  if (FLAGS_microbatches > 0) s.num_microbatches = FLAGS_microbatches;
  if (!FLAGS_schedule.empty()) s.schedule = FLAGS_schedule;
  if (absl::Status st = CheckScenario(s); !st.ok()) {
    std::fprintf(stderr, "--trace=%s: %s\n", FLAGS_trace.c_str(), std::string(st.message()).c_str());
    return kUsageError;
  }
  std::printf("fulcrum_sim: replay of %s (SIMULATED from measured per-layer costs): %lld "
              "iterations, %d stages, %lld layers, %d micro-batches, %s; live rebalancer '%s'\n",
              FLAGS_trace.c_str(), static_cast<long long>(s.iterations), s.num_stages,
              static_cast<long long>(s.costs(1).num_layers()), s.num_microbatches, s.schedule.c_str(),
              trace->lines[0].rebalancer.c_str());
  absl::StatusOr<std::vector<SimulatedRun>> runs = RunAll(s, out);
  if (!runs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(runs.status().message()).c_str());
    return 1;
  }
  PrintRuns(*runs, 0);
  if (FLAGS_repack) {
    const SimulatedRun* balanced = Best(*runs, false);
    if (balanced != nullptr) {
      const auto [mean, series] = Repack(s, *balanced);
      std::printf("  re-packed stages over iterations: %s; mean %.1f of %d\n", series.c_str(), mean,
                  s.num_stages);
    }
  }
  if (scaled) return 0;
  // Validation: the strategy the live run used, against what the run measured.
  const std::string live = trace->lines[0].rebalancer;
  const SimulatedRun* same = nullptr;
  for (const SimulatedRun& r : *runs) {
    if ((live == "none" && r.strategy.rfind("uniform", 0) == 0) ||
        (live != "none" && r.strategy == live + " by time")) {
      same = &r;
    }
  }
  if (same == nullptr) return 0;
  int agree = 0;
  std::vector<double> step;
  double predicted = 0, measured = 0, bubble_p = 0, bubble_m = 0;
  for (size_t k = 0; k < trace->lines.size(); ++k) {
    const dynamic::TraceLine& line = trace->lines[k];
    const dynamic::SimulatedIteration& it = same->iterations[k];
    // Line k: what iteration k ran on, and Plan(k+1)'s decision (simulated iteration k+1's).
    const bool decided_alike = k + 1 >= trace->lines.size() ||
                               same->iterations[k + 1].next_placement == line.decision;
    if (it.placement == line.ran_on && decided_alike) ++agree;
    step.push_back(line.iteration_ms - line.pipeline_ms);
  }
  std::sort(step.begin(), step.end());
  const double step_ms = step[step.size() / 2];
  std::printf("\nvalidation against the live run (%s): placements and decisions agree in %d of %zu "
              "iterations\n  iteration  ran on  predicted pipeline ms / measured | predicted bubble / "
              "measured | predicted iteration ms (+%.1f ms step, median measured) / measured\n",
              same->strategy.c_str(), agree, trace->lines.size(), step_ms);
  for (size_t k = 0; k < trace->lines.size(); ++k) {
    const dynamic::TraceLine& line = trace->lines[k];
    const dynamic::SimulatedIteration& it = same->iterations[k];
    if (k > 0) {  // The first iteration includes start-up.
      predicted += it.makespan_ms;
      measured += line.pipeline_ms;
      bubble_p += it.bubble_ratio;
      bubble_m += line.bubble_ratio;
    }
    if (FLAGS_per_iteration || k < 3 || k + 3 >= trace->lines.size()) {
      std::printf("  %5lld  %s  %8.1f / %8.1f | %.3f / %.3f | %8.1f / %8.1f\n",
                  static_cast<long long>(line.iteration), Ranges(line.ran_on).c_str(), it.makespan_ms,
                  line.pipeline_ms, it.bubble_ratio, line.bubble_ratio, it.makespan_ms + step_ms,
                  line.iteration_ms);
    }
  }
  const double n = static_cast<double>(trace->lines.size() - 1);
  if (n > 0) {
    std::printf("  mean over iterations 2..%zu: pipeline %.1f predicted / %.1f measured ms (%+.1f%%); "
                "bubble %.3f / %.3f (%+.1f%%)\n",
                trace->lines.size(), predicted / n, measured / n, 100 * (predicted / measured - 1),
                bubble_p / n, bubble_m / n, 100 * (bubble_p / bubble_m - 1));
  }
  return 0;
}

// --schedules. NOTE [schedule comparison]: every schedule runs the same model — the dense GPT
// of the cases (NOTE [sim FLOP model]), --vocab's head on the last virtual stage — cut into
// p·v contiguous pieces of equal layer counts (UniformPlacement over the virtual stages; a
// balancer would move them), so a chunk of a 2-chunk schedule costs about half a stage.
// "unit" gives each whole stage F = B = W = 1 (a chunk 1/v of it) and no transfer time,
// the setting of the schedules' closed forms. The bubble is the mean over the stages of
// idle / makespan; activations are the most any stage holds, in whole-stage micro-batches
// (chunk micro-batches / v).
struct ScheduleRow {
  std::string label;
  std::string name;
  int chunks = 1;
};

struct ScheduleFigures {
  double makespan = 0;
  double bubble = 0;
  double activations = 0;
};

ScheduleFigures Figures(const pipeline::Schedule& schedule,
                        const std::vector<pipeline::ActionCosts>& costs) {
  const pipeline::SimulationResult result = pipeline::Simulate(schedule, costs);
  ScheduleFigures f;
  f.makespan = result.makespan;
  int peak = 0;
  for (int s = 0; s < schedule.num_stages; ++s) {
    f.bubble += result.BubbleRatio(s) / schedule.num_stages;
    peak = std::max(peak, pipeline::PeakInFlight(schedule, s));
  }
  f.activations = static_cast<double>(peak) / schedule.num_chunks;
  return f;
}

int RunScheduleCases(const std::vector<int>& stage_counts);

int RunSchedules() {
  sim::GptShape shape;
  shape.device_tflops = FLAGS_device_tflops;
  shape.vocab = FLAGS_vocab;
  const dynamic::IterationCosts dense = sim::DenseCosts(shape);
  dynamic::NetworkOptions network;
  network.p2p_bandwidth_gbps = FLAGS_p2p_bandwidth_gbps;
  network.p2p_latency_us = FLAGS_p2p_latency_us;
  network.p2p_bytes = FLAGS_p2p_bytes >= 0
                          ? FLAGS_p2p_bytes
                          : static_cast<double>(shape.micro_batch * shape.seq_length * shape.hidden) *
                                shape.bytes_per_activation;
  const std::vector<ScheduleRow> rows = {{"1F1B", "1f1b", 1},
                                         {"ZB-H1", "zbh1", 1},
                                         {"interleaved 1F1B", "1f1b", 2},
                                         {"interleaved ZB-H1", "zbh1", 2},
                                         {"ZB-V", "zbv", 2},
                                         {"ZB-V at costs", "zbv-at-costs", 2}};
  std::vector<int> stage_counts = {16, 24};
  if (FLAGS_stages > 0) stage_counts = {FLAGS_stages};
  std::printf("fulcrum_sim --schedules: SIMULATED, not measured on GPUs. Dense GPT, %lld layers, "
              "hidden %lld, seq %lld, micro-batch %lld, vocab %lld, %.0f TFLOP/s assumed, p2p %.3f "
              "ms; layers uniform over the virtual stages (unbalanced)\n",
              static_cast<long long>(shape.layers), static_cast<long long>(shape.hidden),
              static_cast<long long>(shape.seq_length), static_cast<long long>(shape.micro_batch),
              static_cast<long long>(shape.vocab), shape.device_tflops, network.P2pMs());
  for (int p : stage_counts) {
    const int m = FLAGS_microbatches > 0 ? FLAGS_microbatches : 4 * p;
    std::printf("\n== %d stages, %d micro-batches\n", p, m);
    std::printf("  %-17s %2s | %-26s | %-28s | %s\n", "schedule", "v",
                "unit costs: makespan bubble", "dense GPT: makespan ms bubble",
                "activations (stage micro-batches)");
    for (const ScheduleRow& row : rows) {
      // "ZB-V at costs": ZB-V's greedy run at the dense model's mean chunk costs and transfer
      // time (pipeline::ZeroBubbleVAt), as its authors build theirs from profiled costs; its
      // unit-cost column is the plain ZB-V's.
      const bool at_costs = row.name == "zbv-at-costs";
      absl::StatusOr<pipeline::Schedule> schedule =
          pipeline::MakeSchedule(at_costs ? "zbv" : row.name, p, m, row.chunks);
      if (!schedule.ok()) {
        std::printf("  %-17s %2d | not run: %s\n", row.label.c_str(), row.chunks,
                    std::string(schedule.status().message()).c_str());
        continue;
      }
      const int pieces = p * schedule->num_chunks;
      if (dense.num_layers() < pieces) {
        std::printf("  %-17s %2d | not run: %lld layers cannot fill %d virtual stages\n",
                    row.label.c_str(), schedule->num_chunks,
                    static_cast<long long>(dense.num_layers()), pieces);
        continue;
      }
      const std::vector<pipeline::ActionCosts> unit(
          p, pipeline::ChunkCosts(pipeline::ActionCosts{1, 1, 1}, schedule->num_chunks));
      const ScheduleFigures u = Figures(*schedule, unit);
      const std::vector<pipeline::ActionCosts> dense_costs = dynamic::StageActionCosts(
          dense, dynamic::UniformPlacement(dense.num_layers(), pieces), network.P2pMs());
      if (at_costs) {
        pipeline::ActionCosts mean;
        for (const pipeline::ActionCosts& c : dense_costs) {
          mean.forward += c.forward / pieces;
          mean.backward_input += c.backward_input / pieces;
          mean.backward_weight += c.backward_weight / pieces;
        }
        *schedule = pipeline::ZeroBubbleVAt(p, m, mean.forward, mean.backward_input,
                                            mean.backward_weight, network.P2pMs());
      }
      const ScheduleFigures d = Figures(*schedule, dense_costs);
      std::printf("  %-17s %2d | %10.2f %7.2f%%       | %12.2f %7.2f%%        | %.2f\n",
                  row.label.c_str(), schedule->num_chunks, u.makespan, 100 * u.bubble, d.makespan,
                  100 * d.bubble, d.activations);
    }
  }
  return FLAGS_case.empty() ? 0 : RunScheduleCases(stage_counts);
}

// --schedules --case=NAMES. NOTE [schedules under dynamism]: each named case's dynamic
// costs under the four schedules — 1F1B, ZB-H1 (one chunk per stage), interleaved 1F1B
// and ZB-V (two) — each run uniform (Megatron's split, over the virtual stages where there
// are two) and balanced by Partition and Diffusion on measured time, the balancers moving
// layers between chunks as fulcrum_train does (NOTE [simulation under chunks]). The model
// has 4 layers per stage unless --case_layers says otherwise: at the cases' own 2 per
// stage, a 2-chunk schedule has one layer per virtual stage and nothing to move.
int RunScheduleCases(const std::vector<int>& stage_counts) {
  absl::StatusOr<sim::CaseOptions> made_options = CaseOptionsFromFlags();
  if (!made_options.ok()) {
    std::fprintf(stderr, "%s\n", std::string(made_options.status().message()).c_str());
    return kUsageError;
  }
  const std::vector<ScheduleRow> rows = {{"1F1B", "1f1b", 1},
                                         {"ZB-H1", "zbh1", 1},
                                         {"interleaved 1F1B", "1f1b", 2},
                                         {"ZB-V", "zbv", 2}};
  // The table's three columns, in this order.
  const std::vector<dynamic::Strategy> strategies =
      *StrategiesNamed("uniform,partition-time,diffusion-time");
  // Built and checked before any is simulated: a bad name is a usage error.
  std::vector<std::pair<int, sim::NamedCase>> cases;
  for (const std::string& name : CaseNamesFromFlag()) {
    for (int p : stage_counts) {
      sim::CaseOptions options = *made_options;
      options.num_stages = p;
      if (options.layers == 0) options.layers = 4 * p;
      absl::StatusOr<sim::NamedCase> made = CheckedCase(name, options);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", std::string(made.status().message()).c_str());
        return kUsageError;
      }
      cases.emplace_back(p, *std::move(made));
    }
  }
  std::printf("\nThe cases under each schedule (SIMULATED; %lld iterations; total time of the run, "
              "mean bubble, layers moved; 'balanced/uniform': the better balancer's time over "
              "the uniform split's):\n",
              static_cast<long long>(made_options->iterations));
  for (const auto& [p, c] : cases) {
    if (!c.measured) {
      std::printf("\n== %s: %s\n", c.name.c_str(), c.why_not.c_str());
      continue;
    }
    std::printf("\n== %s at %d stages: %lld layers, %d micro-batches. Costs: %s\n", c.name.c_str(), p,
                static_cast<long long>(c.scenario.costs(1).num_layers()), c.scenario.num_microbatches,
                c.provenance.c_str());
    std::printf("  %-17s %2s | %-22s | %-32s | %-32s | %s\n", "schedule", "v", "uniform: ms bubble",
                "partition by time: ms bubble moved", "diffusion by time: ms bubble moved",
                "balanced/uniform");
    for (const ScheduleRow& row : rows) {
      dynamic::Scenario s = c.scenario;
      s.schedule = row.name;
      s.num_chunks = row.chunks;
      std::vector<SimulatedRun> runs;
      for (const dynamic::Strategy& strategy : strategies) {
        absl::StatusOr<SimulatedRun> run = dynamic::SimulateRun(s, strategy, Options());
        if (!run.ok()) {
          std::fprintf(stderr, "%s, %s, %s: %s\n", c.name.c_str(), row.label.c_str(),
                       strategy.name.c_str(), std::string(run.status().message()).c_str());
          return 1;
        }
        runs.push_back(*std::move(run));
      }
      const double best = std::min(runs[1].total_ms, runs[2].total_ms);
      std::printf("  %-17s %2d | %10.1f %7.2f%%   | %10.1f %7.2f%% %6lld     | %10.1f %7.2f%% %6lld     | "
                  "%.3f\n",
                  row.label.c_str(), row.chunks, runs[0].total_ms, 100 * runs[0].mean_bubble_ratio,
                  runs[1].total_ms, 100 * runs[1].mean_bubble_ratio,
                  static_cast<long long>(runs[1].layers_moved), runs[2].total_ms,
                  100 * runs[2].mean_bubble_ratio, static_cast<long long>(runs[2].layers_moved),
                  best / runs[0].total_ms);
    }
  }
  return 0;
}

// The numeric flags, and --output against the inputs: InvalidArgument naming the first bad
// flag and its value, before any work.
absl::Status CheckFlags() {
  auto bad = [](const char* flag, double value, const char* expected) {
    return absl::InvalidArgumentError(absl::StrFormat("--%s=%g: expected %s", flag, value, expected));
  };
  if (FLAGS_iterations < 3) return bad("iterations", FLAGS_iterations, "an integer >= 3");
  if (!(std::isfinite(FLAGS_moe_amplitude) && FLAGS_moe_amplitude >= 0)) {
    return bad("moe_amplitude", FLAGS_moe_amplitude, "a finite value >= 0");
  }
  for (const auto& [flag, value] :
       {std::pair{"stages", FLAGS_stages}, std::pair{"microbatches", FLAGS_microbatches}}) {
    if (value < 0) return bad(flag, value, "an integer >= 0 (0: the case's or the trace's)");
  }
  for (const auto& [flag, value] : {std::pair{"vocab", FLAGS_vocab},
                                    std::pair{"case_layers", FLAGS_case_layers},
                                    std::pair{"scale_layers", FLAGS_scale_layers},
                                    std::pair{"scale_hidden", FLAGS_scale_hidden},
                                    std::pair{"trace_hidden", FLAGS_trace_hidden},
                                    std::pair{"trace_seq", FLAGS_trace_seq}}) {
    if (value < 0) return bad(flag, static_cast<double>(value), "an integer >= 0");
  }
  for (const auto& [flag, value] :
       {std::pair{"p2p_bandwidth_gbps", FLAGS_p2p_bandwidth_gbps},
        std::pair{"migration_bandwidth_gbps", FLAGS_migration_bandwidth_gbps},
        std::pair{"device_tflops", FLAGS_device_tflops}}) {
    if (!(std::isfinite(value) && value > 0)) return bad(flag, value, "a finite value > 0");
  }
  for (const auto& [flag, value] : {std::pair{"p2p_latency_us", FLAGS_p2p_latency_us},
                                    std::pair{"migration_latency_us", FLAGS_migration_latency_us},
                                    std::pair{"repack_slack", FLAGS_repack_slack}}) {
    if (!(std::isfinite(value) && value >= 0)) return bad(flag, value, "a finite value >= 0");
  }
  if (!(FLAGS_p2p_bytes == -1 || (std::isfinite(FLAGS_p2p_bytes) && FLAGS_p2p_bytes >= 0))) {
    return bad("p2p_bytes", FLAGS_p2p_bytes, "a finite value >= 0, or -1 for the case's");
  }
  if (absl::Status s = Options().Validate(); !s.ok()) return s;
  if (absl::Status s = Strategies().status(); !s.ok()) return s;
  if (FLAGS_output.empty()) return absl::OkStatus();
  for (const auto& [flag, input] : {std::pair{"--trace", FLAGS_trace},
                                    std::pair{"--moe_metrics", FLAGS_moe_metrics},
                                    std::pair{"--early_exit_metrics", FLAGS_early_exit_metrics},
                                    std::pair{"--prune_metrics", FLAGS_prune_metrics},
                                    std::pair{"--sparse_attention_metrics",
                                              FLAGS_sparse_attention_metrics}}) {
    // WriteFileAtomically writes OUTPUT.tmp first: that must not be an input either.
    if (!input.empty() &&
        (IsSameFile(input, FLAGS_output) || IsSameFile(input, FLAGS_output + ".tmp"))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--output=", FLAGS_output, " is the input ", flag, "=", input, "; refusing to overwrite it"));
    }
  }
  if (DefaultFileSystem()->IsDirectory(FLAGS_output)) {
    return absl::InvalidArgumentError(absl::StrCat("--output=", FLAGS_output, " is a directory"));
  }
  if (!DefaultFileSystem()->IsDirectory(DirName(FLAGS_output))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--output=", FLAGS_output, ": the directory '", DirName(FLAGS_output), "' does not exist"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_sim";
  help.usage =
      "fulcrum_sim: the pipeline simulator at scales our machines cannot run. Every figure it\n"
      "prints is SIMULATED (per-layer costs of a named case or of a fulcrum_train --load_trace).\n\n"
      "  fulcrum_sim --case=all                       the DynMo table: its six cases, 16-24 stages\n"
      "  fulcrum_sim --case=pruning --per_iteration   one case, iteration by iteration\n"
      "  fulcrum_sim --trace=run.jsonl                replay a run (and compare with what it measured)\n"
      "  fulcrum_sim --trace=run.jsonl --trace_hidden=128 --trace_seq=128 --scale_layers=48 \\\n"
      "      --scale_hidden=1024 --stages=24          a trace scaled up\n"
      "  fulcrum_sim --schedules                      1F1B, ZB-H1, interleaved 1F1B, ZB-V side by side\n"
      "  fulcrum_sim --schedules --case=moe,freezing  ...and the cases under each, balanced and not\n\n"
      "Give exactly one of --case, --trace and --schedules (--schedules may name cases too).\n"
      "--stages without --microbatches\n"
      "also sets the micro-batch count: 4 per stage for a case (and --schedules), the trace's\n"
      "micro-batches per stage (rounded up) for a trace.\n"
      "Exit status: 0 done, 2 bad flags or inputs (one line, before any work), 1 a simulation or\n"
      "the write of --output failed.\n";
  help.groups = {
      {"What to simulate", {"case", "trace", "schedules", "moe_metrics", "moe_amplitude",
                            "early_exit_metrics",
                            "prune_metrics", "sparse_attention_metrics", "strategies",
                            "iterations", "case_layers"}},
      {"Pipeline", {"stages", "microbatches", "schedule"}},
      {"Balancers", {"rebalance_interval", "rebalance_min_gain", "rebalance_window"}},
      {"Network and device",
       {"p2p_bandwidth_gbps", "p2p_latency_us", "p2p_bytes", "migration_bandwidth_gbps",
        "migration_latency_us", "device_tflops", "vocab"}},
      {"Scaling a trace", {"scale_layers", "scale_hidden", "trace_hidden", "trace_seq"}},
      {"Re-packing", {"repack", "repack_slack"}},
      {"Output", {"per_iteration", "output"}},
  };
  if (std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }

  if (FLAGS_schedules + (!FLAGS_case.empty() && !FLAGS_schedules) + !FLAGS_trace.empty() != 1) {
    std::fprintf(stderr,
                 "fulcrum_sim: give exactly one of --case=NAMES|all, --trace=PATH and --schedules "
                 "(--schedules may name cases too)\n");
    return fulcrum::kUsageError;
  }
  if (absl::Status s = fulcrum::CheckFlags(); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return fulcrum::kUsageError;
  }
  if (FLAGS_schedules) {
    if (!FLAGS_output.empty()) {
      std::fprintf(stderr, "fulcrum_sim: --output is not written by --schedules\n");
      return fulcrum::kUsageError;
    }
    return fulcrum::RunSchedules();
  }
  std::string out;
  const int code = FLAGS_trace.empty() ? fulcrum::RunCases(FLAGS_output.empty() ? nullptr : &out)
                                       : fulcrum::RunTrace(FLAGS_output.empty() ? nullptr : &out);
  if (code != 0 || FLAGS_output.empty()) return code;  // A failed run writes nothing.
  if (absl::Status s = fulcrum::WriteFileAtomically(fulcrum::DefaultFileSystem(), FLAGS_output, out);
      !s.ok()) {
    std::fprintf(stderr, "--output=%s: %s\n", FLAGS_output.c_str(), std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
