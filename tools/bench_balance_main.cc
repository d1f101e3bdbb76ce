// bench_balance: what dynamic pipeline rebalancing buys, measured through the real binaries.
//
// It trains one model whose heavy layers sit on one side of the pipeline (by default MoE
// layers on the first half of eight, so stage 0 carries about twice stage 1's compute) under
// each configuration of --configs:
//   none       --rebalancer=none (the uniform initial partition, kept)
//   params     --rebalancer=none --pipeline_initial_partition=params (static, by parameters)
//   partition  --rebalancer=partition (exact, from the measured times)
//   diffusion  --rebalancer=diffusion (neighbour exchanges, DynMo §3.3)
// each run being
//   OMP_NUM_THREADS=1 fulcrum_launch --nproc_per_node=PP --master_port=0 -- fulcrum_train
//       --recipe=R MODEL_FLAGS --pipeline_model_parallel_size=PP --pipeline_schedule=S
//       --train_iters=N --eval_interval=0 --log_interval=1000000 --metrics_file=... CONFIG
// (binaries next to this one; one thread per rank). The configurations are interleaved
// --rounds times (round 1 runs each once, then round 2, ...), so slow drift of the machine
// touches all alike. From the metrics files it prints, per configuration over the kept
// iterations (after --skip_iters) of all rounds: the median iteration time and bubble ratio,
// the measured imbalance before (iterations 1..--before_iters, which ran on the initial
// placement) and after, the layers moved, the final placement, each stage's median compute,
// and the speedup over the best static configuration (none, params); then the same per
// round, so the reader sees the noise; then the loss check: every run's loss per iteration
// against the first `none` run's (a balancer moves layers, never the math: they must agree
// within --loss_tolerance, relative). Every number printed is measured in this run, with the
// machine's usable cores and load average before and after.
//
//   build/bin/fulcrum_bench_balance [--configs=none,params,partition,diffusion] [--rounds=2]
//       [--train_iters=40] [--skip_iters=10] [--before_iters=2] [--pp=2] [--schedule=zbh1]
//       [--recipe=tiny_moe] [--model_flags="--num_layers=8 --moe_layer_freq=[1,1,1,1,0,0,0,0]"]
//       [--loss_tolerance=1e-6] [--keep_logs]
//
// Exit codes: 0 done and the losses agree, 2 bad flags (or fulcrum_train rejected the flags),
// 1 a run failed or a configuration's losses differ from the reference.
#include <gflags/gflags.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "recipes/cli.h"
#include "tools/internal/bench_util.h"

DEFINE_string(configs, "none,params,partition,diffusion",
              "Configurations, comma-separated, run in this order every round: none (uniform "
              "partition, no balancer), params (--pipeline_initial_partition=params, no "
              "balancer), partition, diffusion (--rebalancer=...). The loss reference is the "
              "first run of none (else of the first configuration).");
DEFINE_int32(rounds, 2, "Rounds; each runs every configuration once (interleaved).");
DEFINE_int32(train_iters, 40, "Iterations per run.");
DEFINE_int32(skip_iters, 10,
             "Leading iterations of each run left out of the 'after' medians (start-up and the "
             "balancers' first decisions).");
DEFINE_int32(before_iters, 2,
             "Iterations 1..this give the 'before' imbalance. A balancer decides first in "
             "iteration 2 and its moves act from iteration 3, so 2 is the most that ran on the "
             "initial placement in every configuration (checked: an iteration after a move is "
             "left out).");
DEFINE_int32(pp, 2, "Pipeline stages (processes per run), >= 2.");
DEFINE_string(schedule, "zbh1", "--pipeline_schedule of every run (1f1b, zbh1, zbh2).");
DEFINE_string(recipe, "tiny_moe", "fulcrum_train --recipe giving the model.");
DEFINE_string(model_flags, "--num_layers=8 --moe_layer_freq=[1,1,1,1,0,0,0,0]",
              "fulcrum_train flags of the model, space-separated, the same for every "
              "configuration (balancer tuning such as --rebalance_window may go here; not the "
              "pipeline size, iterations, metrics file, --rebalancer or the initial partition, "
              "which this tool sets).");
DEFINE_double(loss_tolerance, 1e-6,
              "Largest relative loss difference per iteration allowed against the reference.");
DEFINE_bool(keep_logs, false, "Keep each run's log and metrics (their directory is printed).");
DEFINE_bool(repack_row, true,
            "Also measure re-packing (pp=2 → 1 live, dynamic/repack.h) on a model whose work "
            "freezing shrinks, against the same run without re-packing: tokens/s and tokens/s per "
            "rank before and after. With --configs= (empty) only this row runs.");
DEFINE_string(repack_model_flags,
              "--recipe=tiny --num_layers=8 --plugins=freeze --freeze_schedule=5:0-5 "
              "--freeze_max_fraction=0.75",
              "fulcrum_train flags of the re-packing row's model (freezing shrinks its work).");
DEFINE_int32(repack_iters, 40, "Iterations per run of the re-packing row.");
DEFINE_double(repack_auto_max_slowdown, 0.25,
              "The re-packing row also runs --repack=auto --repack_interval=5 with this "
              "--repack_max_slowdown (negative: not)." );
DEFINE_int32(repack_at, 15,
             "The re-packing row packs pp=2 onto one stage after this iteration (--repack_script); "
             "'before' is iterations 8..AT, 'after' AT+3..--repack_iters.");

namespace fulcrum {
namespace {

using bench::kUsageError;
using bench::Median;

struct Config {
  std::string name;
  std::vector<std::string> flags;  // What it adds to fulcrum_train's command line.
  bool is_static;                  // Placement fixed at start: a baseline of the speedup.
};

const std::vector<Config>& KnownConfigs() {
  static const std::vector<Config> configs = {
      {"none", {"--rebalancer=none"}, true},
      {"params", {"--rebalancer=none", "--pipeline_initial_partition=params"}, true},
      {"partition", {"--rebalancer=partition"}, false},
      {"diffusion", {"--rebalancer=diffusion"}, false},
  };
  return configs;
}

// One line of the metrics file.
struct Iteration {
  int64_t iteration = 0;
  double iteration_ms = 0;
  double bubble_ratio = 0;
  double imbalance = 0;
  std::vector<double> stage_ms;
  int64_t layers_moved = 0;  // Cumulative, including this iteration's (made in its tail).
  std::string stage_ranges;  // The placement after this iteration: "[0,4) [4,8)".
  double loss = 0;
};

struct Run {
  std::vector<Iteration> iterations;
  double load_before = -1;  // 1-minute load average when it started; -1 unknown.
  double seconds = 0;
};

// The medians of one run or of all rounds of a configuration.
struct Summary {
  double iteration_ms = NAN;
  double bubble_ratio = NAN;
  double imbalance_before = NAN;
  double imbalance_after = NAN;
  std::vector<double> stage_ms;  // Per stage, over the kept iterations.
  int kept = 0;
  int before = 0;
};

std::string FormatRanges(const nlohmann::json& ranges) {
  std::vector<std::string> parts;
  for (const auto& r : ranges) parts.push_back(absl::StrFormat("[%d,%d)", r[0].get<int64_t>(),
                                                               r[1].get<int64_t>()));
  return absl::StrJoin(parts, " ");
}

// Reads a metrics file; false (with `error`) when a line lacks a field the tables need.
bool ReadMetrics(const std::string& path, std::vector<Iteration>* out, std::string* error) {
  std::ifstream in(path);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    for (const char* field : {"iteration", "iteration_ms", "bubble_ratio", "imbalance", "stage_ms",
                              "layers_moved", "stage_ranges", "loss"}) {
      if (!r.is_object() || !r.contains(field)) {
        *error = absl::StrCat(path, ": line ", n, " lacks ", field);
        return false;
      }
    }
    Iteration it;
    it.iteration = r["iteration"].get<int64_t>();
    it.iteration_ms = r["iteration_ms"].get<double>();
    it.bubble_ratio = r["bubble_ratio"].get<double>();
    it.imbalance = r["imbalance"].get<double>();
    it.stage_ms = r["stage_ms"].get<std::vector<double>>();
    it.layers_moved = r["layers_moved"].get<int64_t>();
    it.stage_ranges = FormatRanges(r["stage_ranges"]);
    it.loss = r["loss"].get<double>();
    out->push_back(std::move(it));
  }
  if (static_cast<int>(out->size()) != FLAGS_train_iters) {
    *error = absl::StrCat(path, ": ", out->size(), " iterations, expected ", FLAGS_train_iters);
    return false;
  }
  return true;
}

// Medians over the iterations of `runs`: 'after' over those past --skip_iters, 'before' over
// 1..--before_iters that ran on the initial placement (no move in an earlier iteration).
Summary Summarize(const std::vector<const Run*>& runs, int pp) {
  std::vector<double> ms, bubble, before, after;
  std::vector<std::vector<double>> stage(pp);
  for (const Run* run : runs) {
    int64_t moved_earlier = 0;
    for (const Iteration& it : run->iterations) {
      if (it.iteration <= FLAGS_before_iters && moved_earlier == 0) before.push_back(it.imbalance);
      moved_earlier = it.layers_moved;
      if (it.iteration <= FLAGS_skip_iters) continue;
      ms.push_back(it.iteration_ms);
      bubble.push_back(it.bubble_ratio);
      after.push_back(it.imbalance);
      for (int s = 0; s < pp && s < static_cast<int>(it.stage_ms.size()); ++s) {
        stage[s].push_back(it.stage_ms[s]);
      }
    }
  }
  Summary out;
  out.iteration_ms = Median(ms);
  out.bubble_ratio = Median(bubble);
  out.imbalance_before = Median(before);
  out.imbalance_after = Median(after);
  for (auto& s : stage) out.stage_ms.push_back(Median(s));
  out.kept = static_cast<int>(ms.size());
  out.before = static_cast<int>(before.size());
  return out;
}

// The fulcrum_train command of one run (after the launcher's part).
std::vector<std::string> Command(const std::string& bin_dir, const Config& config,
                                 const std::string& metrics) {
  std::vector<std::string> args = {bin_dir + "/fulcrum_launch",
                                   absl::StrCat("--nproc_per_node=", FLAGS_pp),
                                   "--master_port=0",
                                   "--",
                                   bin_dir + "/fulcrum_train",
                                   "--recipe=" + FLAGS_recipe};
  for (absl::string_view flag : absl::StrSplit(FLAGS_model_flags, absl::ByAnyChar(" \t\n"),
                                               absl::SkipWhitespace())) {
    args.emplace_back(flag);
  }
  for (std::string flag : {absl::StrCat("--pipeline_model_parallel_size=", FLAGS_pp),
                           "--pipeline_schedule=" + FLAGS_schedule,
                           absl::StrCat("--train_iters=", FLAGS_train_iters),
                           std::string("--eval_interval=0"), std::string("--log_interval=1000000"),
                           "--metrics_file=" + metrics}) {
    args.push_back(std::move(flag));
  }
  args.insert(args.end(), config.flags.begin(), config.flags.end());
  return args;
}

// Checks the flags before any run; the configurations in order, or nullopt with `error`.
std::optional<std::vector<Config>> ParseFlags(std::string* error) {
  std::vector<Config> configs;
  for (absl::string_view name : absl::StrSplit(FLAGS_configs, ',', absl::SkipWhitespace())) {
    const Config* found = nullptr;
    for (const Config& c : KnownConfigs()) found = c.name == name ? &c : found;
    if (found == nullptr) {
      *error = absl::StrCat("--configs: unknown configuration '", name,
                            "' (expected none, params, partition or diffusion)");
      return std::nullopt;
    }
    for (const Config& c : configs) {
      if (c.name == name) {
        *error = absl::StrCat("--configs: '", name, "' is listed twice");
        return std::nullopt;
      }
    }
    configs.push_back(*found);
  }
  if (configs.empty() && !FLAGS_repack_row) *error = "--configs is empty (and no --repack_row)";
  if (FLAGS_repack_row && (FLAGS_repack_at < 8 || FLAGS_repack_iters < FLAGS_repack_at + 4)) {
    *error = absl::StrCat("--repack_at=", FLAGS_repack_at, " must be >= 8 and --repack_iters=",
                          FLAGS_repack_iters, " >= --repack_at + 4");
  }
  if (FLAGS_pp < 2) *error = absl::StrCat("--pp=", FLAGS_pp, " must be >= 2");
  if (FLAGS_rounds < 1) *error = absl::StrCat("--rounds=", FLAGS_rounds, " must be >= 1");
  if (FLAGS_skip_iters < 0 || FLAGS_train_iters <= FLAGS_skip_iters) {
    *error = absl::StrCat("--train_iters=", FLAGS_train_iters, " must exceed --skip_iters=",
                          FLAGS_skip_iters, " >= 0");
  }
  if (FLAGS_before_iters < 1 || FLAGS_before_iters > FLAGS_train_iters) {
    *error = absl::StrCat("--before_iters=", FLAGS_before_iters, " must be in 1..--train_iters=",
                          FLAGS_train_iters);
  }
  if (!(FLAGS_loss_tolerance >= 0)) {
    *error = absl::StrCat("--loss_tolerance=", FLAGS_loss_tolerance, " must be >= 0");
  }
  for (absl::string_view flag : absl::StrSplit(FLAGS_model_flags, absl::ByAnyChar(" \t\n"),
                                               absl::SkipWhitespace())) {
    for (const char* owned : {"--pipeline_model_parallel_size", "--pipeline_schedule",
                              "--train_iters", "--metrics_file", "--rebalancer",
                              "--pipeline_initial_partition", "--recipe"}) {
      if (absl::StartsWith(flag, owned) &&
          (flag.size() == strlen(owned) || flag[strlen(owned)] == '=')) {
        *error = absl::StrCat("--model_flags: ", owned, " is set by this tool (see --help)");
      }
    }
  }
  if (!error->empty()) return std::nullopt;
  return configs;
}

std::string Cell(double value, const char* format) {
  return std::isnan(value) ? std::string("-") : absl::StrFormat(format, value);
}

std::string StageCell(const std::vector<double>& stage_ms) {
  std::vector<std::string> parts;
  for (double ms : stage_ms) parts.push_back(Cell(ms, "%.0f"));
  return absl::StrJoin(parts, "/");
}

// The largest relative difference of `run`'s losses from `reference`'s, iteration by
// iteration (infinity when the iteration counts differ).
double MaxRelativeLossDifference(const Run& run, const Run& reference) {
  if (run.iterations.size() != reference.iterations.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < run.iterations.size(); ++i) {
    const double a = run.iterations[i].loss, b = reference.iterations[i].loss;
    const double diff = a == b ? 0.0 : std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
    worst = std::max(worst, std::isnan(diff) ? INFINITY : diff);
  }
  return worst;
}

// The re-packing row: the same freezing run with and without --repack_script=AT:1 (pp=2 →
// one stage, live), interleaved over the rounds; medians of tokens/s and tokens/s per
// active rank before (iterations 8..AT) and after (AT+3..N). Returns false when a run
// failed or the losses differ beyond --loss_tolerance.
bool RunRepackRow(const std::string& bin_dir, const std::string& work_dir) {
  struct RepackRun {
    std::vector<double> tokens_per_second, loss;
    std::vector<int> active_ranks, pipeline_size;
  };
  std::vector<std::pair<std::string, std::string>> variants = {
      {"static", ""}, {"repacked", absl::StrCat("--repack_script=", FLAGS_repack_at, ":1")}};
  if (FLAGS_repack_auto_max_slowdown >= 0) {
    // The automatic decision on the measured per-layer costs, every 5 iterations from the
    // freezing on; whether and when it packs depends on this machine's timings.
    variants.emplace_back("auto", absl::StrCat("--repack=auto --repack_interval=5 "
                                               "--repack_max_slowdown=",
                                               FLAGS_repack_auto_max_slowdown));
  }
  auto command = [&](const std::string& extra, const std::string& metrics) {
    std::vector<std::string> args = {bin_dir + "/fulcrum_launch", "--nproc_per_node=2",
                                     "--master_port=0", "--", bin_dir + "/fulcrum_train"};
    for (absl::string_view flag : absl::StrSplit(FLAGS_repack_model_flags,
                                                 absl::ByAnyChar(" \t\n"), absl::SkipWhitespace())) {
      args.emplace_back(flag);
    }
    for (std::string flag : {std::string("--pipeline_model_parallel_size=2"),
                             "--pipeline_schedule=" + FLAGS_schedule,
                             absl::StrCat("--train_iters=", FLAGS_repack_iters),
                             std::string("--eval_interval=0"),
                             std::string("--log_interval=1000000"), "--metrics_file=" + metrics}) {
      args.push_back(std::move(flag));
    }
    for (absl::string_view flag : absl::StrSplit(extra, ' ', absl::SkipWhitespace())) {
      args.emplace_back(flag);
    }
    return args;
  };
  std::printf("\n# re-packing row: %s, pp=2, %d iterations; repacked: --repack_script=%d:1 (the "
              "pipeline packs onto one stage after iteration %d, live; one rank is released)\n",
              FLAGS_repack_model_flags.c_str(), FLAGS_repack_iters, FLAGS_repack_at,
              FLAGS_repack_at);
  for (const auto& [name, extra] : variants) {
    std::printf("#   %-9s OMP_NUM_THREADS=1 %s\n", name.c_str(),
                bench::ShellCommand(command(extra, work_dir + "/repack_" + name + ".jsonl")).c_str());
  }
  std::fflush(stdout);
  std::map<std::string, std::vector<RepackRun>> runs;
  bool ok = true;
  for (int round = 1; round <= FLAGS_rounds; ++round) {
    for (const auto& [name, extra] : variants) {
      const std::string stem = absl::StrFormat("%s/repack_%s_r%d", work_dir, name, round);
      std::remove((stem + ".jsonl").c_str());
      std::string run_error;
      const int code = bench::RunLogged(command(extra, stem + ".jsonl"), stem + ".log", &run_error);
      RepackRun run;
      std::ifstream in(stem + ".jsonl");
      for (std::string line; std::getline(in, line);) {
        const nlohmann::json r = nlohmann::json::parse(line, nullptr, false);
        if (r.is_discarded()) continue;
        run.tokens_per_second.push_back(r.value("tokens_per_second", NAN));
        run.loss.push_back(r.value("loss", NAN));
        run.active_ranks.push_back(r.value("active_ranks", 0));
        run.pipeline_size.push_back(r.value("pipeline_size", 0));
      }
      if (code != 0 || static_cast<int>(run.loss.size()) != FLAGS_repack_iters) {
        std::fprintf(stderr, "fulcrum_bench_balance: re-packing row %s round %d failed (exit %d)%s\n%s\n",
                     name.c_str(), round, code, run_error.c_str(),
                     bench::FileTail(stem + ".log").c_str());
        ok = false;
        continue;
      }
      std::fprintf(stderr, "  round %d repack %-9s pipeline %d -> %d\n", round, name.c_str(),
                   run.pipeline_size.front(), run.pipeline_size.back());
      runs[name].push_back(std::move(run));
    }
  }
  // Medians over the rounds' iterations of a window [first, last] (1-based).
  auto window = [&](const std::vector<RepackRun>& rs, int first, int last, bool per_rank) {
    std::vector<double> values;
    for (const RepackRun& r : rs) {
      for (int i = first; i <= last; ++i) {
        const double tps = r.tokens_per_second[i - 1];
        values.push_back(per_rank ? tps / std::max(1, r.active_ranks[i - 1]) : tps);
      }
    }
    return values.empty() ? NAN : Median(values);
  };
  const int before_first = 8, before_last = FLAGS_repack_at;
  const int after_first = FLAGS_repack_at + 3, after_last = FLAGS_repack_iters;
  std::printf("# tokens/s: medians over iterations %d..%d (before) and %d..%d (after) of every "
              "round; per rank: divided by the ranks the iteration ran on (active_ranks)\n",
              before_first, before_last, after_first, after_last);
  std::printf("%-10s %12s %12s %12s %14s %14s %10s\n", "run", "ranks", "tok/s before",
              "tok/s after", "tok/s/rank bef", "tok/s/rank aft", "per rank");
  std::map<std::string, double> after_per_rank;
  for (const auto& [name, extra] : variants) {
    const auto& rs = runs[name];
    if (rs.empty()) {
      std::printf("%-10s %12s\n", name.c_str(), "failed");
      continue;
    }
    const double before = window(rs, before_first, before_last, false);
    const double after = window(rs, after_first, after_last, false);
    const double before_rank = window(rs, before_first, before_last, true);
    const double after_rank = window(rs, after_first, after_last, true);
    after_per_rank[name] = after_rank;
    std::printf("%-10s %12s %12.0f %12.0f %14.0f %14.0f %9.2fx\n", name.c_str(),
                absl::StrFormat("%d -> %d", rs.front().active_ranks.front(),
                                rs.front().active_ranks.back()).c_str(),
                before, after, before_rank, after_rank, after_rank / before_rank);
  }
  if (after_per_rank.count("static") && after_per_rank.count("repacked")) {
    std::printf("# after re-packing: %.2fx the tokens/s per rank of the run that keeps both ranks\n",
                after_per_rank["repacked"] / after_per_rank["static"]);
  }
  // Losses: re-packing never changes the math (a tied output weight on one stage sums its two
  // gradient halves in another order: equal to rounding).
  if (!runs["static"].empty()) {
    const RepackRun& a = runs["static"].front();
    for (const auto& [name, extra] : variants) {
      if (name == "static" || runs[name].empty()) continue;
      double worst = 0;
      for (const RepackRun& b : runs[name]) {
        for (size_t i = 0; i < a.loss.size() && i < b.loss.size(); ++i) {
          worst = std::max(worst, std::fabs(a.loss[i] - b.loss[i]) / std::fabs(a.loss[i]));
        }
      }
      const bool same = worst <= FLAGS_loss_tolerance;
      ok = ok && same;
      std::printf("# loss check: %s vs static max relative difference %.3g (tolerance %g)  %s\n",
                  name.c_str(), worst, FLAGS_loss_tolerance, same ? "ok" : "DIFFERS");
    }
  }
  return ok;
}

int Main(const std::string& bin_dir) {
  std::string error;
  std::optional<std::vector<Config>> parsed = ParseFlags(&error);
  if (!parsed) {
    std::fprintf(stderr, "fulcrum_bench_balance: %s\n", error.c_str());
    return kUsageError;
  }
  const std::vector<Config>& configs = *parsed;
  if (std::string missing = bench::MissingTools(bin_dir, {"fulcrum_launch", "fulcrum_train"});
      !missing.empty()) {
    std::fprintf(stderr, "fulcrum_bench_balance: %s\n", missing.c_str());
    return 1;
  }
  std::string work_dir = "/tmp/fulcrum_bench_balance_XXXXXX";
  if (mkdtemp(work_dir.data()) == nullptr) {
    std::perror("fulcrum_bench_balance: mkdtemp");
    return 1;
  }
  setenv("OMP_NUM_THREADS", "1", /*overwrite=*/1);  // One thread per rank.

  if (configs.empty()) {  // --configs= : only the re-packing row.
    const bool ok = RunRepackRow(bin_dir, work_dir);
    if (FLAGS_keep_logs) {
      std::printf("# logs and metrics: %s\n", work_dir.c_str());
    } else {
      std::system(absl::StrCat("rm -rf '", work_dir, "'").c_str());
    }
    return ok ? 0 : 1;
  }
  const int cores = bench::UsableCores();
  double load_start = -1;
  bench::ReadLoadAverage(&load_start);
  auto stem = [&](const Config& c, int round) {
    return absl::StrFormat("%s/%s_r%d", work_dir, c.name, round);
  };
  std::printf("# fulcrum_bench_balance: pp=%d, %d configuration(s) x %d round(s), interleaved "
              "(each round runs %s in that order), %d iterations per run\n",
              FLAGS_pp, static_cast<int>(configs.size()), FLAGS_rounds, FLAGS_configs.c_str(),
              FLAGS_train_iters);
  std::printf("# commands (round R writes %s/CONFIG_rR.jsonl, its output to CONFIG_rR.log):\n",
              work_dir.c_str());
  for (const Config& c : configs) {
    std::printf("#   %-9s OMP_NUM_THREADS=1 %s\n", c.name.c_str(),
                bench::ShellCommand(Command(bin_dir, c, stem(c, 1) + ".jsonl")).c_str());
  }
  std::printf("# machine: %d usable cores, 1-minute load average %s before the runs\n", cores,
              load_start < 0 ? "unknown" : absl::StrFormat("%.2f", load_start).c_str());
  if (FLAGS_pp > cores) {
    std::printf("# WARNING: pp=%d ranks on %d cores: oversubscribed: timings not meaningful "
                "(run for correctness: layer moves and the loss check)\n", FLAGS_pp, cores);
  }
  if (load_start >= 0.5) {
    std::printf("# note: load average %.2f before the runs: other work shares the %d cores and "
                "adds noise to every timing\n", load_start, cores);
  }
  std::fflush(stdout);

  // results[config][round]; a failed run is absent.
  std::map<std::string, std::map<int, Run>> results;
  bool failed = false;
  const auto bench_start = std::chrono::steady_clock::now();
  for (int round = 1; round <= FLAGS_rounds; ++round) {
    for (const Config& c : configs) {
      const std::string metrics = stem(c, round) + ".jsonl", log = stem(c, round) + ".log";
      std::remove(metrics.c_str());
      Run run;
      bench::ReadLoadAverage(&run.load_before);
      const auto start = std::chrono::steady_clock::now();
      std::string run_error;
      const int code = bench::RunLogged(Command(bin_dir, c, metrics), log, &run_error);
      run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (code == 0 && ReadMetrics(metrics, &run.iterations, &run_error)) {
        const Summary s = Summarize({&run}, FLAGS_pp);
        std::fprintf(stderr, "  round %d %-9s %8.1f ms/iter  imbalance %.3f -> %.3f  (%.0f s)\n",
                     round, c.name.c_str(), s.iteration_ms, s.imbalance_before, s.imbalance_after,
                     run.seconds);
        results[c.name].emplace(round, std::move(run));
        continue;
      }
      std::fprintf(stderr, "fulcrum_bench_balance: round %d %s failed (exit %d)%s\n%s\n", round,
                   c.name.c_str(), code, run_error.empty() ? "" : (": " + run_error).c_str(),
                   bench::FileTail(log).c_str());
      if (code == kUsageError) {  // fulcrum_train rejected the flags: none will run.
        if (!FLAGS_keep_logs) std::system(absl::StrCat("rm -rf '", work_dir, "'").c_str());
        return kUsageError;
      }
      failed = true;
    }
  }
  const double total_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - bench_start).count();
  double load_end = -1;
  bench::ReadLoadAverage(&load_end);

  // Per configuration over all rounds.
  std::map<std::string, Summary> summary;
  for (const Config& c : configs) {
    std::vector<const Run*> runs;
    for (const auto& [round, run] : results[c.name]) runs.push_back(&run);
    if (!runs.empty()) summary[c.name] = Summarize(runs, FLAGS_pp);
  }
  double best_static = NAN;
  std::string best_static_name;
  for (const Config& c : configs) {
    auto it = summary.find(c.name);
    if (c.is_static && it != summary.end() &&
        (std::isnan(best_static) || it->second.iteration_ms < best_static)) {
      best_static = it->second.iteration_ms;
      best_static_name = c.name;
    }
  }
  std::printf(
      "# iter ms, bubble: medians over iterations %d..%d of every round (bubble: mean over "
      "stages of the time a stage does not compute / the pipeline's time)\n"
      "# imbalance: (max - min) / mean of the stages' compute time that iteration; before: "
      "median over iterations 1..%d of every round, run on the initial placement (a balancer "
      "decides first in iteration 2 and its moves act from iteration 3); after: median over "
      "iterations %d..%d\n"
      "# moved: layers moved in the whole run (last round); ranges: the final placement; stage "
      "ms: each stage's median compute per iteration (after)\n"
      "# speedup: the best static configuration's median iter ms (%s) / this one's\n",
      FLAGS_skip_iters + 1, FLAGS_train_iters, FLAGS_before_iters, FLAGS_skip_iters + 1,
      FLAGS_train_iters,
      best_static_name.empty() ? "none measured: no none or params run" : best_static_name.c_str());
  std::printf("\n%-10s %9s %7s %10s %9s %6s  %-22s %-16s %8s\n", "config", "iter ms", "bubble",
              "imb before", "imb after", "moved", "final ranges", "stage ms", "speedup");
  for (const Config& c : configs) {
    auto it = summary.find(c.name);
    if (it == summary.end()) {
      std::printf("%-10s %9s\n", c.name.c_str(), "failed");
      continue;
    }
    const Summary& s = it->second;
    const Run& last = results[c.name].rbegin()->second;
    std::string ranges = last.iterations.back().stage_ranges;
    for (const auto& [round, run] : results[c.name]) {
      if (run.iterations.back().stage_ranges != ranges) ranges = "differs by round";
    }
    std::printf("%-10s %9.1f %7.3f %10s %9.3f %6lld  %-22s %-16s %8s\n", c.name.c_str(),
                s.iteration_ms, s.bubble_ratio, Cell(s.imbalance_before, "%.3f").c_str(),
                s.imbalance_after, static_cast<long long>(last.iterations.back().layers_moved),
                ranges.c_str(), StageCell(s.stage_ms).c_str(),
                Cell(best_static / s.iteration_ms, "%.3f").c_str());
  }

  std::printf("\nper round (load: 1-minute load average when the run started; it still counts the "
              "previous run's own %d ranks):\n", FLAGS_pp);
  std::printf("%5s %-10s %6s %9s %7s %10s %9s %6s  %-22s %-16s %6s\n", "round", "config", "load",
              "iter ms", "bubble", "imb before", "imb after", "moved", "final ranges", "stage ms",
              "wall s");
  for (int round = 1; round <= FLAGS_rounds; ++round) {
    for (const Config& c : configs) {
      auto it = results[c.name].find(round);
      if (it == results[c.name].end()) {
        std::printf("%5d %-10s %6s %9s\n", round, c.name.c_str(), "", "failed");
        continue;
      }
      const Run& run = it->second;
      const Summary s = Summarize({&run}, FLAGS_pp);
      std::printf("%5d %-10s %6s %9.1f %7.3f %10s %9.3f %6lld  %-22s %-16s %6.0f\n", round,
                  c.name.c_str(), Cell(run.load_before < 0 ? NAN : run.load_before, "%.2f").c_str(),
                  s.iteration_ms, s.bubble_ratio, Cell(s.imbalance_before, "%.3f").c_str(),
                  s.imbalance_after, static_cast<long long>(run.iterations.back().layers_moved),
                  run.iterations.back().stage_ranges.c_str(), StageCell(s.stage_ms).c_str(),
                  run.seconds);
    }
  }

  // The loss check: the first run of `none` (else of the first configuration) is the reference.
  const Config* reference = nullptr;
  for (const Config& c : configs) {
    if (reference == nullptr || c.name == "none") reference = &c;
  }
  bool losses_differ = false;
  auto ref_runs = reference == nullptr ? results.end() : results.find(reference->name);
  if (reference == nullptr) {
    // Only the re-packing row (--configs=).
  } else if (ref_runs == results.end() || ref_runs->second.empty()) {
    std::printf("\nloss check: not done, no run of the reference %s completed\n",
                reference->name.c_str());
  } else {
    const auto& [ref_round, ref_run] = *ref_runs->second.begin();
    std::printf("\nloss check: every run's loss per iteration vs %s round %d, relative "
                "(tolerance %g):\n", reference->name.c_str(), ref_round, FLAGS_loss_tolerance);
    for (const Config& c : configs) {
      if (results[c.name].empty()) {
        std::printf("  %-10s no completed run\n", c.name.c_str());
        continue;
      }
      double worst = 0;
      for (const auto& [round, run] : results[c.name]) {
        worst = std::max(worst, MaxRelativeLossDifference(run, ref_run));
      }
      const bool ok = worst <= FLAGS_loss_tolerance;
      losses_differ = losses_differ || !ok;
      std::printf("  %-10s max relative difference %-10s over %zu run(s) x %d iterations  %s\n",
                  c.name.c_str(), Cell(worst, "%.3g").c_str(), results[c.name].size(),
                  FLAGS_train_iters, ok ? "ok" : "DIFFERS");
    }
  }

  if (FLAGS_repack_row && !RunRepackRow(bin_dir, work_dir)) failed = true;

  std::printf("\n# %d runs in %.0f s; 1-minute load average %s before, %s after\n",
              FLAGS_rounds * static_cast<int>(configs.size()), total_s,
              load_start < 0 ? "unknown" : absl::StrFormat("%.2f", load_start).c_str(),
              load_end < 0 ? "unknown" : absl::StrFormat("%.2f", load_end).c_str());
  if (FLAGS_pp > cores) {
    std::printf("# WARNING: oversubscribed (pp=%d on %d cores): timings not meaningful\n",
                FLAGS_pp, cores);
  }
  if (FLAGS_keep_logs) {
    std::printf("# logs and metrics: %s\n", work_dir.c_str());
  } else {
    std::system(absl::StrCat("rm -rf '", work_dir, "'").c_str());
  }
  return failed || losses_differ ? 1 : 0;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_balance";
  help.usage =
      "fulcrum_bench_balance: iteration time, bubble and imbalance of static partitions (none,\n"
      "params) vs the partition and diffusion rebalancers on a model whose heavy layers sit on\n"
      "one side, interleaved over --rounds, plus the check that every configuration's losses\n"
      "equal the uniform run's. Runs fulcrum_launch + fulcrum_train built next to it.\n\n"
      "  fulcrum_bench_balance [--configs=none,params,partition,diffusion] [--rounds=2]\n"
      "      [--train_iters=40] [--skip_iters=10] [--pp=2] [--schedule=zbh1] [--recipe=tiny_moe]\n"
      "  fulcrum_bench_balance --rounds=1 --train_iters=12 --skip_iters=4     a quick run\n\n"
      "Exit status: 0 done and the losses agree, 2 bad flags (or fulcrum_train rejected the\n"
      "flags), 1 a run failed or a configuration's losses differ from the reference.\n";
  help.groups = {
      {"Runs", {"configs", "rounds", "train_iters", "skip_iters", "before_iters", "pp",
                "schedule", "recipe", "model_flags"}},
      {"Checks and output", {"loss_tolerance", "keep_logs"}},
      {"Re-packing row", {"repack_row", "repack_model_flags", "repack_iters",
                          "repack_auto_max_slowdown", "repack_at"}},
  };
  if (std::optional<int> code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *code;
  }
  return fulcrum::Main(fulcrum::bench::BinDir(argv[0]));
}
