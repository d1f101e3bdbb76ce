// fulcrum_sim's named cases (tools/internal/sim_cases.h) built from measured profiles: the
// pruning profile's parser and interpolation, the pruning case's per-layer costs from it (not
// one sparsity for every layer), its phases; the sparse-attention densities' parser, curve
// and case; and the profiles compiled into the binary.
#include "tools/internal/sim_cases.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fulcrum::sim {
namespace {

// Two pruning steps of a 2-layer model: layer 0 kept 60% then 20%, layer 1 40% then 0%.
constexpr char kTwoSteps[] =
    R"({"source":"hand-written"}
{"iteration":1,"sparsity":0.0,"prune_layer_density":{"layers.0":1.0,"layers.1":1.0}}
{"iteration":2,"sparsity":0.0,"prune_target_sparsity":0.0,"prune_layer_density":{"layers.0":1.0,"layers.1":1.0}}
{"iteration":3,"sparsity":0.5,"prune_target_sparsity":0.5,"prune_layer_density":{"layers.1":0.4,"layers.0":0.6}}
{"iteration":4,"sparsity":0.5,"prune_layer_density":{"layers.0":0.6,"layers.1":0.4}}
{"iteration":5,"sparsity":0.9,"prune_target_sparsity":0.9,"prune_layer_density":{"layers.0":0.2,"layers.1":0.0}}
)";

absl::StatusOr<PruneProfile> Parse(const std::string& text) {
  std::istringstream in(text);
  return ParsePruneProfile(in, "p.jsonl");
}

TEST(PruneProfileTest, KeepsTheStepsThatPrunedInLayerOrder) {
  absl::StatusOr<PruneProfile> profile = Parse(kTwoSteps);
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_THAT(profile->sparsity, ::testing::ElementsAre(0.5, 0.9));
  ASSERT_EQ(profile->density.size(), 2u);
  EXPECT_THAT(profile->density[0], ::testing::ElementsAre(0.6, 0.4));  // layers.0 first
  EXPECT_THAT(profile->density[1], ::testing::ElementsAre(0.2, 0.0));
  EXPECT_EQ(profile->SparsitySpread(), std::make_pair(0.8, 1.0));
}

TEST(PruneProfileTest, DensityIsLinearBetweenStepsFromDenseAtZero) {
  const PruneProfile profile = *Parse(kTwoSteps);
  EXPECT_THAT(profile.DensityAt(0.0), ::testing::ElementsAre(1.0, 1.0));
  // Half way from dense to the first step, then half way between the steps.
  EXPECT_THAT(profile.DensityAt(0.25), ::testing::Pointwise(::testing::DoubleNear(1e-12),
                                                            std::vector<double>{0.8, 0.7}));
  EXPECT_THAT(profile.DensityAt(0.5), ::testing::ElementsAre(0.6, 0.4));
  EXPECT_THAT(profile.DensityAt(0.7), ::testing::Pointwise(::testing::DoubleNear(1e-12),
                                                           std::vector<double>{0.4, 0.2}));
  EXPECT_THAT(profile.DensityAt(0.95), ::testing::ElementsAre(0.2, 0.0));
  // The mean kept fraction follows 1 − sparsity wherever the steps do.
  for (double s : {0.1, 0.3, 0.5, 0.6, 0.9}) {
    const std::vector<double> d = profile.DensityAt(s);
    EXPECT_NEAR((d[0] + d[1]) / 2, 1 - s, 1e-12) << s;
  }
}

TEST(PruneProfileTest, BadInputIsRefusedNamingTheLine) {
  const auto error = [](const std::string& text) {
    absl::StatusOr<PruneProfile> p = Parse(text);
    return p.ok() ? std::string("parsed") : std::string(p.status().message());
  };
  EXPECT_THAT(error(R"({"iteration":3,"sparsity":0.5,"prune_target_sparsity":0.5,"prune_layer_density":{"layers.0":1.5}})"),
              ::testing::HasSubstr("p.jsonl:1: prune_layer_density 'layers.0' holds 1.5"));
  EXPECT_THAT(error(R"({"sparsity":0.5,"prune_target_sparsity":0.5,"prune_layer_density":{"layers.0":0.5}}
{"sparsity":0.4,"prune_target_sparsity":0.4,"prune_layer_density":{"layers.0":0.6}})"),
              ::testing::HasSubstr("p.jsonl:2: sparsity 0.4 falls below"));
  EXPECT_THAT(error(R"({"sparsity":0.5,"prune_target_sparsity":0.5,"prune_layer_density":{"layers.0":0.5}}
{"sparsity":0.6,"prune_target_sparsity":0.6,"prune_layer_density":{"layers.0":0.4,"layers.1":0.4}})"),
              ::testing::HasSubstr("p.jsonl:2: 2 layers where the steps before had 1"));
  EXPECT_THAT(error(R"({"sparsity":0.5,"prune_target_sparsity":"x"})"),
              ::testing::HasSubstr("p.jsonl:1: a pruning step needs"));
  EXPECT_THAT(error(R"({"prune_target_sparsity":0.5,"prune_layer_density":{"layers.x":0.5}})"),
              ::testing::HasSubstr("p.jsonl:1: prune_layer_density 'layers.x' is not a layer"));
  EXPECT_THAT(error(R"({"prune_target_sparsity":0.5,"prune_layer_density":{"layers.0":0.5,"layers.2":0.5}})"),
              ::testing::HasSubstr("names layers up to 2 but holds 2"));
  EXPECT_THAT(error(R"({"iteration":1,"loss":3.0})"), ::testing::HasSubstr("holds no pruning step"));
}

// The case's layer l runs at the sparsity the profile gives measured layer l × M / L: with
// a profile whose two layers differ, the 48-layer model's two halves differ, each by the
// pruned-time curve at its own sparsity, and attention scores stay dense.
TEST(PruningCaseTest, EachLayerRunsAtItsMeasuredSparsity) {
  CaseOptions options;
  options.iterations = 100;
  options.prune_profile = *Parse(kTwoSteps);
  options.prune_profile_source = "hand-written";
  absl::StatusOr<NamedCase> c = MakeCase("pruning", options);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->measured);
  const DenseLayer d = DenseLayerCosts(options.shape);
  // Iteration 80 is in the last phase (real iteration 8000, 90% pruned): layer 0..23 keep
  // 20% (80% sparse: 0.60x), layers 24..47 keep 0% (100% sparse, beyond the curve: 0.42x).
  const dynamic::IterationCosts costs = c->scenario.costs(80);
  ASSERT_EQ(costs.num_layers(), 48);
  const auto forward = [&](double ratio) {
    return d.attention_gemm_f * ratio + d.scores_f + d.mlp_f * ratio;
  };
  EXPECT_NEAR(costs.forward[0], forward(0.60), 1e-9 * forward(1));
  EXPECT_NEAR(costs.forward[23], forward(0.60), 1e-9 * forward(1));
  EXPECT_NEAR(costs.forward[24], forward(0.42), 1e-9 * forward(1));
  EXPECT_NEAR(costs.forward[47], forward(0.42), 1e-9 * forward(1));
  EXPECT_GT(costs.forward[0], costs.forward[47]) << "the layers differ as the profile does";
  // Dense before the first step (real iteration 3000).
  EXPECT_NEAR(c->scenario.costs(30).forward[47], d.f(), 1e-9 * d.f());
  EXPECT_THAT(c->provenance, ::testing::HasSubstr("80.0%..100.0%"));
}

TEST(PruningCaseTest, PhasesFollowDynmosSchedule) {
  CaseOptions options;
  options.iterations = 100;
  options.prune_profile = *Parse(kTwoSteps);
  const NamedCase c = *MakeCase("pruning", options);
  // Real iteration 100 i: 0% until 3999, then 52, 79, 89 and 90% from 4000, 5000, 6000, 7000.
  ASSERT_EQ(c.phases.size(), 5u);
  const std::vector<std::string> labels = {"dense", "52% pruned", "79% pruned", "89% pruned",
                                           "90% pruned"};
  const std::vector<std::pair<int64_t, int64_t>> spans = {{1, 39}, {40, 49}, {50, 59}, {60, 69},
                                                          {70, 100}};
  for (size_t k = 0; k < labels.size(); ++k) {
    EXPECT_EQ(c.phases[k].label, labels[k]);
    EXPECT_EQ(std::make_pair(c.phases[k].first, c.phases[k].last), spans[k]) << labels[k];
  }
}

TEST(PruningCaseTest, WithoutAProfileTheCaseSaysSo) {
  const NamedCase c = *MakeCase("pruning", CaseOptions{});
  EXPECT_FALSE(c.measured);
  EXPECT_THAT(c.why_not, ::testing::HasSubstr("--prune_metrics"));
}

// Early exit: a layer computes the tokens that reach it, and the exit head after it (every
// layer but the last, as CALM and our plugin's default) runs the LM head on those tokens.
TEST(EarlyExitCaseTest, LayersComputeTheTokensThatReachThemPlusTheirExitHead) {
  CaseOptions options;
  options.layers = 4;
  options.exit_fractions = {{1.0, 0.5}};  // measured layer 1 sees half of the tokens
  options.exit_fractions_source = "hand-written";
  const NamedCase c = *MakeCase("early_exit", options);
  ASSERT_TRUE(c.measured);
  const DenseLayer d = DenseLayerCosts(options.shape);
  const dynamic::IterationCosts costs = c.scenario.costs(1);
  ASSERT_EQ(costs.num_layers(), 4);
  // Layers 0, 1 take measured layer 0 (all tokens), layers 2, 3 measured layer 1 (half).
  EXPECT_NEAR(costs.forward[0], d.f() + d.head_f, 1e-9 * d.f());
  EXPECT_NEAR(costs.backward[1], d.b() + d.head_f, 1e-9 * d.f());
  EXPECT_NEAR(costs.weight[2], 0.5 * (d.w() + d.head_f), 1e-9 * d.f());
  EXPECT_NEAR(costs.forward[3], 0.5 * d.f(), 1e-9 * d.f()) << "no exit head after the last layer";
  EXPECT_NEAR(costs.last_forward, d.head_f, 1e-9 * d.f()) << "the model's own head is unchanged";
  EXPECT_THAT(c.provenance, ::testing::HasSubstr("50% of the tokens reach the last layer"));
}

// Freezing front to back: a frozen layer runs its forward only (freezing) or costs nothing
// (freezing_free, DynMo's load model); layers not yet frozen stay dense.
TEST(FreezingCaseTest, FrozenLayersRunForwardOnlyOrNothing) {
  CaseOptions options;
  options.iterations = 100;
  const DenseLayer d = DenseLayerCosts(options.shape);
  const NamedCase ours = *MakeCase("freezing", options);
  const NamedCase free = *MakeCase("freezing_free", options);
  // Iteration 90: all 40 of 48 frozen (from 80% of the run).
  const dynamic::IterationCosts a = ours.scenario.costs(90), b = free.scenario.costs(90);
  EXPECT_EQ(a.frozen_prefix, 40);
  EXPECT_EQ(b.frozen_prefix, 40);
  EXPECT_NEAR(a.forward[39], d.f(), 1e-9 * d.f());
  EXPECT_EQ(a.backward[39], 0);
  EXPECT_EQ(a.weight[39], 0);
  EXPECT_EQ(b.forward[39], 0);
  EXPECT_EQ(b.backward[39] + b.weight[39], 0);
  for (const auto* c : {&a, &b}) {
    EXPECT_NEAR(c->forward[40] + c->backward[40] + c->weight[40], d.f() + d.b() + d.w(), 1e-9 * d.f());
  }
  EXPECT_THAT(free.provenance, ::testing::HasSubstr("costs nothing"));
}

// A case's phases cover its run: their slices add up to the run's time, each holds its
// span's iterations, and the bubble averages back to the run's.
TEST(CasePhaseTest, SlicesOfThePhasesAddUpToTheRun) {
  CaseOptions options;
  options.iterations = 20;
  options.layers = 8;
  options.num_stages = 4;
  options.shape.vocab = 0;  // no head to set the pace: every phase runs at its own speed
  options.prune_profile = MeasuredPruneProfile().value;
  const NamedCase c = *MakeCase("pruning", options);
  ASSERT_EQ(c.phases.size(), 5u);
  absl::StatusOr<dynamic::SimulatedRun> run =
      dynamic::SimulateRun(c.scenario, dynamic::StandardStrategies()[0], dynamic::BalancerOptions());
  ASSERT_TRUE(run.ok()) << run.status();
  double ms = 0, bubble = 0;
  int64_t iterations = 0;
  for (const CasePhase& phase : c.phases) {
    const PhaseSlice slice = SliceOf(*run, phase);
    EXPECT_EQ(slice.iterations, phase.last - phase.first + 1) << phase.label;
    ms += slice.ms;
    bubble += slice.bubble * static_cast<double>(slice.iterations);
    iterations += slice.iterations;
  }
  EXPECT_EQ(iterations, 20);
  EXPECT_NEAR(ms, run->total_ms, 1e-9 * run->total_ms);
  EXPECT_NEAR(bubble / 20, run->mean_bubble_ratio, 1e-12);
  // One iteration more or less in a phase would show: dense and 90% pruned differ in time.
  const PhaseSlice first = SliceOf(*run, c.phases.front()), last = SliceOf(*run, c.phases.back());
  EXPECT_NE(first.ms / first.iterations, last.ms / last.iterations);
}

// Two iterations of a 2-layer sparse-attention run: layer 1's density falls.
constexpr char kTwoDensities[] =
    R"({"source":"hand-written"}
{"iteration":1,"loss":5.0,"sparse_attention_layer_density":{"layers.1":0.30,"layers.0":0.12}}
{"iteration":2,"loss":4.0}
{"iteration":3,"sparse_attention_layer_density":{"layers.0":0.12,"layers.1":0.05}}
)";

absl::StatusOr<std::vector<std::vector<double>>> ParseDensities(const std::string& text) {
  std::istringstream in(text);
  return ParseAttentionDensity(in, "a.jsonl");
}

TEST(AttentionDensityTest, RowsPerIterationInLayerOrder) {
  absl::StatusOr<std::vector<std::vector<double>>> rows = ParseDensities(kTwoDensities);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);  // the record without densities is no row
  EXPECT_THAT((*rows)[0], ::testing::ElementsAre(0.12, 0.30));
  EXPECT_THAT((*rows)[1], ::testing::ElementsAre(0.12, 0.05));
}

TEST(AttentionDensityTest, BadInputIsRefusedNamingTheLine) {
  const auto error = [](const std::string& text) {
    auto rows = ParseDensities(text);
    return rows.ok() ? std::string("parsed") : std::string(rows.status().message());
  };
  EXPECT_THAT(error(R"({"sparse_attention_layer_density":{"layers.0":1.5}})"),
              ::testing::HasSubstr("a.jsonl:1: sparse_attention_layer_density 'layers.0' holds 1.5"));
  EXPECT_THAT(error(R"({"sparse_attention_layer_density":{"layers.0":0.5}}
{"sparse_attention_layer_density":{"layers.0":0.5,"layers.1":0.5}})"),
              ::testing::HasSubstr("a.jsonl:2: 2 layers where the iterations before had 1"));
  EXPECT_THAT(error(R"({"sparse_attention_layer_density":{"attn":0.5}})"),
              ::testing::HasSubstr("'attn' is not a layer"));
  EXPECT_THAT(error(R"({"sparse_attention_layer_density":{"layers.0":0.5,"layers.2":0.5}})"),
              ::testing::HasSubstr("names layers up to 2 but holds 2"));
  EXPECT_THAT(error(R"({"sparse_attention_layer_density":[0.5]})"),
              ::testing::HasSubstr("is not an object"));
  EXPECT_THAT(error(R"({"iteration":1,"loss":3.0})"),
              ::testing::HasSubstr("holds no sparse_attention_layer_density"));
}

// The measured curve: its points exactly, linear between neighbours, flat beyond the ends.
TEST(AttentionDensityTest, LayerRatioFollowsTheMeasuredCurve) {
  EXPECT_DOUBLE_EQ(SparseAttentionLayerRatio(0.12), 1.03);
  EXPECT_DOUBLE_EQ(SparseAttentionLayerRatio(0.30), 2.22);
  EXPECT_NEAR(SparseAttentionLayerRatio(0.15), (1.03 + 1.38) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(SparseAttentionLayerRatio(0.0), 0.85);
  EXPECT_DOUBLE_EQ(SparseAttentionLayerRatio(1.0), 2.22);
}

// Layer l of the 48 takes measured layer l × 2 / 48, iteration i measured row (i − 1) mod 2:
// every part of the layer (F, B, W) scales by the curve at that density.
TEST(SparseAttentionCaseTest, EachLayerRunsAtItsMeasuredDensity) {
  CaseOptions options;
  options.attention_density = *ParseDensities(kTwoDensities);
  options.attention_density_source = "hand-written";
  absl::StatusOr<NamedCase> c = MakeCase("sparse_attention", options);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->measured);
  const DenseLayer d = DenseLayerCosts(options.shape);
  const dynamic::IterationCosts first = c->scenario.costs(1), second = c->scenario.costs(2);
  ASSERT_EQ(first.num_layers(), 48);
  EXPECT_NEAR(first.forward[0], d.f() * 1.03, 1e-9 * d.f());
  EXPECT_NEAR(first.backward[23], d.b() * 1.03, 1e-9 * d.b());
  EXPECT_NEAR(first.weight[24], d.w() * 2.22, 1e-9 * d.w());
  EXPECT_GT(first.forward[24], first.forward[23]) << "the layers differ as the profile does";
  EXPECT_NEAR(second.forward[47], d.f() * SparseAttentionLayerRatio(0.05), 1e-9 * d.f());
  // Iteration 3 replays the first row.
  EXPECT_EQ(c->scenario.costs(3).forward, first.forward);
  EXPECT_THAT(c->provenance, ::testing::HasSubstr("densities 0.050..0.300"));
}

TEST(SparseAttentionCaseTest, WithoutAProfileTheCaseSaysSo) {
  const NamedCase c = *MakeCase("sparse_attention", CaseOptions{});
  EXPECT_FALSE(c.measured);
  EXPECT_THAT(c.why_not, ::testing::HasSubstr("--sparse_attention_metrics"));
}

// --moe_amplitude scales each layer's imbalance excess: r = 1.5 at amplitude 2 is 2.0, r = 1
// stays 1; a layer's MLP time is twice (top-2) that times the dense MLP.
TEST(MoeCaseTest, AmplitudeScalesTheImbalanceExcess) {
  CaseOptions options;
  options.expert_imbalance = {{1.5, 1.0}};
  options.expert_imbalance_source = "hand-written";
  options.moe_amplitude = 2;
  const NamedCase c = *MakeCase("moe", options);
  const DenseLayer d = DenseLayerCosts(options.shape);
  const dynamic::IterationCosts costs = c.scenario.costs(1);
  const auto forward = [&](double mlp) { return d.attention_gemm_f + d.scores_f + d.mlp_f * mlp; };
  EXPECT_NEAR(costs.forward[0], forward(2 * 2.0), 1e-9 * d.f());
  EXPECT_NEAR(costs.forward[1], forward(2 * 1.0), 1e-9 * d.f());
  EXPECT_THAT(c.provenance, ::testing::HasSubstr("scaled by 2"));
}

// The best static placement's idle, as the DynMo table picks it (the faster of uniform and
// by-parameters).
double BestStaticIdle(const dynamic::Scenario& s) {
  double best_ms = 0, idle = 0;
  for (int k : {0, 1}) {
    absl::StatusOr<dynamic::SimulatedRun> run =
        dynamic::SimulateRun(s, dynamic::StandardStrategies()[k], dynamic::BalancerOptions{});
    EXPECT_TRUE(run.ok()) << run.status();
    if (run.ok() && (best_ms == 0 || run->total_ms < best_ms)) {
      best_ms = run->total_ms;
      idle = run->mean_bubble_ratio;
    }
  }
  return idle;
}

// moe_calibrated on the measured loads without the LM head (DynMo's load model): the scale it
// finds makes the best static placement idle 25% (DynMo's figure), above the measured loads'
// own idle; with the 50k-vocabulary head the model idles more than that with no imbalance at
// all, so the scale is 0 and the case says why.
TEST(MoeCaseTest, CalibratedToTheStaticIdleOfDynmo) {
  CaseOptions options;  // 100 iterations, as the README's table
  options.shape.vocab = 0;
  options.expert_imbalance = MeasuredExpertImbalance().value;
  options.expert_imbalance_source = "measured";
  const NamedCase measured = *MakeCase("moe", options);
  const NamedCase calibrated = *MakeCase("moe_calibrated", options);
  ASSERT_TRUE(calibrated.measured) << calibrated.why_not;
  EXPECT_NEAR(BestStaticIdle(calibrated.scenario), 0.25, 0.002);
  EXPECT_LT(BestStaticIdle(measured.scenario), 0.25);
  EXPECT_THAT(calibrated.provenance, ::testing::HasSubstr("calibrated: k = 1."));

  // Loads without any imbalance: no scale reaches 25%, and the case says so.
  CaseOptions even = options;
  even.iterations = 10;
  even.expert_imbalance = {{1.0, 1.0}};
  EXPECT_THAT(MakeCase("moe_calibrated", even)->provenance,
              ::testing::HasSubstr("not reached: even k = 64 idles only"));

  options.shape.vocab = 50304;
  const NamedCase floored = *MakeCase("moe_calibrated", options);
  EXPECT_THAT(floored.provenance, ::testing::HasSubstr("with no imbalance at all, so k = 0"));
  EXPECT_GT(BestStaticIdle(floored.scenario), 0.25);
}

// The profiles compiled into fulcrum_sim (tools/profiles/*.jsonl) parse, say which run made
// them, and hold what their runs were asked for.
TEST(MeasuredProfilesTest, CompiledInProfilesParseWithTheirCommands) {
  const Measured<PruneProfile>& prune = MeasuredPruneProfile();
  EXPECT_THAT(prune.source, ::testing::HasSubstr("--plugins=prune"));
  EXPECT_EQ(prune.value.num_layers(), 8u);
  ASSERT_EQ(prune.value.sparsity.size(), 4u);  // 52, 79, 89 and 90%
  EXPECT_NEAR(prune.value.sparsity.back(), 0.9, 1e-3);
  // What README states: at 90% overall, global pruning left layer 0 at 81.7%, the most
  // pruned layer at 92.7%.
  const auto [least, most] = prune.value.SparsitySpread();
  EXPECT_NEAR(least, 0.817, 1e-3);
  EXPECT_NEAR(most, 0.927, 1e-3);

  const Measured<std::vector<std::vector<double>>>& moe = MeasuredExpertImbalance();
  EXPECT_THAT(moe.source, ::testing::HasSubstr("--recipe=tiny_moe"));
  EXPECT_EQ(moe.value.size(), 300u);
  EXPECT_EQ(moe.value.front().size(), 8u);

  const Measured<std::vector<std::vector<double>>>& exits = MeasuredExitFractions();
  EXPECT_THAT(exits.source, ::testing::HasSubstr("--plugins=early_exit"));
  ASSERT_EQ(exits.value.size(), 200u);
  double last = 0;  // README: 48% of the tokens reach the last layer after iteration 50
  for (size_t i = 50; i < exits.value.size(); ++i) last += exits.value[i].back() / 150;
  EXPECT_NEAR(last, 0.48, 0.005);

  const Measured<std::vector<std::vector<double>>>& attention = MeasuredAttentionDensity();
  EXPECT_THAT(attention.source, ::testing::HasSubstr("--seq_length=2048"));
  ASSERT_EQ(attention.value.size(), 100u);
  EXPECT_EQ(attention.value.front().size(), 8u);
  // What README states: densities 0.000..0.220 over the run, mean 0.126 (8 buckets).
  double lowest = 1, highest = 0, sum = 0;
  for (const auto& row : attention.value) {
    for (const double d : row) {
      lowest = std::min(lowest, d);
      highest = std::max(highest, d);
      sum += d;
    }
  }
  EXPECT_NEAR(lowest, 0.000, 1e-3);
  EXPECT_NEAR(highest, 0.220, 1e-3);
  EXPECT_NEAR(sum / 800, 0.126, 1e-3);
}

}  // namespace
}  // namespace fulcrum::sim
