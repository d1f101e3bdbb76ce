// The named scenarios of fulcrum_sim --case: DynMo's six dynamic-model cases (Wahib et al.,
// SC'25 §4.2, §5.1) at DynMo's scale, with per-layer cost behaviour that Fulcrum's own plugins
// measured (tools/fulcrum_bench_dynamism, fulcrum_train runs), and a FLOP model for the dense
// GPT layer they scale.
//
// NOTE [sim FLOP model]
// A GPT layer on a micro-batch of b sequences of s tokens, hidden h, MLP 4h, counted as
// Megatron does (Narayanan et al., SC'21 §5.1; no causal halving): forward = attention GEMMs
// 8bsh² + attention scores and context 4bs²h + MLP 16bsh²; the input gradient B = 8bsh² +
// 8bs²h + 16bsh² (the score backward is twice its forward); the weight gradient W = 8bsh² +
// 16bsh². The LM head (untied, vocabulary V) costs 2bshV in each of F, B and W; the embedding
// lookup is free. Time = FLOPs / --device_tflops (an assumed sustained rate, not measured on
// an H100: only ratios of times, and their ratio to communication, matter here).
//
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <istream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dynamic/simulation.h"

namespace fulcrum::sim {

/// The model of a case (DynMo: GPT, hidden 1024, 32 heads, seq 2048, micro-batch 2).
struct GptShape {
  int64_t layers = 48;
  int64_t hidden = 1024;
  int64_t heads = 32;
  int64_t seq_length = 2048;
  int64_t micro_batch = 2;
  int64_t vocab = 50304;      ///< GPT-2's 50257 padded to a multiple of 128.
  double device_tflops = 400;  ///< Sustained FLOP/s per GPU, ×1e12.
  double bytes_per_state_param = 16;  ///< bf16 weight + grad, fp32 master, two Adam moments.
  double bytes_per_activation = 2;    ///< bf16 activations between stages.
};

/// A dense layer's time split into the parts the dynamisms change (ms per micro-batch).
struct DenseLayer {
  double attention_gemm_f = 0, attention_gemm_b = 0, attention_gemm_w = 0;  ///< QKV + proj.
  double scores_f = 0, scores_b = 0;  ///< QKᵀ and the context product (no weights).
  double mlp_f = 0, mlp_b = 0, mlp_w = 0;
  double head_f = 0;  ///< LM head per kind (F = B = W).
  double parameters = 0, head_parameters = 0, embedding_parameters = 0;

  double f() const { return attention_gemm_f + scores_f + mlp_f; }
  double b() const { return attention_gemm_b + scores_b + mlp_b; }
  double w() const { return attention_gemm_w + mlp_w; }
};

/// NOTE [sim FLOP model].
DenseLayer DenseLayerCosts(const GptShape& shape);

/// The dense model's costs (every layer DenseLayerCosts; head on the last stage).
dynamic::IterationCosts DenseCosts(const GptShape& shape);

/// The per-layer sparsity that global magnitude pruning produced, as our `prune` plugin
/// measured it at each pruning step of a run (LoadPruneProfile).
struct PruneProfile {
  /// The whole model's sparsity after each step, ascending.
  std::vector<double> sparsity;
  /// Per step, per layer (in layer order): the fraction of the layer's prunable weights kept.
  std::vector<std::vector<double>> density;

  bool empty() const { return sparsity.empty(); }
  size_t num_layers() const { return density.empty() ? 0 : density.front().size(); }
  /// Per layer, the kept fraction when the whole model is pruned to `model_sparsity`: linear
  /// between the measured steps around it (every layer 1 at sparsity 0), the last step's
  /// beyond the last. So the mean over layers follows 1 − model_sparsity (the plugin prunes
  /// the same four weights in every layer, so layers weigh alike).
  std::vector<double> DensityAt(double model_sparsity) const;
  /// Over the layers at the last step: the smallest and largest sparsity.
  std::pair<double, double> SparsitySpread() const;
};

/// What a named case is built from.
struct CaseOptions {
  GptShape shape;
  int64_t iterations = 100;  ///< Simulated iterations (each case maps its schedule onto them).
  /// Pipeline stages; 0: the case's own (16 for moe and mod, 24 for the others). Set here,
  /// not on the built scenario, so that the default micro-batch count follows it.
  int num_stages = 0;
  int num_microbatches = 0;  ///< 0: 4 per stage (DynMo: "4 micro-batches per GPU").
  /// Transformer layers of the case's model; 0: the case's own (32 for moe and mod, 48 for
  /// the others). Each case's per-layer behaviour is defined for any count (freezing freezes
  /// the first 5/6 of them, as 40 of 48).
  int64_t layers = 0;
  std::string schedule = "zbh1";
  dynamic::NetworkOptions network;  ///< p2p_bytes is set from the shape.
  /// MoE: per layer and iteration, max/mean tokens over the experts, as our router produced
  /// them (rows of a run's metrics; see LoadExpertImbalance). Empty: the MoE case cannot be
  /// built and says so.
  std::vector<std::vector<double>> expert_imbalance;
  std::string expert_imbalance_source;
  /// MoE: each measured imbalance r becomes 1 + moe_amplitude × (r − 1) (1: as measured; the
  /// moe_calibrated case finds the amplitude at which the best static placement idles 25%).
  double moe_amplitude = 1.0;
  /// Early exit: per iteration, per layer, the fraction of the tokens that reach the layer,
  /// as our early_exit plugin counted them (LoadExitFractions). Empty: not measured.
  std::vector<std::vector<double>> exit_fractions;
  std::string exit_fractions_source;
  /// Pruning: the per-layer sparsity of global magnitude pruning, measured
  /// (LoadPruneProfile). Empty: the pruning case cannot be built and says so.
  PruneProfile prune_profile;
  std::string prune_profile_source;
  /// Sparse attention: per iteration, per layer, the score entries computed over the dense
  /// attention's, as our sparse_attention plugin counted them (LoadAttentionDensity). Empty:
  /// the case cannot be built and says so.
  std::vector<std::vector<double>> attention_density;
  std::string attention_density_source;
};

/// A stretch of a case's run in which its dynamism holds still (pruning at one sparsity,
/// freezing at its final depth), for the per-phase rows of the DynMo table: simulated
/// iterations [first, last], 1-based, inclusive.
struct CasePhase {
  std::string label;  ///< E.g. "52% pruned".
  int64_t first = 1;
  int64_t last = 1;
};

/// A case: its scenario, DynMo's published figures beside it, and where the costs come from;
/// `measured` false when a plugin has not landed and nothing may be simulated.
struct NamedCase {
  std::string name;
  bool measured = true;
  std::string why_not;        ///< When !measured.
  dynamic::Scenario scenario;
  std::string provenance;     ///< Where the per-layer behaviour comes from.
  std::string dynmo;          ///< DynMo's published figures.
  /// The model has a dense counterpart (DenseScenario: the same shape without the
  /// dynamism), so S_dyn and S_total exist (issue 25); false for MoE, whose dynamic model is
  /// the model.
  bool versus_dense = false;
  /// Which of our three numbers DynMo's figure is comparable to: "S_bal" (its MoE and MoD
  /// figures, what their idle fractions give) or "S_total" (the others include the
  /// dynamism's own savings).
  std::string dynmo_compares = "S_bal";
  /// The case's phases, in order, covering every simulated iteration; empty for a case
  /// whose dynamism never holds still (MoE, early exit) or never changes (MoD).
  std::vector<CasePhase> phases;
};

/// A run's iterations in `phase`: their summed time, mean bubble and count.
struct PhaseSlice {
  double ms = 0;
  double bubble = 0;
  int64_t iterations = 0;
};
PhaseSlice SliceOf(const dynamic::SimulatedRun& run, const CasePhase& phase);

/// "moe, moe_calibrated, pruning, freezing, freezing_free, sparse_attention, early_exit, mod":
/// DynMo's six; MoE also with its imbalance scaled until the best static placement idles 25%
/// (DynMo's static idle); freezing twice (a frozen layer's forward counted, as we run it; free,
/// as DynMo counts it).
std::vector<std::string> CaseNames();

/// The case `name` (one of CaseNames) built from `options`; InvalidArgument listing the names
/// for an unknown one.
absl::StatusOr<NamedCase> MakeCase(const std::string& name, const CaseOptions& options);

/// The dense model in the case's setting (stages, micro-batches, schedule, shape), for the
/// speedup over a static dense run.
dynamic::Scenario DenseScenario(const NamedCase& named, const CaseOptions& options);

/// Per MoE layer and iteration, max over the experts of the tokens routed to an expert
/// divided by their mean, from a fulcrum_train metrics file ("expert_tokens" per layer per
/// iteration): rows by iteration, one entry per MoE layer. InvalidArgument/NotFound naming the
/// file when it holds none.
absl::StatusOr<std::vector<std::vector<double>>> LoadExpertImbalance(const std::string& path);
/// The same from `in`, `source` naming it in errors.
absl::StatusOr<std::vector<std::vector<double>>> ParseExpertImbalance(std::istream& in,
                                                                      const std::string& source);

/// Per iteration and layer, the tokens a layer computed over the tokens that entered the
/// model ("early_exit_tokens": per layer [computed, seen, exited]) from a fulcrum_train
/// metrics file of an early-exit run. InvalidArgument/NotFound naming the file.
absl::StatusOr<std::vector<std::vector<double>>> LoadExitFractions(const std::string& path);
absl::StatusOr<std::vector<std::vector<double>>> ParseExitFractions(std::istream& in,
                                                                    const std::string& source);

/// The pruning steps of a fulcrum_train --plugins=prune metrics file: the records that hold
/// "prune_target_sparsity" (a step ran), their "sparsity" and "prune_layer_density".
/// InvalidArgument naming the file and line for a density outside [0, 1], steps whose
/// sparsity falls, or layer counts that differ; NotFound/InvalidArgument when it holds none.
absl::StatusOr<PruneProfile> LoadPruneProfile(const std::string& path);
absl::StatusOr<PruneProfile> ParsePruneProfile(std::istream& in, const std::string& source);

/// Per iteration and layer, "sparse_attention_layer_density" (score entries computed over the
/// dense attention's) from a fulcrum_train --plugins=sparse_attention metrics file.
/// InvalidArgument naming the file and line for a density outside [0, 1], a key that is not
/// a layer, or layer counts that differ; NotFound/InvalidArgument when it holds none.
absl::StatusOr<std::vector<std::vector<double>>> LoadAttentionDensity(const std::string& path);
absl::StatusOr<std::vector<std::vector<double>>> ParseAttentionDensity(std::istream& in,
                                                                       const std::string& source);

/// A layer's time with hash sparse attention over the dense layer's at score density `d`:
/// linear between the densities fulcrum_bench_dynamism measured (seq 2048), the nearest
/// measured ratio outside them.
double SparseAttentionLayerRatio(double density);

/// The text of tools/profiles/<name>.jsonl as compiled into the binary
/// (tools/profiles/embed_profiles.cmake), or empty when there is none.
std::string_view EmbeddedProfile(std::string_view name);

/// A measured input with what made it: the first line's "source" of its profile.
template <typename T>
struct Measured {
  T value;
  std::string source;
};

/// What our runs measured (tools/profiles/, made by tools/profiles/make_profiles.sh): the
/// defaults of --moe_metrics, --early_exit_metrics, --prune_metrics and
/// --sparse_attention_metrics. Parsed once; a
/// profile that does not parse is a build defect and aborts with its error.
const Measured<std::vector<std::vector<double>>>& MeasuredExpertImbalance();
const Measured<std::vector<std::vector<double>>>& MeasuredExitFractions();
const Measured<PruneProfile>& MeasuredPruneProfile();
const Measured<std::vector<std::vector<double>>>& MeasuredAttentionDensity();

}  // namespace fulcrum::sim
