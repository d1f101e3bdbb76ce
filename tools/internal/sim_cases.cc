#include "tools/internal/sim_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fulcrum::sim {
namespace {

// Measured by tools/fulcrum_bench_dynamism (1 thread, gpt_20m layer, seq 256 × micro-batch 4,
// dense layer 235 ms): a pruned layer's time over the dense layer's at 50/80/90% sparsity
// (sparse compute; below ~75% the dense kernels still win), a frozen layer's (no backward),
// and a MoD-routed layer's at capacity 0.125.
constexpr double kPrunedRatio[][2] = {{0.0, 1.0}, {0.5, 1.01}, {0.8, 0.60}, {0.9, 0.42}};
constexpr double kFrozenRatio = 0.34;
constexpr double kModRoutedRatio = 0.15;  // Capacity 0.125 (Raposo et al.'s 12.5%).
// A layer with hash sparse attention over the dense layer (SDPA), by the score density its
// buckets gave, measured by `fulcrum_bench_dynamism --attention_seq=2048 --micro_batch=1
// --buckets=2,4,8,16,32,64 --reps=5` (gpt_20m layer, one thread, F+B+W medians; 64, 32, 16,
// 8, 4, 2 buckets in density order). Our CPU kernel computes blocks of 64 with gathers and
// index_add: above ~10% density it is slower than dense attention. Timed while the other
// core built, so good to about ±0.2 (a 3-repetition run gave 1.25 at 0.12, 1.62 at 0.18).
constexpr double kSparseAttentionRatio[][2] = {{0.07, 0.85}, {0.08, 0.95}, {0.09, 0.99},
                                               {0.12, 1.03}, {0.18, 1.38}, {0.30, 2.22}};

std::string SparseAttentionCurveText() {
  std::vector<std::string> points;
  for (const auto& [density, ratio] : kSparseAttentionRatio) {
    points.push_back(absl::StrFormat("%.2f -> %.2fx", density, ratio));
  }
  return absl::StrJoin(points, ", ");
}

double PrunedRatio(double sparsity) {
  constexpr int n = sizeof(kPrunedRatio) / sizeof(kPrunedRatio[0]);
  if (sparsity >= kPrunedRatio[n - 1][0]) return kPrunedRatio[n - 1][1];
  for (int i = 1; i < n; ++i) {
    if (sparsity <= kPrunedRatio[i][0]) {
      const double t = (sparsity - kPrunedRatio[i - 1][0]) / (kPrunedRatio[i][0] - kPrunedRatio[i - 1][0]);
      return kPrunedRatio[i - 1][1] + t * (kPrunedRatio[i][1] - kPrunedRatio[i - 1][1]);
    }
  }
  return 1.0;
}

// Zhu & Gupta's cubic schedule as DynMo runs it (§4.2): S_i = 0, S_f = 0.9, from real
// iteration 3000 every 1000 to 7000 (0, 52, 79, 89, 90%).
double PruningSparsity(double real_iteration) {
  if (real_iteration < 3000) return 0;
  const double step = std::min(4.0, std::floor((real_iteration - 3000) / 1000));
  return 0.9 * (1 - std::pow(1 - step / 4, 3));
}

// The mean over columns (layers) of the lag-1 autocorrelation of rows[t][column] over t:
// how much of one iteration's load the next keeps (1: all, 0: none), what a balancer acting
// on the loads it measured can follow.
double MeanLag1Autocorrelation(const std::vector<std::vector<double>>& rows) {
  if (rows.size() < 3) return 0;
  double sum = 0;
  size_t columns = rows.front().size();
  for (const auto& row : rows) columns = std::min(columns, row.size());
  for (size_t c = 0; c < columns; ++c) {
    double mean = 0;
    for (const auto& row : rows) mean += row[c];
    mean /= static_cast<double>(rows.size());
    double lagged = 0, variance = 0;
    for (size_t t = 0; t < rows.size(); ++t) {
      variance += (rows[t][c] - mean) * (rows[t][c] - mean);
      if (t + 1 < rows.size()) lagged += (rows[t][c] - mean) * (rows[t + 1][c] - mean);
    }
    sum += variance > 0 ? lagged / variance : 0;
  }
  return columns > 0 ? sum / static_cast<double>(columns) : 0;
}

// The phases of iterations 1..iterations: each maximal run of iterations with the same
// label(i); a label that comes back later starts a second phase of that name.
template <typename Label>
std::vector<CasePhase> PhasesOf(int64_t iterations, Label label) {
  std::vector<CasePhase> phases;
  for (int64_t i = 1; i <= iterations; ++i) {
    std::string name = label(i);
    if (phases.empty() || phases.back().label != name) {
      phases.push_back({std::move(name), i, i});
    } else {
      phases.back().last = i;
    }
  }
  return phases;
}

// One layer's costs from the dense split, the parts scaled.
void SetLayer(dynamic::IterationCosts* c, int64_t l, const DenseLayer& d, double gemm, double scores,
              double mlp, bool backward = true) {
  c->forward[l] = d.attention_gemm_f * gemm + d.scores_f * scores + d.mlp_f * gemm * mlp;
  c->backward[l] = backward ? d.attention_gemm_b * gemm + d.scores_b * scores + d.mlp_b * gemm * mlp : 0;
  c->weight[l] = backward ? d.attention_gemm_w * gemm + d.mlp_w * gemm * mlp : 0;
}

dynamic::Scenario Base(const std::string& name, int stages, const CaseOptions& o, int64_t layers) {
  dynamic::Scenario s;
  s.name = name;
  s.num_stages = o.num_stages > 0 ? o.num_stages : stages;
  s.num_microbatches = o.num_microbatches > 0 ? o.num_microbatches : 4 * s.num_stages;
  s.schedule = o.schedule;
  s.iterations = o.iterations;
  s.network = o.network;
  s.network.p2p_bytes = static_cast<double>(o.shape.micro_batch * o.shape.seq_length * o.shape.hidden) *
                        o.shape.bytes_per_activation;
  s.tokens_per_iteration =
      static_cast<double>(s.num_microbatches * o.shape.micro_batch * o.shape.seq_length);
  (void)layers;
  return s;
}

}  // namespace

DenseLayer DenseLayerCosts(const GptShape& shape) {
  const double b = static_cast<double>(shape.micro_batch), s = static_cast<double>(shape.seq_length);
  const double h = static_cast<double>(shape.hidden), v = static_cast<double>(shape.vocab);
  const double ms_per_flop = 1e3 / (shape.device_tflops * 1e12);
  DenseLayer d;
  d.attention_gemm_f = d.attention_gemm_b = d.attention_gemm_w = 8 * b * s * h * h * ms_per_flop;
  d.scores_f = 4 * b * s * s * h * ms_per_flop;
  d.scores_b = 2 * d.scores_f;
  d.mlp_f = d.mlp_b = d.mlp_w = 16 * b * s * h * h * ms_per_flop;
  d.head_f = 2 * b * s * h * v * ms_per_flop;
  d.parameters = 12 * h * h + 13 * h;  // QKV, proj, MLP with biases; two LayerNorms.
  d.head_parameters = v * h + 2 * h;   // Final norm and the untied LM head.
  d.embedding_parameters = v * h + s * h;
  return d;
}

dynamic::IterationCosts DenseCosts(const GptShape& shape) {
  const DenseLayer d = DenseLayerCosts(shape);
  dynamic::IterationCosts c;
  c.forward.assign(shape.layers, d.f());
  c.backward.assign(shape.layers, d.b());
  c.weight.assign(shape.layers, d.w());
  c.parameters.assign(shape.layers, d.parameters);
  c.state_bytes.assign(shape.layers, d.parameters * shape.bytes_per_state_param);
  c.last_forward = c.last_backward = c.last_weight = d.head_f;
  c.first_parameters = d.embedding_parameters;
  c.last_parameters = d.head_parameters;
  return c;
}

std::vector<std::string> CaseNames() {
  return {"moe",           "moe_calibrated",   "pruning",    "freezing",
          "freezing_free", "sparse_attention", "early_exit", "mod"};
}

dynamic::Scenario DenseScenario(const NamedCase& named, const CaseOptions& options) {
  dynamic::Scenario s = named.scenario;
  GptShape shape = options.shape;
  shape.layers = named.scenario.costs ? named.scenario.costs(1).num_layers() : shape.layers;
  const dynamic::IterationCosts dense = DenseCosts(shape);
  s.name = named.name + " (dense)";
  s.costs = [dense](int64_t) { return dense; };
  return s;
}

namespace {

// The layer of a per-layer metrics key: "layers.<i>", as the units name themselves; -1 for
// anything else.
int LayerOfKey(const std::string& name) {
  int layer = -1;
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || !absl::SimpleAtoi(name.substr(dot + 1), &layer)) return -1;
  return layer < 0 ? -1 : layer;
}

// One metrics line's object of per-layer fractions ({"layers.<i>": value}) in layer order:
// each value a number in [0, 1] (`meaning` says what it is, for the error), every layer from
// 0 named once; empty for an empty object. InvalidArgument naming `field` and the key.
absl::StatusOr<std::vector<double>> ParseLayerFractions(const nlohmann::json& layers,
                                                        const std::string& field,
                                                        const std::string& meaning) {
  if (!layers.is_object()) return absl::InvalidArgumentError(field + " is not an object");
  std::vector<std::pair<int, double>> per_layer;
  for (const auto& [name, value] : layers.items()) {
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0 ||
        value.get<double>() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, " '", name, "' holds ", value.dump(),
                                                     "; expected ", meaning, " in [0, 1]"));
    }
    const int layer = LayerOfKey(name);
    if (layer < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", name, "' is not a layer ('layers.<i>')"));
    }
    per_layer.emplace_back(layer, value.get<double>());
  }
  std::sort(per_layer.begin(), per_layer.end());
  std::vector<double> row;
  for (const auto& [layer, value] : per_layer) row.push_back(value);
  bool each_once = true;  // layers 0..n-1, each once ("layers.0" and "x.0" are one layer)
  for (size_t i = 0; i < per_layer.size(); ++i) each_once = each_once && per_layer[i].first == static_cast<int>(i);
  if (!each_once) {
    return absl::InvalidArgumentError(absl::StrCat(field, " names layers up to ",
                                                   per_layer.back().first, " but holds ",
                                                   row.size(), " (one entry per layer from 0)"));
  }
  return row;
}

}  // namespace

absl::StatusOr<std::vector<std::vector<double>>> LoadExpertImbalance(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open the MoE metrics file '", path, "'"));
  return ParseExpertImbalance(in, path);
}

absl::StatusOr<std::vector<std::vector<double>>> ParseExpertImbalance(std::istream& in,
                                                                      const std::string& path) {
  std::vector<std::vector<double>> rows;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("expert_tokens") ||
        !j["expert_tokens"].is_object()) {
      continue;
    }
    std::vector<std::pair<int, double>> per_layer;
    for (const auto& [name, tokens] : j["expert_tokens"].items()) {
      if (!tokens.is_array() || tokens.empty()) continue;
      double sum = 0, max = 0;
      for (const auto& t : tokens) {
        if (!t.is_number() || !std::isfinite(t.get<double>()) || t.get<double>() < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ":", number, ": expert_tokens '", name, "' holds ", t.dump(),
              "; expected token counts >= 0"));
        }
        sum += t.get<double>();
        max = std::max(max, t.get<double>());
      }
      const double mean = sum / static_cast<double>(tokens.size());
      const int layer = LayerOfKey(name);
      if (layer < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", number, ": expert_tokens '", name, "' is not a layer ('layers.<i>')"));
      }
      if (mean > 0) per_layer.emplace_back(layer, max / mean);
    }
    if (per_layer.empty()) continue;
    std::sort(per_layer.begin(), per_layer.end());
    std::vector<double> row;
    for (const auto& [layer, ratio] : per_layer) row.push_back(ratio);
    rows.push_back(std::move(row));
  }
  if (rows.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' holds no expert_tokens (a fulcrum_train --metrics_file of a MoE run)"));
  }
  return rows;
}

absl::StatusOr<std::vector<std::vector<double>>> LoadExitFractions(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open the early-exit metrics file '", path, "'"));
  return ParseExitFractions(in, path);
}

absl::StatusOr<std::vector<std::vector<double>>> ParseExitFractions(std::istream& in,
                                                                    const std::string& path) {
  std::vector<std::vector<double>> rows;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("early_exit_tokens") ||
        !j["early_exit_tokens"].is_object()) {
      continue;
    }
    std::vector<std::pair<int, double>> computed;
    double entered = 0;
    for (const auto& [name, counts] : j["early_exit_tokens"].items()) {
      if (!counts.is_array() || counts.size() < 2) continue;
      if (!counts[0].is_number() || !counts[1].is_number() ||
          !std::isfinite(counts[0].get<double>()) || counts[0].get<double>() < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", number, ": early_exit_tokens '", name, "' holds ", counts.dump(),
            "; expected [computed, seen, exited] token counts >= 0"));
      }
      const int layer = LayerOfKey(name);
      if (layer < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", number, ": early_exit_tokens '", name, "' is not a layer ('layers.<i>')"));
      }
      computed.emplace_back(layer, counts[0].get<double>());
      if (layer == 0) entered = counts[1].get<double>();
    }
    if (computed.empty() || entered <= 0) continue;
    std::sort(computed.begin(), computed.end());
    std::vector<double> row;
    for (const auto& [layer, tokens] : computed) row.push_back(tokens / entered);
    rows.push_back(std::move(row));
  }
  if (rows.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' holds no early_exit_tokens (a fulcrum_train --metrics_file of an early_exit run)"));
  }
  return rows;
}

PhaseSlice SliceOf(const dynamic::SimulatedRun& run, const CasePhase& phase) {
  PhaseSlice slice;
  for (const dynamic::SimulatedIteration& it : run.iterations) {
    if (it.iteration < phase.first || it.iteration > phase.last) continue;
    slice.ms += it.iteration_ms;
    slice.bubble += it.bubble_ratio;
    ++slice.iterations;
  }
  if (slice.iterations > 0) slice.bubble /= static_cast<double>(slice.iterations);
  return slice;
}

std::vector<double> PruneProfile::DensityAt(double model_sparsity) const {
  const size_t layers = num_layers();
  std::vector<double> out(layers, 1.0);
  if (empty() || model_sparsity <= 0) return out;
  if (model_sparsity >= sparsity.back()) return density.back();
  // Between step k−1 (or sparsity 0, every layer dense) and step k.
  size_t k = 0;
  while (sparsity[k] < model_sparsity) ++k;
  const double s0 = k == 0 ? 0.0 : sparsity[k - 1];
  const double t = sparsity[k] > s0 ? (model_sparsity - s0) / (sparsity[k] - s0) : 1.0;
  for (size_t l = 0; l < layers; ++l) {
    const double d0 = k == 0 ? 1.0 : density[k - 1][l];
    out[l] = d0 + t * (density[k][l] - d0);
  }
  return out;
}

std::pair<double, double> PruneProfile::SparsitySpread() const {
  if (empty()) return {0.0, 0.0};
  const auto [lo, hi] = std::minmax_element(density.back().begin(), density.back().end());
  return {1.0 - *hi, 1.0 - *lo};
}

absl::StatusOr<PruneProfile> LoadPruneProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open the pruning metrics file '", path, "'"));
  }
  return ParsePruneProfile(in, path);
}

absl::StatusOr<PruneProfile> ParsePruneProfile(std::istream& in, const std::string& path) {
  PruneProfile profile;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("prune_target_sparsity")) continue;
    const auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", what));
    };
    if (!j["prune_target_sparsity"].is_number() || !j.contains("prune_layer_density") ||
        !j["prune_layer_density"].is_object()) {
      return bad("a pruning step needs a numeric \"prune_target_sparsity\" and a "
                 "\"prune_layer_density\" object");
    }
    // Keyed on the schedule's target (the measured sparsity is within one weight of it), so
    // the case, which asks for the same schedule, gets each step's densities exactly.
    const double sparsity = j["prune_target_sparsity"].get<double>();
    if (!std::isfinite(sparsity) || sparsity < 0 || sparsity >= 1) {
      return bad(absl::StrCat("prune_target_sparsity ", j["prune_target_sparsity"].dump(),
                              " is not in [0, 1)"));
    }
    if (!profile.empty() && sparsity < profile.sparsity.back()) {
      return bad(absl::StrCat("sparsity ", sparsity, " falls below the step before's ",
                              profile.sparsity.back(), " (masks only grow)"));
    }
    absl::StatusOr<std::vector<double>> row =
        ParseLayerFractions(j["prune_layer_density"], "prune_layer_density", "a kept fraction");
    if (!row.ok()) return bad(std::string(row.status().message()));
    if (row->empty()) continue;
    if (!profile.empty() && row->size() != profile.num_layers()) {
      return bad(absl::StrCat(row->size(), " layers where the steps before had ",
                              profile.num_layers()));
    }
    if (sparsity <= 0) continue;  // A step at sparsity 0 pruned nothing.
    profile.sparsity.push_back(sparsity);
    profile.density.push_back(*std::move(row));
  }
  if (profile.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' holds no pruning step (a fulcrum_train --plugins=prune --metrics_file)"));
  }
  return profile;
}

absl::StatusOr<std::vector<std::vector<double>>> LoadAttentionDensity(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open the sparse-attention metrics file '", path, "'"));
  }
  return ParseAttentionDensity(in, path);
}

absl::StatusOr<std::vector<std::vector<double>>> ParseAttentionDensity(std::istream& in,
                                                                       const std::string& path) {
  std::vector<std::vector<double>> rows;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("sparse_attention_layer_density")) {
      continue;
    }
    const auto bad = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", what));
    };
    absl::StatusOr<std::vector<double>> row =
        ParseLayerFractions(j["sparse_attention_layer_density"], "sparse_attention_layer_density",
                            "a score density");
    if (!row.ok()) return bad(std::string(row.status().message()));
    if (row->empty()) continue;
    if (!rows.empty() && row->size() != rows.front().size()) {
      return bad(absl::StrCat(row->size(), " layers where the iterations before had ",
                              rows.front().size()));
    }
    rows.push_back(*std::move(row));
  }
  if (rows.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' holds no sparse_attention_layer_density (a fulcrum_train "
        "--plugins=sparse_attention --metrics_file)"));
  }
  return rows;
}

double SparseAttentionLayerRatio(double density) {
  constexpr int n = sizeof(kSparseAttentionRatio) / sizeof(kSparseAttentionRatio[0]);
  if (density <= kSparseAttentionRatio[0][0]) return kSparseAttentionRatio[0][1];
  for (int i = 1; i < n; ++i) {
    if (density <= kSparseAttentionRatio[i][0]) {
      const double t = (density - kSparseAttentionRatio[i - 1][0]) /
                       (kSparseAttentionRatio[i][0] - kSparseAttentionRatio[i - 1][0]);
      return kSparseAttentionRatio[i - 1][1] +
             t * (kSparseAttentionRatio[i][1] - kSparseAttentionRatio[i - 1][1]);
    }
  }
  return kSparseAttentionRatio[n - 1][1];
}

namespace {

// The profile tools/profiles/<name>.jsonl, parsed by `parse`; its "source" line says what
// made it. A compiled-in profile that does not parse is a build defect: abort naming it.
template <typename T, typename Parse>
Measured<T> ParseEmbedded(const char* name, Parse parse) {
  const std::string_view text = EmbeddedProfile(name);
  const std::string where = absl::StrCat("tools/profiles/", name, ".jsonl");
  std::istringstream in{std::string(text)};
  std::string first;
  std::getline(in, first);
  const nlohmann::json head = nlohmann::json::parse(first, nullptr, false);
  std::istringstream all{std::string(text)};
  absl::StatusOr<T> value = parse(all, where);
  if (text.empty() || !value.ok() || !head.is_object() || !head.contains("source") ||
      !head["source"].is_string()) {
    std::fprintf(stderr, "fulcrum_sim: the compiled-in %s is broken: %s\n", where.c_str(),
                 text.empty() ? "missing" : value.ok() ? "no \"source\" first line"
                                                       : std::string(value.status().message()).c_str());
    std::abort();
  }
  return {*std::move(value), absl::StrCat(head["source"].get<std::string>(), " (", where, ")")};
}

}  // namespace

const Measured<std::vector<std::vector<double>>>& MeasuredExpertImbalance() {
  static const auto* measured = new Measured<std::vector<std::vector<double>>>(
      ParseEmbedded<std::vector<std::vector<double>>>("moe", ParseExpertImbalance));
  return *measured;
}

const Measured<std::vector<std::vector<double>>>& MeasuredExitFractions() {
  static const auto* measured = new Measured<std::vector<std::vector<double>>>(
      ParseEmbedded<std::vector<std::vector<double>>>("early_exit", ParseExitFractions));
  return *measured;
}

const Measured<std::vector<std::vector<double>>>& MeasuredAttentionDensity() {
  static const auto* measured = new Measured<std::vector<std::vector<double>>>(
      ParseEmbedded<std::vector<std::vector<double>>>("sparse_attention", ParseAttentionDensity));
  return *measured;
}

const Measured<PruneProfile>& MeasuredPruneProfile() {
  static const auto* measured =
      new Measured<PruneProfile>(ParseEmbedded<PruneProfile>("prune", ParsePruneProfile));
  return *measured;
}

namespace {

// What every case's costs are built from: its options, the dense layer and model at the
// case's layer count, and how many real (DynMo) iterations one simulated iteration stands for.
struct CaseInputs {
  const CaseOptions& o;
  std::string name;
  std::shared_ptr<DenseLayer> dense_layer;
  dynamic::IterationCosts dense;
  int64_t layers = 0;
  double real_per_sim = 1;
  int stages = 0;  ///< The case's own stage count (Base overrides it with --stages).
};

// moe: every layer MoE, its MLP time scaled by the measured expert imbalance.
void MoeCase(const CaseInputs& in, NamedCase* out_case) {
  const CaseOptions& o = in.o;
  const auto& dense_layer = in.dense_layer;
  const dynamic::IterationCosts& dense = in.dense;
  const int64_t layers = in.layers;
  NamedCase& out = *out_case;
  out.dynmo = "idle 25% -> 8%, 1.23x (LLaMA-MoE; 1.21x Mixtral)";
  if (o.expert_imbalance.empty()) {
    out.measured = false;
    out.why_not = "no expert-token measurements given (--moe_metrics=PATH of a MoE run)";
    return;
  }
  auto rows = std::make_shared<std::vector<std::vector<double>>>(o.expert_imbalance);
  if (o.moe_amplitude != 1) {
    for (auto& row : *rows) {
      for (double& r : row) r = 1 + o.moe_amplitude * (r - 1);
    }
  }
  out.provenance = absl::StrCat(
      "every layer MoE, 8 experts as wide as the MLP, top-2, one expert per GPU (EP 8): a "
      "layer's MLP time = 2 x (max/mean tokens per expert) x dense MLP, the ratio per layer and "
      "iteration from our router",
      o.moe_amplitude != 1 ? absl::StrFormat(" with its excess over 1 scaled by %.3g", o.moe_amplitude)
                           : std::string(),
      ": ", o.expert_imbalance_source, " (", rows->size(),
      " iterations x ", rows->front().size(),
      " layers, lag-1 autocorrelation of a layer's imbalance ",
      absl::StrFormat("%.2f", MeanLag1Autocorrelation(*rows)),
      "; layer l replays measured layer l mod ", rows->front().size(),
      ", each further copy 7 iterations later)");
  // Layer l replays measured layer l % C, the copies (l / C) shifted by 7 iterations each
  // so that they are not in lockstep (C = 8 in the compiled-in profile).
  out.scenario.costs = [dense, dense_layer, rows, layers](int64_t i) {
    dynamic::IterationCosts c = dense;
    const size_t columns = rows->front().size();
    for (int64_t l = 0; l < layers; ++l) {
      const size_t copy = static_cast<size_t>(l) / columns;
      const std::vector<double>& row = (*rows)[(static_cast<size_t>(i - 1) + 7 * copy) % rows->size()];
      SetLayer(&c, l, *dense_layer, 1.0, 1.0, 2.0 * row[static_cast<size_t>(l) % row.size()]);
    }
    return c;
  };
}

// The mean idle fraction of the MoE case's stages under its best static placement (the
// faster of uniform and by-parameters, as the DynMo table picks it) when each layer's
// imbalance is scaled by `amplitude`.
absl::StatusOr<double> MoeStaticIdle(const CaseInputs& in, double amplitude) {
  CaseOptions scaled = in.o;
  scaled.moe_amplitude = amplitude;
  const CaseInputs with{scaled,    in.name,         in.dense_layer, in.dense,
                        in.layers, in.real_per_sim, in.stages};
  NamedCase c;
  c.scenario = Base("moe", in.stages, scaled, in.layers);
  MoeCase(with, &c);
  double best_ms = 0, idle = 0;
  for (int k : {0, 1}) {  // StandardStrategies: uniform, params
    absl::StatusOr<dynamic::SimulatedRun> run = dynamic::SimulateRun(
        c.scenario, dynamic::StandardStrategies()[k], dynamic::BalancerOptions{});
    if (!run.ok()) return run.status();
    if (best_ms == 0 || run->total_ms < best_ms) {
      best_ms = run->total_ms;
      idle = run->mean_bubble_ratio;
    }
  }
  return idle;
}

// moe_calibrated: the moe case with each layer's imbalance excess scaled (r -> 1 + k (r - 1))
// so that the best static placement idles kMoeTargetIdle, DynMo's static idle for LLaMA-MoE;
// k by bisection (idle grows with k). When the model idles more without any imbalance (the LM
// head's floor), k = 0 and the provenance says so.
constexpr double kMoeTargetIdle = 0.25;

void MoeCalibratedCase(const CaseInputs& in, NamedCase* out_case) {
  NamedCase& out = *out_case;
  if (in.o.expert_imbalance.empty()) {
    MoeCase(in, out_case);
    return;
  }
  absl::StatusOr<double> floor = MoeStaticIdle(in, 0.0);
  double lo = 0, hi = 1;
  std::string why;
  if (!floor.ok()) {
    out.measured = false;
    out.why_not = absl::StrCat("the calibration's simulation failed: ", floor.status().message());
    return;
  }
  if (*floor >= kMoeTargetIdle) {
    hi = 0;
    why = absl::StrFormat("; the model idles %.1f%% with no imbalance at all, so k = 0", 100 * *floor);
  } else {
    // Widen until the idle passes the target, then halve the bracket 12 times.
    absl::StatusOr<double> idle = MoeStaticIdle(in, hi);
    for (; idle.ok() && *idle < kMoeTargetIdle && hi < 64; idle = MoeStaticIdle(in, hi)) {
      lo = hi;
      hi *= 2;
    }
    if (idle.ok() && *idle < kMoeTargetIdle) {
      why = absl::StrFormat("; not reached: even k = %.0f idles only %.1f%%", hi, 100 * *idle);
      lo = hi;  // no bisection: report the largest scale tried
    }
    for (int step = 0; step < 12 && lo < hi; ++step) {  // k to within 1/4096 of the bracket
      const double mid = (lo + hi) / 2;
      absl::StatusOr<double> at = MoeStaticIdle(in, mid);
      if (!at.ok()) break;
      (*at < kMoeTargetIdle ? lo : hi) = mid;
    }
  }
  CaseOptions scaled = in.o;
  scaled.moe_amplitude = hi;
  const CaseInputs with{scaled,    in.name,         in.dense_layer, in.dense,
                        in.layers, in.real_per_sim, in.stages};
  MoeCase(with, &out);
  out.provenance = absl::StrCat(
      out.provenance, absl::StrFormat("; calibrated: k = %.3f, the scale at which the best "
                                      "static placement idles %.0f%% (DynMo's LLaMA-MoE)",
                                      hi, 100 * kMoeTargetIdle),
      why);
}

// mod: every other layer routes 12.5% of the tokens.
void ModCase(const CaseInputs& in, NamedCase* out_case) {
  const dynamic::IterationCosts& dense = in.dense;
  NamedCase& out = *out_case;
  out.dynmo = "idle 18% -> 4%, 1.17x";
  out.versus_dense = true;  // every layer routing all tokens
  out.provenance = absl::StrFormat(
      "every other layer (1, 3, ...) routes 12.5%% of the tokens (Raposo et al.): %.2fx the "
      "routed layer's time, measured by fulcrum_bench_dynamism (capacity 0.125)",
      kModRoutedRatio);
  out.scenario.costs = [dense](int64_t) {
    dynamic::IterationCosts c = dense;
    for (int64_t l = 1; l < c.num_layers(); l += 2) {
      c.forward[l] *= kModRoutedRatio;
      c.backward[l] *= kModRoutedRatio;
      c.weight[l] *= kModRoutedRatio;
    }
    return c;
  };
}

// pruning: DynMo's schedule, each layer at the sparsity global pruning gave it.
void PruningCase(const CaseInputs& in, NamedCase* out_case) {
  const CaseOptions& o = in.o;
  const auto& dense_layer = in.dense_layer;
  const dynamic::IterationCosts& dense = in.dense;
  const int64_t layers = in.layers;
  const double real_per_sim = in.real_per_sim;
  NamedCase& out = *out_case;
  out.dynmo = "up to 3.18x; re-packing 8 -> 5.8 GPUs";
  out.versus_dense = true;
  out.dynmo_compares = "S_total";
  if (o.prune_profile.empty()) {
    out.measured = false;
    out.why_not =
        "not measured: give --prune_metrics=PATH, the --metrics_file of a fulcrum_train "
        "--plugins=prune run (its per-layer densities at each pruning step)";
    return;
  }
  auto profile = std::make_shared<PruneProfile>(o.prune_profile);
  const auto [least, most] = profile->SparsitySpread();
  out.provenance = absl::StrFormat(
      "global magnitude pruning on DynMo's schedule (0, 52, 79, 89, 90%% at real iterations "
      "3000..7000 of 10 000); each layer's GEMMs at the sparsity global pruning gave that "
      "layer in %s (%d layers; layer l takes measured layer l x %d / %d; at %.0f%% overall the "
      "layers hold %.1f%%..%.1f%%), time ratio interpolated from fulcrum_bench_dynamism "
      "(50/80/90%% -> 1.01/0.60/0.42x); attention scores and the LM head not pruned",
      o.prune_profile_source, profile->num_layers(), profile->num_layers(), layers,
      100 * profile->sparsity.back(), 100 * least, 100 * most);
  out.scenario.costs = [dense, dense_layer, layers, real_per_sim, profile](int64_t i) {
    dynamic::IterationCosts c = dense;
    const double sparsity = PruningSparsity(static_cast<double>(i) * real_per_sim);
    const std::vector<double> density = profile->DensityAt(sparsity);
    for (int64_t l = 0; l < layers; ++l) {
      const size_t measured = static_cast<size_t>(l) * density.size() / static_cast<size_t>(layers);
      const double kept = density[measured];
      SetLayer(&c, l, *dense_layer, PrunedRatio(1.0 - kept), 1.0, 1.0);
    }
    const double next = PruningSparsity(static_cast<double>(i + 1) * real_per_sim);
    if (next != sparsity) {
      c.model_changed = true;
      c.change_reason = absl::StrFormat("pruned to %.1f%%", 100 * next);
    }
    return c;
  };
  out.phases = PhasesOf(o.iterations, [real_per_sim](int64_t i) {
    const double sparsity = PruningSparsity(static_cast<double>(i) * real_per_sim);
    return sparsity == 0 ? std::string("dense")
                         : absl::StrFormat("%.0f%% pruned", 100 * sparsity);
  });
}

// freezing and freezing_free: 40 of 48 layers frozen front to back, forward only or free.
void FreezingCase(const CaseInputs& in, NamedCase* out_case) {
  const CaseOptions& o = in.o;
  const std::string& name = in.name;
  const auto& dense_layer = in.dense_layer;
  const dynamic::IterationCosts& dense = in.dense;
  const int64_t layers = in.layers;
  NamedCase& out = *out_case;
  out.dynmo = "2.23x (idle ~40%, 40 layers)";
  out.versus_dense = true;
  out.dynmo_compares = "S_total";
  // DynMo freezes 40 of 48 layers; other layer counts freeze the same share. Its load model
  // counts a frozen layer as free (freezing_free); ours runs its forward (freezing).
  const bool free = name == "freezing_free";
  const int64_t frozen_max = layers * 40 / 48;
  out.provenance =
      free ? absl::StrFormat(
                 "front-to-back freezing of %d of %d layers between 20%% and 80%% of the run; a "
                 "frozen layer costs nothing (DynMo's load model; ours runs its forward: the "
                 "freezing case)",
                 frozen_max, layers)
           : absl::StrFormat(
                 "front-to-back freezing of %d of %d layers between 20%% and 80%% of the run; a "
                 "frozen layer runs its forward only (%.2fx the dense layer, "
                 "fulcrum_bench_dynamism; the FLOP model's F share is %.2f)",
                 frozen_max, layers, kFrozenRatio,
                 dense_layer->f() / (dense_layer->f() + dense_layer->b() + dense_layer->w()));
  const int64_t iterations = o.iterations;
  auto frozen_at = [iterations, frozen_max](int64_t i) -> int64_t {
    const double start = 0.2 * iterations, end = 0.8 * iterations;
    if (i < start) return 0;
    return std::min<int64_t>(
        frozen_max, std::llround(static_cast<double>(frozen_max) * (i - start) / (end - start)));
  };
  out.scenario.costs = [dense, frozen_at, free](int64_t i) {
    dynamic::IterationCosts c = dense;
    for (int64_t l = 0; l < frozen_at(i); ++l) {
      c.backward[l] = c.weight[l] = 0;
      if (free) c.forward[l] = 0;
    }
    c.frozen_prefix = frozen_at(i);  // stages wholly frozen run forward only
    if (frozen_at(i + 1) != frozen_at(i)) {
      c.model_changed = true;
      c.change_reason = absl::StrCat("froze layers up to ", frozen_at(i + 1));
    }
    return c;
  };
  out.phases = PhasesOf(o.iterations, [frozen_at, frozen_max](int64_t i) {
    const int64_t frozen = frozen_at(i);
    return frozen == 0 ? std::string("none frozen")
           : frozen == frozen_max ? absl::StrCat(frozen_max, " frozen")
                                  : std::string("freezing");
  });
}

// sparse_attention: each layer at its measured score density.
void SparseAttentionCase(const CaseInputs& in, NamedCase* out_case) {
  const CaseOptions& o = in.o;
  const dynamic::IterationCosts& dense = in.dense;
  const int64_t layers = in.layers;
  NamedCase& out = *out_case;
  out.dynmo = "2.71-4.02x vs dense (4x dense bubble)";
  out.versus_dense = true;
  out.dynmo_compares = "S_total";
  if (o.attention_density.empty()) {
    out.measured = false;
    out.why_not =
        "not measured: give --sparse_attention_metrics=PATH, the --metrics_file of a "
        "fulcrum_train --plugins=sparse_attention run (its per-layer score densities)";
    return;
  }
  auto rows = std::make_shared<std::vector<std::vector<double>>>(o.attention_density);
  double lowest = 1, highest = 0, sum = 0;
  for (const auto& row : *rows) {
    for (const double d : row) {
      lowest = std::min(lowest, d);
      highest = std::max(highest, d);
      sum += d;
    }
  }
  const size_t columns = rows->front().size();
  out.provenance = absl::StrFormat(
      "hash sparse attention in every layer, each layer's score density per iteration as our "
      "plugin counted it in %s (%d iterations x %d layers, densities %.3f..%.3f, mean %.3f, "
      "lag-1 autocorrelation %.2f; layer l takes measured layer l x %d / %d, iteration i "
      "measured iteration i mod %d), layer time ratio interpolated from "
      "fulcrum_bench_dynamism at seq 2048 (%s)",
      o.attention_density_source, static_cast<int>(rows->size()), static_cast<int>(columns),
      lowest, highest, sum / static_cast<double>(rows->size() * columns),
      MeanLag1Autocorrelation(*rows), static_cast<int>(columns), layers,
      static_cast<int>(rows->size()), SparseAttentionCurveText());
  out.scenario.costs = [dense, rows, layers](int64_t i) {
    dynamic::IterationCosts c = dense;
    const std::vector<double>& row = (*rows)[static_cast<size_t>(i - 1) % rows->size()];
    for (int64_t l = 0; l < layers; ++l) {
      const double ratio =
          SparseAttentionLayerRatio(row[static_cast<size_t>(l) * row.size() / static_cast<size_t>(layers)]);
      c.forward[l] *= ratio;
      c.backward[l] *= ratio;
      c.weight[l] *= ratio;
    }
    return c;
  };
}

// early_exit: each layer on the tokens that reach it, plus its exit head.
void EarlyExitCase(const CaseInputs& in, NamedCase* out_case) {
  const CaseOptions& o = in.o;
  const auto& dense_layer = in.dense_layer;
  const dynamic::IterationCosts& dense = in.dense;
  const int64_t layers = in.layers;
  NamedCase& out = *out_case;
  out.dynmo = "4.52x vs no exit";
  out.versus_dense = true;
  out.dynmo_compares = "S_total";
  if (o.exit_fractions.empty()) {
    out.measured = false;
    out.why_not =
        "not measured: give --early_exit_metrics=PATH, the --metrics_file of a fulcrum_train "
        "--plugins=early_exit run (its per-layer token counts)";
    return;
  }
  auto rows = std::make_shared<std::vector<std::vector<double>>>(o.exit_fractions);
  double last_layer = 0;  // The mean fraction of the tokens that reach the last layer.
  for (const auto& row : *rows) last_layer += row.back() / static_cast<double>(rows->size());
  out.provenance = absl::StrCat(
      "a layer computes only the tokens that reach it (DynMo's load: tokens reaching the layer / "
      "all tokens): the fraction per layer and iteration as our early_exit plugin counted it in ",
      o.exit_fractions_source, " (", rows->size(), " iterations x ", rows->front().size(),
      " layers, ", absl::StrFormat("%.0f%%", 100 * last_layer),
      " of the tokens reach the last layer on average; layer l takes measured layer l x ",
      rows->front().size(), " / ", layers, "); an exit head after every layer but the last, as in "
      "that run (CALM), each the LM head's F, B and W on the tokens still active there (the "
      "head's cost: see --vocab)");
  out.scenario.costs = [dense, dense_layer, rows, layers](int64_t i) {
    dynamic::IterationCosts c = dense;
    const std::vector<double>& row = (*rows)[static_cast<size_t>(i - 1) % rows->size()];
    for (int64_t l = 0; l < layers; ++l) {
      const double f = row[static_cast<size_t>(l) * row.size() / static_cast<size_t>(layers)];
      // The exit head after layer l runs on the tokens that computed layer l.
      const double head = l + 1 < layers ? dense_layer->head_f * f : 0.0;
      c.forward[l] = c.forward[l] * f + head;
      c.backward[l] = c.backward[l] * f + head;
      c.weight[l] = c.weight[l] * f + head;
    }
    return c;
  };
}

}  // namespace

absl::StatusOr<NamedCase> MakeCase(const std::string& name, const CaseOptions& o) {
  // Each case: its builder, stages and layers (DynMo: MoE and MoD on 16 stages with 32
  // layers, the others on 24 with 48).
  struct Entry {
    const char* name;
    void (*build)(const CaseInputs&, NamedCase*);
    int stages;
    int64_t layers;
  };
  static constexpr Entry kCases[] = {
      {"moe", MoeCase, 16, 32},           {"moe_calibrated", MoeCalibratedCase, 16, 32},
      {"pruning", PruningCase, 24, 48},
      {"freezing", FreezingCase, 24, 48}, {"freezing_free", FreezingCase, 24, 48},
      {"sparse_attention", SparseAttentionCase, 24, 48},
      {"early_exit", EarlyExitCase, 24, 48}, {"mod", ModCase, 16, 32}};
  const Entry* entry = nullptr;
  for (const Entry& e : kCases) {
    if (name == e.name) entry = &e;
  }
  if (entry == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--case=", name, " is not a case; known: all, ",
                                                   absl::StrJoin(CaseNames(), ", ")));
  }
  NamedCase out;
  out.name = name;
  GptShape shape = o.shape;
  shape.layers = o.layers > 0 ? o.layers : entry->layers;
  out.scenario = Base(name, entry->stages, o, shape.layers);
  const CaseInputs in{o,
                      name,
                      std::make_shared<DenseLayer>(DenseLayerCosts(shape)),
                      DenseCosts(shape),
                      shape.layers,
                      10000.0 / static_cast<double>(o.iterations),  // DynMo: 10 000.
                      entry->stages};
  entry->build(in, &out);
  return out;
}

}  // namespace fulcrum::sim
