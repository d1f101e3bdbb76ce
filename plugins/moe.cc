// The `moe` plugin: Mixture-of-Experts layers (moe/moe_layer.h) replace the dense MLP of the
// layers --moe_layer_freq chooses. Selected by --plugins=moe, or by --num_experts > 0 alone
// (the MoE flags predate the plugin API and keep working). An MoE layer reports the rows its
// experts multiplied as its load (FeedForward::Load), which the balancers read.
#include <gflags/gflags.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "core/parallel_context.h"
#include "moe/moe_layer.h"
#include "plugins/plugin_registry.h"

DEFINE_int64(num_experts, 0, "Experts per MoE layer; 0 = a dense model.");
DEFINE_string(moe_layer_freq, "1",
              "Which layers are MoE: N (layer i when i % N == 0; 1 = every layer) or Megatron's "
              "list form, one 0/1 per layer, e.g. [1,1,1,1,0,0,0,0] (heavy layers on one side).");
DEFINE_int64(moe_router_topk, 2, "Experts per token (k).");
DEFINE_string(moe_router_topk_schedule, "",
              "Top-any routing: ITER:K[,ITER:K...] routes with K experts per token from step ITER "
              "on, e.g. '1:2,500:1'; empty = always --moe_router_topk.");
DEFINE_int64(moe_ffn_hidden_size, 0, "Hidden size of each expert; 0 = the MLP size.");
DEFINE_string(moe_router, "topk", "Router (see the list above).");
DEFINE_double(moe_capacity_factor, 1.0,
              "Expert capacity (Tutel's convention): x > 0 fixed ceil(k*x*T/E); 0 the smallest that "
              "drops nothing this step (agreed over the ep group); x < 0 the same capped at -x.");
DEFINE_bool(moe_per_expert_capacity, false,
            "Size each expert's buffer to the tokens it keeps, min(load, capacity), instead of "
            "padding every expert to the capacity; with expert parallelism the all-to-all sends "
            "row counts first, then variable-size buffers. Same math, less memory and traffic.");
DEFINE_bool(moe_batch_prioritized_routing, false,
            "Confident tokens claim expert slots first (V-MoE's batch priority routing).");
DEFINE_double(moe_aux_loss_coeff, 1e-2,
              "Scale of the balancing losses (load balancing; importance and load for noisy_topk; "
              "HF's router_aux_loss_coef for mixtral).");
DEFINE_double(moe_z_loss_coeff, 0.0, "Router z-loss scale (ST-MoE); 0 = off.");
DEFINE_double(moe_input_jitter_eps, 0.0, "Multiplicative router input jitter in training; 0 = off.");
DEFINE_double(moe_router_init_std, 0.02, "Std of the router weight initialisation.");
DEFINE_double(moe_noise_epsilon, 1e-2, "noisy_topk: floor of the noise scale.");
DEFINE_double(moe_router_bias_update_rate, 1e-3, "aux_free: expert bias update rate per step.");
DEFINE_int32(moe_sinkhorn_iterations, 50, "sinkhorn: most Sinkhorn iterations.");
DEFINE_double(moe_expert_choice_capacity_factor, 1.0, "expert_choice: tokens per expert c*k*T/E.");
DEFINE_int64(moe_cosine_projection_dim, 16, "cosine: projection dimension.");
DEFINE_double(moe_cosine_init_temperature, 0.5, "cosine: initial temperature.");
DEFINE_double(moe_cosine_min_temperature, 0.01, "cosine: smallest temperature.");
DEFINE_int32(moe_a2a_overlap_degree, 1,
             "Exchange and compute the experts' tokens in this many chunks, so the all-to-all of "
             "one chunk overlaps the expert compute of another (forward pass); 1 = off.");
DEFINE_double(moe_assignment_cache_threshold, 0.0,
              "DynaMoE sample-assignment caching: once an epoch changes the experts of fewer "
              "than this fraction of the tokens met again, the next epoch routes each token by "
              "its cached assignment (a fully cached micro-batch starts the exchange before the "
              "router runs). 0 = off; needs a token-choice router and no top-k schedule. The "
              "metrics file reports assignment_cache per layer: [changed, met again, routed by "
              "cache, micro-batches dispatched before routing].");
DEFINE_int32(moe_hierarchical_a2a_node_size, 0,
             "Two-level all-to-all (inside nodes of this many ranks, then between nodes); "
             "0 = flat.");

namespace fulcrum::plugins {
namespace {

absl::StatusOr<moe::MoeOptions> MoeOptionsFromFlags(const ModelOptions& model) {
  moe::MoeOptions o;
  o.num_experts = FLAGS_num_experts;
  o.topk = FLAGS_moe_router_topk;
  o.ffn_hidden_size = FLAGS_moe_ffn_hidden_size;
  FULCRUM_RETURN_IF_ERROR(moe::ParseMoeLayerFreq(FLAGS_moe_layer_freq, &o));
  o.router = FLAGS_moe_router;
  o.capacity_factor = FLAGS_moe_capacity_factor;
  o.batch_prioritized = FLAGS_moe_batch_prioritized_routing;
  o.per_expert_capacity = FLAGS_moe_per_expert_capacity;
  for (absl::string_view part : absl::StrSplit(FLAGS_moe_router_topk_schedule, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> ik = absl::StrSplit(part, absl::MaxSplits(':', 1));
    int64_t iteration = 0, k = 0;
    if (!absl::SimpleAtoi(ik.first, &iteration) || !absl::SimpleAtoi(ik.second, &k)) {
      return absl::InvalidArgumentError(absl::StrCat("--moe_router_topk_schedule: '", part,
                                  "' is not ITER:K (e.g. '1:2,500:1')"));
    }
    o.topk_schedule[iteration] = k;
  }
  o.hierarchical_node_size = FLAGS_moe_hierarchical_a2a_node_size;
  o.a2a_overlap_degree = FLAGS_moe_a2a_overlap_degree;
  o.assignment_cache_threshold = FLAGS_moe_assignment_cache_threshold;
  moe::RouterOptions& r = o.router_options;
  r.num_experts = FLAGS_num_experts;
  r.topk = FLAGS_moe_router_topk;
  r.aux_loss_coeff = FLAGS_moe_aux_loss_coeff;
  r.z_loss_coeff = FLAGS_moe_z_loss_coeff;
  r.input_jitter_eps = FLAGS_moe_input_jitter_eps;
  r.init_std = FLAGS_moe_router_init_std;
  r.noise_epsilon = FLAGS_moe_noise_epsilon;
  r.bias_update_rate = FLAGS_moe_router_bias_update_rate;
  r.sinkhorn_iterations = FLAGS_moe_sinkhorn_iterations;
  r.expert_choice_capacity_factor = FLAGS_moe_expert_choice_capacity_factor;
  r.cosine_projection_dim = FLAGS_moe_cosine_projection_dim;
  r.init_temperature = FLAGS_moe_cosine_init_temperature;
  r.cosine_min_temperature = FLAGS_moe_cosine_min_temperature;
  r.seed = model.seed;
  r.hidden_size = model.hidden_size;
  return o;
}

// The MoE layers' factory is built for the current layout in OnLayout: its expert exchange
// lives on the expert-parallel group, which a live shrink replaces (NOTE [plugin doors] in
// core/parallel_context.h). Layers built earlier keep the exchange they were built with.
class MoePlugin final : public Plugin {
 public:
  MoePlugin(moe::MoeOptions options, ModelOptions model,
            std::vector<std::pair<std::string, std::string>> shape)
      : options_(std::move(options)), model_(std::move(model)), shape_(std::move(shape)) {}
  const char* name() const override { return "moe"; }
  // The layers record their loads and auxiliary-loss values once (ForwardContext::
  // recomputing). Not with the assignment cache: the recomputed forward would look up the
  // assignments its first forward just recorded.
  bool SupportsRecompute() const override { return options_.assignment_cache_threshold <= 0; }
  // The layer hands the block the whole sequence and keeps its own rows of the output
  // (NOTE [sequence parallelism] in core/tensor_parallel.h): routing, the exchange and the
  // experts' tensor-parallel regions are those of a run without it.
  bool SupportsSequenceParallel() const override { return true; }

  absl::Status OnLayout(ParallelContext* parallel) override {
    // Building the exchange is collective over the expert group: every rank is here.
    moe::MoeGroups groups;
    if (parallel != nullptr) {
      groups.expert = parallel->communicator(ParallelContext::GroupRole::kExpert);
      groups.data = parallel->communicator(ParallelContext::GroupRole::kData);
      groups.tensor = parallel->tensor_parallel();
    }
    FULCRUM_ASSIGN_OR_RETURN(factory_, moe::MakeMoeFactory(options_, model_, groups));
    return absl::OkStatus();
  }

  std::unique_ptr<FeedForward> MakeFeedForward(int64_t layer, Unit& unit, bool initialize) override {
    if (!factory_) {
      // No OnLayout yet: one process (Plugin::OnLayout's contract), e.g. a model built
      // without a Trainer.
      absl::Status s = OnLayout(nullptr);
      TORCH_CHECK(s.ok(), "moe: ", s.ToString());
    }
    return factory_(layer, unit, initialize);
  }
  std::vector<std::pair<std::string, std::string>> CheckpointShape() const override { return shape_; }

 private:
  moe::MoeOptions options_;
  ModelOptions model_;
  std::vector<std::pair<std::string, std::string>> shape_;
  FeedForwardFactory factory_;  // For the layout of the last OnLayout.
};

absl::Status Validate(const PluginSetup& setup) {
  FULCRUM_ASSIGN_OR_RETURN(moe::MoeOptions options, MoeOptionsFromFlags(setup.model));
  if (options.num_experts == 0) {
    return absl::InvalidArgumentError("--plugins=moe needs --num_experts > 0");
  }
  if (setup.model.device_spec.master_dtype == at::kDouble) {
    return absl::InvalidArgumentError(
        "--params_dtype=fp64 is for dense models; the MoE layers (--num_experts) keep fp32 state");
  }
  return moe::ValidateMoeOptions(options, setup.model, setup.layout.ep_size, setup.layout.tp_size);
}

absl::StatusOr<std::unique_ptr<Plugin>> Create(const PluginSetup& setup) {
  FULCRUM_RETURN_IF_ERROR(Validate(setup));
  FULCRUM_ASSIGN_OR_RETURN(moe::MoeOptions options, MoeOptionsFromFlags(setup.model));
  if (options.assignment_cache_threshold > 0) {
    // The cache remembers every token of the training split (NOTE [assignment caching]).
    if (setup.corpus == nullptr) {
      return absl::FailedPreconditionError("the moe plugin's assignment cache needs the corpus");
    }
    FULCRUM_ASSIGN_OR_RETURN(auto train_split,
                             data::GptDataset::Create(setup.corpus, data::Split::kTrain, setup.data));
    options.assignment_cache_positions = train_split->num_tokens();
  }
  return std::unique_ptr<Plugin>(
      new MoePlugin(options, setup.model, moe::MoeShape(options, setup.model)));
}

}  // namespace

FULCRUM_REGISTER_PLUGIN(
    moe, "Mixture-of-Experts layers replace the MLP of every --moe_layer_freq-th layer (also "
         "selected by --num_experts > 0); load: the rows their experts computed",
    (PluginEntry{[] { return FLAGS_num_experts > 0; }, Validate, Create,
                 /*uses_expert_parallel_group=*/true, /*supports_bf16=*/true}));

}  // namespace fulcrum::plugins
