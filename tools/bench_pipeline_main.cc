// bench_pipeline: the bubble of the pipeline schedules, measured through the real binaries.
//
// For every pipeline size (--pp), micro-batch count (--microbatches) and schedule
// (--schedules) it trains the same model (--recipe, plus --model_flags) for --train_iters
// iterations under
//   fulcrum_launch --nproc_per_node=PP --master_port=0 -- fulcrum_train ...
//       --pipeline_model_parallel_size=PP --pipeline_schedule=S
//       --micro_batch_size=B --global_batch_size=M*B --metrics_file=...
// (binaries next to this one), so every micro-batch holds the same tokens whatever M is.
// Two names run virtual pipeline stages (two model chunks per rank): "interleaved" is
// Megatron's interleaved 1F1B (--pipeline_schedule=1f1b --virtual_pipeline_model_parallel_size=2;
// Megatron's rule: M a multiple of PP) and "zbv" is ZB-V (--pipeline_schedule=zbv; "zbv-unit"
// adds --zbv_order=unit); the
// recipe's layers must split into 2·PP chunks (a run fulcrum_train refuses for that is a
// failed row, not the end of the benchmark).
// From the metrics file it drops the first --skip_iters iterations (start-up) and prints
// one table: the medians of iteration_ms, bubble_ratio (mean over stages; idle time until
// the whole pipeline is done, NOTE [bubble measurement] in pipeline/pipeline_runner.h),
// bubble_ratio_max and bubble_ratio_in_run (the idle time inside a stage's own run only),
// and for each (PP, M) every other schedule's ratios to 1F1B of bubble and iteration time,
// with the goal "ZB-H1 bubble <= --goal_ratio x 1F1B" on ZB-H1's row. The runs go in
// (PP, M, schedule) order, so the schedules of one (PP, M) run back to back, in turns,
// rather than one schedule's whole sweep before the next (drift in the machine's load
// spreads over all of them). With --timelines every run also records a
// timeline; from it the tool takes each stage's median F, B, W (or BW) time and prints the
// bubble the schedule simulator (pipeline/schedule_simulator.h) predicts for those costs
// with free communication (not for the chunked schedules: their costs are per chunk): the gap between "bubble" and "sim" is what the implementation
// (transfers, waits, noise) adds to the schedule's own bubble. Nothing is hard-coded:
// every number printed was measured in this run. With --layer_timing_overhead every
// configuration also runs --overhead_rounds pairs, per-layer timing on and off
// (fulcrum_train --layer_timing=false), back to back, and a second table gives what the
// per-layer timing costs (issue 23: <= 1%; on a GPU, pass --model_flags="--device=cuda ...").
//
//   build/bin/fulcrum_bench_pipeline [--pp=2,4] [--schedules=1f1b,zbh1,interleaved,zbv]
//       [--microbatches=4,8,16] [--micro_batch_size=1] [--train_iters=20] [--skip_iters=3]
//       [--recipe=tiny] [--model_flags="--hidden_size=256"] [--timelines] [--keep_logs]
//       [--layer_timing_overhead] [--overhead_rounds=3]
//
// Exit codes: 0 done, 2 bad flags (or fulcrum_train rejected the flags), 1 a run failed.
#include <gflags/gflags.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_simulator.h"
#include "recipes/cli.h"
#include "tools/internal/bench_util.h"

DEFINE_string(pp, "2,4", "Pipeline sizes (processes per run), comma-separated; each >= 2.");
DEFINE_string(schedules, "1f1b,zbh1,interleaved,zbv",
              "Pipeline schedules, comma-separated (1f1b, zbh1, zbh2; interleaved = interleaved "
              "1F1B with 2 chunks per stage; zbv, its order from the measured costs; zbv-unit, "
              "the unit-cost order). The ratio columns need 1f1b.");
DEFINE_string(microbatches, "4,8,16", "Micro-batches per iteration, comma-separated; each >= 1.");
DEFINE_int32(micro_batch_size, 1,
             "Sequences per micro-batch, the same for every count (--global_batch_size is "
             "microbatches x this).");
DEFINE_int32(train_iters, 20, "Iterations per run.");
DEFINE_int32(skip_iters, 3, "Leading iterations of each run left out of the medians.");
DEFINE_string(recipe, "tiny", "fulcrum_train --recipe giving the model's shape.");
DEFINE_string(model_flags, "",
              "Extra fulcrum_train flags, e.g. \"--hidden_size=256 --num_layers=8\" (not the "
              "batch, pipeline or metrics flags, which this tool sets).");
DEFINE_double(goal_ratio, 0.4, "Goal: median ZB-H1 bubble <= this x the 1F1B one.");
DEFINE_bool(layer_timing_overhead, false,
            "Also measure what per-layer timing costs (issue 23's goal: <= 1%): every "
            "configuration runs --overhead_rounds more times in pairs, timed as always and "
            "with --layer_timing=false (only the actions timed), back to back, and a second "
            "table gives the median iteration time of each side and their ratio.");
DEFINE_int32(overhead_rounds, 3, "Timed/untimed pairs per configuration (--layer_timing_overhead).");
DEFINE_bool(keep_logs, false, "Keep each run's log and metrics (their directory is printed).");
DEFINE_bool(timelines, false,
            "Record a timeline (--timeline) of every run and print the simulated bubble of the "
            "schedule for the stages' measured median F/B/W costs (the 'sim' column).");

namespace fulcrum {
namespace {

using bench::kUsageError;
using bench::Median;

struct RunKey {
  int pp;
  int microbatches;
  std::string schedule;
  bool operator<(const RunKey& o) const {
    return std::tie(pp, microbatches, schedule) < std::tie(o.pp, o.microbatches, o.schedule);
  }
};

// How one run of a configuration is made: `layer_timing` false adds --layer_timing=false;
// `round` names its files apart from the other runs of the configuration.
struct RunMode {
  bool layer_timing = true;
  int round = 0;
};

// How fulcrum_train runs a --schedules name: its --pipeline_schedule and model chunks per
// stage (2 for the virtual-stage schedules).
struct ScheduleSpec {
  std::string pipeline_schedule;
  int chunks = 1;
};

ScheduleSpec SpecOf(const std::string& name) {
  if (name == "interleaved") return {"1f1b", 2};
  if (name == "zbv" || name == "zbv-unit") return {"zbv", 2};
  return {name, 1};
}

std::string TrainScheduleFlags(const std::string& name) {
  const ScheduleSpec spec = SpecOf(name);
  std::string flags = " --pipeline_schedule=" + spec.pipeline_schedule;
  // zbv sets its own two chunks; interleaved 1F1B is 1f1b with the virtual-stage flag.
  if (name == "interleaved") flags += " --virtual_pipeline_model_parallel_size=2";
  // "zbv" runs the order built from the measured costs (the default), "zbv-unit" the
  // unit-cost one (NOTE [ZB-V at measured costs]).
  if (name == "zbv-unit") flags += " --zbv_order=unit";
  return flags;
}

struct RunResult {
  double iteration_ms = 0;  // Medians over the kept iterations.
  double bubble_ratio = 0;
  double bubble_ratio_max = 0;
  double bubble_ratio_in_run = -1;  // -1: the metrics file has none.
  double simulated_bubble = -1;     // -1: no timeline.
  std::string costs;                // Per stage "F/B/W" medians in ms, from the timeline.
  int kept_iterations = 0;
};

// From a --timeline trace: every stage's median F, B and W (BW for a fused backward) over
// the iterations after --skip_iters, each action's time without its nested wait; then the
// simulated mean bubble ratio of `key`'s schedule with those costs and free transfers.
// False when the trace lacks a stage or an action kind.
bool SimulateFromTimeline(const std::string& path, const RunKey& key, RunResult* result) {
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!trace.is_object() || !trace.contains("traceEvents")) return false;
  std::map<int, int> stage_of_pid;  // From "rank R (stage S)".
  std::map<std::tuple<int, int64_t, std::string>, double> wait_us;  // (pid, iteration, action)
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "process_name") {
      const std::string name = e["args"].value("name", "");
      const size_t at = name.find("(stage ");
      int stage = 0;
      if (at != std::string::npos &&
          absl::SimpleAtoi(absl::StripSuffix(name.substr(at + 7), ")"), &stage)) {
        stage_of_pid[e["pid"].get<int>()] = stage;
      }
    } else if (e.value("cat", "") == "wait" && e.contains("args") && e["args"].contains("iteration")) {
      wait_us[{e["pid"].get<int>(), e["args"]["iteration"].get<int64_t>(),
               e["args"].value("for", "")}] += e.value("dur", 0.0);
    }
  }
  // [stage][kind] -> durations (ms)
  std::map<int, std::map<std::string, std::vector<double>>> durations;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("cat", "") != "compute" || !e.contains("args")) continue;
    const int64_t iteration = e["args"].value("iteration", int64_t{0});
    if (iteration <= FLAGS_skip_iters) continue;
    const int pid = e["pid"].get<int>();
    auto stage = stage_of_pid.find(pid);
    if (stage == stage_of_pid.end()) continue;
    double us = e.value("dur", 0.0);
    auto wait = wait_us.find({pid, iteration, e.value("name", "")});
    if (wait != wait_us.end()) us -= wait->second;
    durations[stage->second][e["args"].value("kind", "")].push_back(us / 1000.0);
  }
  if (SpecOf(key.schedule).chunks > 1) return false;  // Per-chunk costs: not modelled here.
  auto schedule = pipeline::MakeSchedule(key.schedule, key.pp, key.microbatches);
  if (!schedule.ok() || static_cast<int>(durations.size()) != key.pp) return false;
  const bool split = pipeline::UsesSplitBackward(*schedule);
  std::vector<pipeline::ActionCosts> costs(key.pp);
  std::vector<std::string> shown;
  for (int s = 0; s < key.pp; ++s) {
    auto& kinds = durations[s];
    for (const char* kind : split ? std::vector<const char*>{"F", "B", "W"}
                                  : std::vector<const char*>{"F", "BW"}) {
      if (kinds[kind].empty()) return false;
    }
    costs[s].forward = Median(kinds["F"]);
    costs[s].backward_input = Median(kinds[split ? "B" : "BW"]);
    costs[s].backward_weight = split ? Median(kinds["W"]) : 0.0;
    shown.push_back(split ? absl::StrFormat("%.2f/%.2f/%.2f", costs[s].forward,
                                            costs[s].backward_input, costs[s].backward_weight)
                          : absl::StrFormat("%.2f/%.2f", costs[s].forward, costs[s].backward_input));
  }
  const pipeline::SimulationResult sim = pipeline::Simulate(*schedule, costs);
  double sum = 0;
  for (int s = 0; s < key.pp; ++s) sum += sim.BubbleRatio(s);
  result->simulated_bubble = sum / key.pp;
  result->costs = absl::StrJoin(shown, " ");
  return true;
}

// Runs one configuration; nullopt on failure, with the exit code in `code` and the log's
// tail in `log_tail`.
std::optional<RunResult> RunOne(const std::string& bin_dir, const std::string& work_dir,
                                const RunKey& key, const RunMode& mode, int* code,
                                std::string* log_tail) {
  const std::string stem =
      absl::StrFormat("%s/pp%d_m%d_%s%s%s", work_dir, key.pp, key.microbatches, key.schedule,
                      mode.layer_timing ? "" : "_untimed",
                      mode.round > 0 ? absl::StrCat("_r", mode.round) : "");
  const std::string metrics = stem + ".jsonl", log = stem + ".log", timeline = stem + ".json";
  std::remove(metrics.c_str());
  std::remove(timeline.c_str());
  const std::string command = absl::StrCat(
      bin_dir, "/fulcrum_launch --nproc_per_node=", key.pp, " --master_port=0 -- ", bin_dir,
      "/fulcrum_train --recipe=", FLAGS_recipe, " ", FLAGS_model_flags,
      " --micro_batch_size=", FLAGS_micro_batch_size,
      " --global_batch_size=", key.microbatches * FLAGS_micro_batch_size,
      " --pipeline_model_parallel_size=", key.pp, TrainScheduleFlags(key.schedule),
      mode.layer_timing ? "" : " --layer_timing=false",
      " --train_iters=", FLAGS_train_iters, " --eval_interval=0 --log_interval=1000000",
      " --metrics_file=", metrics,
      FLAGS_timelines && mode.round == 0 ? " --timeline=" + timeline : "", " > ", log,
      " 2>&1");
  const int status = std::system(command.c_str());
  *code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  std::vector<double> iteration_ms, bubble, bubble_max, bubble_in_run;
  if (*code == 0) {
    std::ifstream in(metrics);
    std::string line;
    for (int i = 0; std::getline(in, line); ++i) {
      if (i < FLAGS_skip_iters) continue;
      const nlohmann::json record =
          nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!record.is_object() || !record.contains("iteration_ms") ||
          !record.contains("bubble_ratio") || !record.contains("bubble_ratio_max")) {
        *log_tail = absl::StrCat(metrics, ": line ", i + 1,
                                 " lacks iteration_ms / bubble_ratio / bubble_ratio_max");
        *code = 1;
        return std::nullopt;
      }
      iteration_ms.push_back(record["iteration_ms"].get<double>());
      bubble.push_back(record["bubble_ratio"].get<double>());
      bubble_max.push_back(record["bubble_ratio_max"].get<double>());
      if (record.contains("bubble_ratio_in_run")) {
        bubble_in_run.push_back(record["bubble_ratio_in_run"].get<double>());
      }
    }
  }
  if (*code != 0 || iteration_ms.empty()) {
    *log_tail = bench::FileTail(log);
    if (*code == 0) {
      *code = 1;
      *log_tail += absl::StrCat("\n(no iterations left after --skip_iters=", FLAGS_skip_iters, ")");
    }
    return std::nullopt;
  }
  RunResult result;
  result.iteration_ms = Median(iteration_ms);
  result.bubble_ratio = Median(bubble);
  result.bubble_ratio_max = Median(bubble_max);
  if (!bubble_in_run.empty()) result.bubble_ratio_in_run = Median(bubble_in_run);
  result.kept_iterations = static_cast<int>(iteration_ms.size());
  if (FLAGS_timelines && mode.round == 0 && !SimulateFromTimeline(timeline, key, &result)) {
    std::fprintf(stderr, "fulcrum_bench_pipeline: %s: no usable timeline; 'sim' left empty\n",
                 timeline.c_str());
  }
  return result;
}

// "0.123", or "-" for a value that was not measured (negative).
std::string Cell(double value) { return value < 0 ? "-" : absl::StrFormat("%.3f", value); }

void PrintTable(const std::vector<RunKey>& keys, const std::map<RunKey, RunResult>& results) {
  std::printf("\n%3s %5s  %-11s %10s %8s %10s %8s %8s   %-13s %-11s %-8s %s\n", "pp", "m",
              "schedule", "iter ms", "bubble", "bubble_max", "in-run", "sim", "bubble/1f1b",
              "iter/1f1b", "goal", "in-run, sim ratios");
  for (const RunKey& key : keys) {
    auto it = results.find(key);
    if (it == results.end()) {
      std::printf("%3d %5d  %-11s %10s\n", key.pp, key.microbatches, key.schedule.c_str(), "failed");
      continue;
    }
    const RunResult& r = it->second;
    std::string bubble_ratio, time_ratio, goal, other_ratios;
    if (key.schedule != "1f1b") {
      auto base = results.find(RunKey{key.pp, key.microbatches, "1f1b"});
      if (base != results.end() && base->second.bubble_ratio > 0 && base->second.iteration_ms > 0) {
        const RunResult& b = base->second;
        const double ratio = r.bubble_ratio / b.bubble_ratio;
        bubble_ratio = absl::StrFormat("%.2f", ratio);
        time_ratio = absl::StrFormat("%.2f", r.iteration_ms / b.iteration_ms);
        if (key.schedule == "zbh1") goal = ratio <= FLAGS_goal_ratio ? "met" : "NOT met";
        auto ratio_of = [](double a, double c) {
          return a >= 0 && c > 0 ? absl::StrFormat("%.2f", a / c) : std::string("-");
        };
        other_ratios = ratio_of(r.bubble_ratio_in_run, b.bubble_ratio_in_run) + ", " +
                       ratio_of(r.simulated_bubble, b.simulated_bubble);
      }
    }
    std::printf("%3d %5d  %-11s %10.1f %8.3f %10.3f %8s %8s   %-13s %-11s %-8s %s\n", key.pp,
                key.microbatches, key.schedule.c_str(), r.iteration_ms, r.bubble_ratio,
                r.bubble_ratio_max, Cell(r.bubble_ratio_in_run).c_str(),
                Cell(r.simulated_bubble).c_str(), bubble_ratio.c_str(), time_ratio.c_str(),
                goal.c_str(), other_ratios.c_str());
  }
  bool any_costs = false;
  for (const auto& [key, r] : results) any_costs = any_costs || !r.costs.empty();
  if (!any_costs) return;
  std::printf("\nmedian action costs per stage (ms; F/B/W, or F/BW for a fused backward):\n");
  for (const RunKey& key : keys) {
    auto it = results.find(key);
    if (it == results.end() || it->second.costs.empty()) continue;
    std::printf("%3d %5d  %-11s %s\n", key.pp, key.microbatches, key.schedule.c_str(),
                it->second.costs.c_str());
  }
}

// --layer_timing_overhead: for each configuration that ran, --overhead_rounds pairs of runs,
// per-layer timing on then off, back to back (drift in the machine's load falls on both
// sides alike); prints each side's median over its runs' median iteration times and the
// ratio. The runs here are extra: the main table's run is not one of them. False when a
// run failed.
bool MeasureLayerTimingOverhead(const std::string& bin_dir, const std::string& work_dir,
                                const std::vector<RunKey>& keys,
                                const std::map<RunKey, RunResult>& ran) {
  auto joined = [](const std::vector<double>& values) {
    return absl::StrJoin(values, "/", [](std::string* out, double v) {
      absl::StrAppend(out, absl::StrFormat("%.1f", v));
    });
  };
  bool ok = true;
  std::vector<std::string> rows;
  for (const RunKey& key : keys) {
    if (ran.find(key) == ran.end()) continue;
    std::vector<double> timed, untimed;
    for (int round = 1; round <= FLAGS_overhead_rounds; ++round) {
      for (const bool layer_timing : {true, false}) {
        int code = 0;
        std::string log_tail;
        std::optional<RunResult> result =
            RunOne(bin_dir, work_dir, key, RunMode{layer_timing, round}, &code, &log_tail);
        if (!result) {
          std::fprintf(stderr, "fulcrum_bench_pipeline: pp=%d m=%d %s%s failed (exit %d):\n%s\n",
                       key.pp, key.microbatches, key.schedule.c_str(),
                       layer_timing ? "" : " --layer_timing=false", code, log_tail.c_str());
          ok = false;
          continue;
        }
        (layer_timing ? timed : untimed).push_back(result->iteration_ms);
      }
    }
    if (timed.empty() || untimed.empty()) continue;
    const double on = Median(timed), off = Median(untimed);
    rows.push_back(absl::StrFormat("%3d %5d  %-11s %12.2f %12.2f %8.4f %+9.2f%%  %s vs %s", key.pp,
                                   key.microbatches, key.schedule.c_str(), on, off, on / off,
                                   100.0 * (on / off - 1.0), joined(timed), joined(untimed)));
  }
  std::printf("\nper-layer timing overhead (%d pairs per row, back to back; each run's median "
              "iteration; goal <= 1%%):\n%3s %5s  %-11s %12s %12s %8s %10s  %s\n",
              FLAGS_overhead_rounds, "pp", "m", "schedule", "timed ms", "untimed ms", "ratio",
              "overhead", "runs (timed vs untimed)");
  for (const std::string& row : rows) std::printf("%s\n", row.c_str());
  return ok;
}

int Run(const std::string& bin_dir) {
  std::string error;
  auto pps = bench::ParseInts("pp", FLAGS_pp, 2, &error);
  auto counts = pps ? bench::ParseInts("microbatches", FLAGS_microbatches, 1, &error) : std::nullopt;
  std::vector<std::string> schedules = absl::StrSplit(FLAGS_schedules, ',', absl::SkipWhitespace());
  if (error.empty() && schedules.empty()) error = "--schedules is empty";
  if (error.empty() && FLAGS_micro_batch_size < 1) {
    error = absl::StrCat("--micro_batch_size=", FLAGS_micro_batch_size, " must be >= 1");
  }
  if (error.empty() && (FLAGS_skip_iters < 0 || FLAGS_train_iters <= FLAGS_skip_iters)) {
    error = absl::StrCat("--train_iters=", FLAGS_train_iters,
                         " must exceed --skip_iters=", FLAGS_skip_iters, " >= 0");
  }
  std::vector<RunKey> keys;
  for (int pp : pps.value_or(std::vector<int>{})) {
    for (int m : counts.value_or(std::vector<int>{})) {
      for (const std::string& schedule : schedules) {
        // Checks the schedule's name and (pp, m) before any run starts.
        if (auto made = pipeline::MakeSchedule(SpecOf(schedule).pipeline_schedule, pp, m,
                                               SpecOf(schedule).chunks);
            !made.ok() && error.empty()) {
          error = absl::StrCat("--schedules: ", made.status().message());
        }
        keys.push_back(RunKey{pp, m, schedule});
      }
    }
  }
  if (!error.empty()) {
    std::fprintf(stderr, "fulcrum_bench_pipeline: %s\n", error.c_str());
    return kUsageError;
  }
  if (std::string missing = bench::MissingTools(bin_dir, {"fulcrum_launch", "fulcrum_train"});
      !missing.empty()) {
    std::fprintf(stderr, "fulcrum_bench_pipeline: %s\n", missing.c_str());
    return 1;
  }
  std::string work_dir = "/tmp/fulcrum_bench_pipeline_XXXXXX";
  if (mkdtemp(work_dir.data()) == nullptr) {
    std::perror("fulcrum_bench_pipeline: mkdtemp");
    return 1;
  }

  const int cores = bench::UsableCores();
  std::printf(
      "fulcrum_bench_pipeline: --recipe=%s %s| micro-batch size %d | %d iterations per "
      "run, medians of the last %d | %d usable cores\n",
      FLAGS_recipe.c_str(), FLAGS_model_flags.empty() ? "" : (FLAGS_model_flags + " ").c_str(),
      FLAGS_micro_batch_size, FLAGS_train_iters, FLAGS_train_iters - FLAGS_skip_iters, cores);
  for (int pp : *pps) {
    if (pp > cores) {
      std::printf(
          "note: pp=%d runs %d processes on %d cores: they oversubscribe the CPU, so "
          "its timings are distorted (and its bubbles: a stage the OS deschedules makes "
          "its neighbours wait)\n",
          pp, pp, cores);
    }
  }
  if (double load; bench::ReadLoadAverage(&load) && load >= 0.5) {
    std::printf("note: load average %.1f before the runs: other work on this machine shares "
                "the cores and adds noise to every row\n", load);
  }
  std::fflush(stdout);

  std::map<RunKey, RunResult> results;
  bool failed = false;
  const auto bench_start = std::chrono::steady_clock::now();
  for (const RunKey& key : keys) {
    int code = 0;
    std::string log_tail;
    const auto start = std::chrono::steady_clock::now();
    std::optional<RunResult> result = RunOne(bin_dir, work_dir, key, RunMode{}, &code, &log_tail);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!result) {
      std::fprintf(stderr, "fulcrum_bench_pipeline: pp=%d m=%d %s failed (exit %d):\n%s\n", key.pp,
                   key.microbatches, key.schedule.c_str(), code, log_tail.c_str());
      // fulcrum_train rejected the flags: the same for every row, except a chunked schedule
      // whose layers do not split into 2·PP chunks (one row fails, the rest run).
      if (code == kUsageError && SpecOf(key.schedule).chunks == 1) return kUsageError;
      failed = true;
      continue;
    }
    std::fprintf(stderr, "  pp=%d m=%-3d %-11s  %8.1f ms/iter  bubble %.3f  (%.0f s)\n", key.pp,
                 key.microbatches, key.schedule.c_str(), result->iteration_ms, result->bubble_ratio,
                 seconds);
    results.emplace(key, *result);
  }

  if (FLAGS_layer_timing_overhead && !MeasureLayerTimingOverhead(bin_dir, work_dir, keys, results)) {
    failed = true;
  }

  std::printf(
      "\ngoal: ZB-H1 bubble <= %.1f x 1F1B (median bubble_ratio, mean over stages)\n"
      "bubble: idle until the pipeline is done / that span; in-run: idle inside the stage's own "
      "run / its run; sim: simulated for the median costs, free transfers\n",
      FLAGS_goal_ratio);
  PrintTable(keys, results);
  std::printf(
      "\n%zu runs in %.0f s\n", keys.size(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - bench_start).count());
  if (FLAGS_keep_logs) {
    std::printf("logs and metrics: %s\n", work_dir.c_str());
  } else {
    std::system(absl::StrCat("rm -rf '", work_dir, "'").c_str());
  }
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_pipeline";
  help.usage =
      "fulcrum_bench_pipeline: pipeline bubble and iteration time of 1F1B, ZB-H1, interleaved\n"
      "1F1B and ZB-V (and other schedules), measured by training through fulcrum_launch +\n"
      "fulcrum_train (built next to it) for every --pp x --microbatches x --schedules.\n\n"
      "  fulcrum_bench_pipeline [--pp=2,4] [--schedules=1f1b,zbh1,interleaved,zbv]\n"
      "      [--microbatches=4,8,16] [--train_iters=20] [--recipe=tiny] [--timelines]\n"
      "  fulcrum_bench_pipeline --pp=2 --microbatches=4,8 --train_iters=8     a quick run\n\n"
      "Exit status: 0 done, 2 bad flags (or fulcrum_train rejected the flags), 1 a run failed.\n";
  help.groups = {
      {"Runs", {"pp", "schedules", "microbatches", "micro_batch_size", "train_iters",
                "skip_iters", "recipe", "model_flags"}},
      {"Goal and output", {"goal_ratio", "timelines", "layer_timing_overhead", "overhead_rounds",
                           "keep_logs"}},
  };
  if (std::optional<int> code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *code;
  }
  return fulcrum::Run(fulcrum::bench::BinDir(argv[0]));
}
