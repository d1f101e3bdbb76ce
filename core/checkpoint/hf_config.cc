#include "core/checkpoint/hf_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/json_limits.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

// Typed access to one JSON object's fields; errors name `source` and the field.
class Fields {
 public:
  Fields(const nlohmann::json& object, std::string source)
      : object_(object), source_(std::move(source)) {}

  absl::Status Error(const std::string& field, const std::string& what) const {
    // "field=value ..." when `what` starts with the value, else "field what".
    const char* glue = !what.empty() && what[0] == '=' ? "" : " ";
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", field, glue, what));
  }
  bool Present(const std::string& field) const {
    return object_.contains(field) && !object_[field].is_null();
  }
  const nlohmann::json& Get(const std::string& field) const { return object_[field]; }

  // A positive integer; required unless `fallback` > 0 (used when absent or null).
  absl::StatusOr<int64_t> Positive(const std::string& field, int64_t fallback = 0) const {
    if (!Present(field)) {
      if (fallback > 0) return fallback;
      return Error(field, "is missing (a positive integer is required)");
    }
    absl::StatusOr<int64_t> value = JsonInteger<int64_t>(object_[field]);
    if (!value.ok()) return Error(field, std::string(value.status().message()));
    if (*value < 1) return Error(field, absl::StrCat("=", *value, " must be ≥ 1"));
    return *value;
  }
  absl::StatusOr<double> Number(const std::string& field, double fallback) const {
    if (!Present(field)) return fallback;
    if (!object_[field].is_number()) {
      return Error(field, absl::StrCat("=", object_[field].dump(), " is not a number"));
    }
    return object_[field].get<double>();
  }
  absl::StatusOr<bool> Bool(const std::string& field, bool fallback) const {
    if (!Present(field)) return fallback;
    if (!object_[field].is_boolean()) {
      return Error(field, absl::StrCat("=", object_[field].dump(), " is not true or false"));
    }
    return object_[field].get<bool>();
  }
  absl::StatusOr<std::string> String(const std::string& field, const std::string& fallback) const {
    if (!Present(field)) return fallback;
    if (!object_[field].is_string()) {
      return Error(field, absl::StrCat("=", object_[field].dump(), " is not a string"));
    }
    return object_[field].get<std::string>();
  }
  // Refuses `field` unless it is absent or null.
  absl::Status MustBeNull(const std::string& field, const std::string& why) const {
    if (!Present(field)) return absl::OkStatus();
    return Error(field, absl::StrCat("=", object_[field].dump(), " is not supported (", why,
                                     "); only null"));
  }
  // Refuses `field` when it is true.
  absl::Status MustNotBeTrue(const std::string& field, const std::string& why) const {
    FULCRUM_ASSIGN_OR_RETURN(const bool value, Bool(field, false));
    if (value) return Error(field, absl::StrCat("=true is not supported (", why, ")"));
    return absl::OkStatus();
  }

 private:
  const nlohmann::json& object_;
  std::string source_;
};

struct KnownArchitecture {
  HfArchitecture architecture;
  const char* name;
  const char* model_type;
};
constexpr KnownArchitecture kArchitectures[] = {
    {HfArchitecture::kGpt2, "GPT2LMHeadModel", "gpt2"},
    {HfArchitecture::kLlama, "LlamaForCausalLM", "llama"},
    {HfArchitecture::kMixtral, "MixtralForCausalLM", "mixtral"},
};

constexpr char kSupported[] = "GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM";

absl::StatusOr<HfArchitecture> FindArchitecture(const Fields& f) {
  FULCRUM_ASSIGN_OR_RETURN(const std::string model_type, f.String("model_type", ""));
  std::string architecture;
  if (f.Present("architectures")) {
    const nlohmann::json& list = f.Get("architectures");
    if (!list.is_array() || list.size() != 1 || !list[0].is_string()) {
      return f.Error("architectures", absl::StrCat("=", list.dump(),
                                                   " must list exactly one architecture (one of ",
                                                   kSupported, ")"));
    }
    architecture = list[0].get<std::string>();
  }
  for (const KnownArchitecture& known : kArchitectures) {
    const bool name_matches = architecture == known.name;
    const bool type_matches = model_type == known.model_type;
    if (architecture.empty() && type_matches) return known.architecture;
    if (!name_matches) continue;
    if (!model_type.empty() && !type_matches) {
      return f.Error("model_type", absl::StrCat("='", model_type, "' does not match architectures=[\"",
                                                architecture, "\"] (expected '", known.model_type,
                                                "')"));
    }
    return known.architecture;
  }
  if (!architecture.empty()) {
    return f.Error("architectures", absl::StrCat("=[\"", architecture, "\"] is not supported; ",
                                                 "supported: ", kSupported));
  }
  if (model_type.empty()) {
    return f.Error("architectures", absl::StrCat("and model_type are both missing; supported: ",
                                                 kSupported));
  }
  return f.Error("model_type", absl::StrCat("='", model_type,
                                            "' is not supported; supported: gpt2, llama, mixtral"));
}

absl::Status ParseGpt2(const Fields& f, HfModelConfig* m) {
  FULCRUM_ASSIGN_OR_RETURN(m->hidden_size, f.Positive("n_embd"));
  FULCRUM_ASSIGN_OR_RETURN(m->num_layers, f.Positive("n_layer"));
  FULCRUM_ASSIGN_OR_RETURN(m->num_attention_heads, f.Positive("n_head"));
  m->num_query_groups = m->num_attention_heads;
  FULCRUM_ASSIGN_OR_RETURN(m->ffn_hidden_size, f.Positive("n_inner", 4 * m->hidden_size));
  FULCRUM_ASSIGN_OR_RETURN(m->vocab_size, f.Positive("vocab_size"));
  FULCRUM_ASSIGN_OR_RETURN(m->max_positions, f.Positive("n_positions"));
  FULCRUM_ASSIGN_OR_RETURN(m->norm_epsilon, f.Number("layer_norm_epsilon", 1e-5));
  FULCRUM_ASSIGN_OR_RETURN(m->init_std, f.Number("initializer_range", 0.02));
  FULCRUM_ASSIGN_OR_RETURN(m->hidden_dropout, f.Number("resid_pdrop", 0.0));
  FULCRUM_ASSIGN_OR_RETURN(m->attention_dropout, f.Number("attn_pdrop", 0.0));
  FULCRUM_ASSIGN_OR_RETURN(const std::string act, f.String("activation_function", "gelu_new"));
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") {
    m->openai_gelu = true;  // Both are the tanh approximation.
  } else if (act == "gelu") {
    m->openai_gelu = false;
  } else {
    return f.Error("activation_function",
                   absl::StrCat("='", act, "' is not supported; GPT-2 models need gelu, gelu_new "
                                "or gelu_pytorch_tanh"));
  }
  FULCRUM_ASSIGN_OR_RETURN(m->tie_embeddings, f.Bool("tie_word_embeddings", true));
  if (!m->tie_embeddings) {
    return f.Error("tie_word_embeddings",
                   "=false is not supported for GPT2LMHeadModel (its lm_head is the word "
                   "embedding)");
  }
  FULCRUM_ASSIGN_OR_RETURN(const bool scale, f.Bool("scale_attn_weights", true));
  if (!scale) {
    return f.Error("scale_attn_weights", "=false is not supported (Fulcrum scales by 1/√d)");
  }
  FULCRUM_RETURN_IF_ERROR(f.MustNotBeTrue("scale_attn_by_inverse_layer_idx",
                                          "Fulcrum scales every layer by 1/√d alone"));
  FULCRUM_RETURN_IF_ERROR(f.MustNotBeTrue("add_cross_attention", "decoder-only models"));
  return absl::OkStatus();
}

absl::Status ParseLlamaLike(const Fields& f, HfModelConfig* m) {
  FULCRUM_ASSIGN_OR_RETURN(m->hidden_size, f.Positive("hidden_size"));
  FULCRUM_ASSIGN_OR_RETURN(m->num_layers, f.Positive("num_hidden_layers"));
  FULCRUM_ASSIGN_OR_RETURN(m->num_attention_heads, f.Positive("num_attention_heads"));
  FULCRUM_ASSIGN_OR_RETURN(m->num_query_groups,
                           f.Positive("num_key_value_heads", m->num_attention_heads));
  FULCRUM_ASSIGN_OR_RETURN(m->ffn_hidden_size, f.Positive("intermediate_size"));
  FULCRUM_ASSIGN_OR_RETURN(m->vocab_size, f.Positive("vocab_size"));
  FULCRUM_ASSIGN_OR_RETURN(m->max_positions, f.Positive("max_position_embeddings"));
  FULCRUM_ASSIGN_OR_RETURN(m->norm_epsilon, f.Number("rms_norm_eps", 1e-6));
  FULCRUM_ASSIGN_OR_RETURN(m->init_std, f.Number("initializer_range", 0.02));
  FULCRUM_ASSIGN_OR_RETURN(m->attention_dropout, f.Number("attention_dropout", 0.0));
  FULCRUM_ASSIGN_OR_RETURN(m->tie_embeddings, f.Bool("tie_word_embeddings", false));
  if (m->hidden_size % m->num_attention_heads != 0) {
    return f.Error("hidden_size", absl::StrCat("=", m->hidden_size,
                                               " is not divisible by num_attention_heads=",
                                               m->num_attention_heads));
  }
  if (m->num_attention_heads % m->num_query_groups != 0) {
    return f.Error("num_key_value_heads",
                   absl::StrCat("=", m->num_query_groups, " does not divide num_attention_heads=",
                                m->num_attention_heads));
  }
  if (f.Present("head_dim")) {
    FULCRUM_ASSIGN_OR_RETURN(const int64_t head_dim, f.Positive("head_dim"));
    if (head_dim != m->head_dim()) {
      return f.Error("head_dim", absl::StrCat("=", head_dim, " is not supported: Fulcrum's head "
                                              "dimension is hidden_size/num_attention_heads = ",
                                              m->head_dim()));
    }
  }
  FULCRUM_ASSIGN_OR_RETURN(const std::string act, f.String("hidden_act", "silu"));
  if (act != "silu") {
    return f.Error("hidden_act", absl::StrCat("='", act, "' is not supported; ",
                                              "Llama and Mixtral models need silu (SwiGLU)"));
  }
  FULCRUM_RETURN_IF_ERROR(f.MustNotBeTrue("attention_bias", "Fulcrum's Llama has no biases"));
  FULCRUM_RETURN_IF_ERROR(f.MustNotBeTrue("mlp_bias", "Fulcrum's Llama has no biases"));
  FULCRUM_RETURN_IF_ERROR(f.MustBeNull("sliding_window", "Fulcrum attends to the whole sequence"));
  FULCRUM_RETURN_IF_ERROR(f.MustBeNull("rope_scaling", "Fulcrum's rotary embedding is unscaled"));
  // transformers v4 writes rope_theta; v5 writes rope_parameters {rope_type, rope_theta}.
  FULCRUM_ASSIGN_OR_RETURN(m->rotary_base, f.Number("rope_theta", 10000.0));
  if (f.Present("rope_parameters")) {
    const nlohmann::json& rope = f.Get("rope_parameters");
    if (!rope.is_object()) return f.Error("rope_parameters", "is not an object");
    for (const auto& [key, value] : rope.items()) {
      if (key == "rope_theta") {
        if (!value.is_number()) return f.Error("rope_parameters.rope_theta", "is not a number");
        m->rotary_base = value.get<double>();
      } else if (key == "rope_type") {
        if (value != "default") {
          return f.Error("rope_parameters.rope_type",
                         absl::StrCat("=", value.dump(), " is not supported (Fulcrum's rotary "
                                      "embedding is unscaled); only \"default\""));
        }
      } else if (!value.is_null()) {
        return f.Error(absl::StrCat("rope_parameters.", key),
                       absl::StrCat("=", value.dump(), " is not supported (Fulcrum's rotary "
                                    "embedding is unscaled)"));
      }
    }
  }
  if (!(m->rotary_base > 0)) return f.Error("rope_theta", "must be > 0");
  if (m->head_dim() % 2 != 0) {
    return f.Error("hidden_size", absl::StrCat("/num_attention_heads = ", m->head_dim(),
                                               " is odd; rotary embeddings need an even head "
                                               "dimension"));
  }
  return absl::OkStatus();
}

absl::Status ParseMixtral(const Fields& f, HfModelConfig* m) {
  FULCRUM_RETURN_IF_ERROR(ParseLlamaLike(f, m));
  FULCRUM_ASSIGN_OR_RETURN(m->num_experts, f.Positive("num_local_experts"));
  FULCRUM_ASSIGN_OR_RETURN(m->experts_per_token, f.Positive("num_experts_per_tok"));
  FULCRUM_ASSIGN_OR_RETURN(m->router_aux_loss_coef, f.Number("router_aux_loss_coef", 0.001));
  FULCRUM_ASSIGN_OR_RETURN(const double jitter, f.Number("router_jitter_noise", 0.0));
  if (jitter != 0.0) {
    return f.Error("router_jitter_noise",
                   absl::StrCat("=", jitter, " is not supported (Fulcrum's --moe_input_jitter_eps "
                                "does not jitter the experts' input as HF does); only 0"));
  }
  if (m->experts_per_token > m->num_experts) {
    return f.Error("num_experts_per_tok", absl::StrCat("=", m->experts_per_token,
                                                       " exceeds num_local_experts=",
                                                       m->num_experts));
  }
  return absl::OkStatus();
}

std::string DoubleText(double value) {
  // Flag values that read back exactly.
  nlohmann::json j = value;
  return j.dump();
}

}  // namespace

const char* HfArchitectureName(HfArchitecture a) {
  for (const KnownArchitecture& known : kArchitectures) {
    if (known.architecture == a) return known.name;
  }
  return "?";
}

absl::StatusOr<HfModelConfig> ParseHfConfig(const nlohmann::json& config,
                                            const std::string& source) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  const Fields f(config, source);
  HfModelConfig m;
  FULCRUM_ASSIGN_OR_RETURN(m.architecture, FindArchitecture(f));
  switch (m.architecture) {
    case HfArchitecture::kGpt2: FULCRUM_RETURN_IF_ERROR(ParseGpt2(f, &m)); break;
    case HfArchitecture::kLlama: FULCRUM_RETURN_IF_ERROR(ParseLlamaLike(f, &m)); break;
    case HfArchitecture::kMixtral: FULCRUM_RETURN_IF_ERROR(ParseMixtral(f, &m)); break;
  }
  if (m.hidden_size % m.num_attention_heads != 0) {
    return f.Error(m.architecture == HfArchitecture::kGpt2 ? "n_embd" : "hidden_size",
                   absl::StrCat("=", m.hidden_size, " is not divisible by the number of heads ",
                                m.num_attention_heads));
  }
  return m;
}

nlohmann::json HfConfigJson(const HfModelConfig& m, const std::string& dtype) {
  nlohmann::json j;
  j["architectures"] = {HfArchitectureName(m.architecture)};
  j["dtype"] = dtype;
  j["torch_dtype"] = dtype;  // transformers v4's name of the same field.
  j["vocab_size"] = m.vocab_size;
  j["initializer_range"] = m.init_std;
  j["tie_word_embeddings"] = m.tie_embeddings;
  if (m.architecture == HfArchitecture::kGpt2) {
    j["model_type"] = "gpt2";
    j["n_embd"] = m.hidden_size;
    j["n_layer"] = m.num_layers;
    j["n_head"] = m.num_attention_heads;
    j["n_inner"] = m.ffn_hidden_size;
    j["n_positions"] = m.max_positions;
    j["layer_norm_epsilon"] = m.norm_epsilon;
    j["activation_function"] = m.openai_gelu ? "gelu_new" : "gelu";
    j["resid_pdrop"] = m.hidden_dropout;
    j["embd_pdrop"] = m.hidden_dropout;
    j["attn_pdrop"] = m.attention_dropout;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    // A Fulcrum checkpoint knows no special tokens. Left out, GPT2Config would default both
    // to 50256, which lies outside a smaller vocabulary (the byte tokens' 384) and makes
    // transformers warn on every load.
    j["bos_token_id"] = nullptr;
    j["eos_token_id"] = nullptr;
    return j;
  }
  j["model_type"] = m.architecture == HfArchitecture::kLlama ? "llama" : "mixtral";
  j["hidden_size"] = m.hidden_size;
  j["num_hidden_layers"] = m.num_layers;
  j["num_attention_heads"] = m.num_attention_heads;
  j["num_key_value_heads"] = m.num_query_groups;
  j["head_dim"] = m.head_dim();
  j["intermediate_size"] = m.ffn_hidden_size;
  j["max_position_embeddings"] = m.max_positions;
  j["rms_norm_eps"] = m.norm_epsilon;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = m.attention_dropout;
  // Both spellings: v4 reads rope_theta, v5 rope_parameters.
  j["rope_theta"] = m.rotary_base;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", m.rotary_base}};
  j["rope_scaling"] = nullptr;
  if (m.architecture == HfArchitecture::kLlama) {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  } else {
    j["sliding_window"] = nullptr;
    j["num_local_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.experts_per_token;
    j["router_aux_loss_coef"] = m.router_aux_loss_coef;
    j["router_jitter_noise"] = 0.0;
  }
  return j;
}

nlohmann::json FulcrumModelJson(const HfModelConfig& m) {
  const bool gpt2 = m.architecture == HfArchitecture::kGpt2;
  return {{"num_layers", m.num_layers},
          {"hidden_size", m.hidden_size},
          {"num_attention_heads", m.num_attention_heads},
          {"ffn_hidden_size", m.ffn_hidden_size},
          {"vocab_size", m.vocab_size},
          {"seq_length", m.max_positions},
          {"position_embedding_type", gpt2 ? "learned_absolute" : "rope"},
          {"max_position_embeddings", gpt2 ? m.max_positions : int64_t{0}},
          {"rotary_base", m.rotary_base},
          {"tie_embeddings", m.tie_embeddings},
          {"init_method_std", m.init_std},
          {"layernorm_epsilon", m.norm_epsilon},
          {"hidden_dropout", m.hidden_dropout},
          {"attention_dropout", m.attention_dropout},
          {"seed", 1234},
          {"params_dtype", "fp32"},
          {"normalization", gpt2 ? "LayerNorm" : "RMSNorm"},
          {"swiglu", !gpt2},
          {"num_query_groups", m.num_query_groups},
          {"add_bias_linear", gpt2},
          {"openai_gelu", m.openai_gelu}};
}

nlohmann::json FulcrumFeedForwardJson(const HfModelConfig& m) {
  if (m.num_experts == 0) return nlohmann::json::object();
  // Values are strings, as moe::MoeShape writes them.
  return {{"num_experts", std::to_string(m.num_experts)},
          {"moe_layer_freq", "1"},
          {"moe_ffn_hidden_size", std::to_string(m.ffn_hidden_size)},
          {"moe_router", "mixtral"}};
}

std::vector<std::string> FulcrumFlags(const HfModelConfig& m) {
  const bool gpt2 = m.architecture == HfArchitecture::kGpt2;
  std::vector<std::string> flags = {
      absl::StrCat("--num_layers=", m.num_layers),
      absl::StrCat("--hidden_size=", m.hidden_size),
      absl::StrCat("--num_attention_heads=", m.num_attention_heads),
      absl::StrCat("--ffn_hidden_size=", m.ffn_hidden_size),
      absl::StrCat("--norm_epsilon=", DoubleText(m.norm_epsilon)),
      // The vocabulary as it is: fulcrum_train would otherwise pad it to a multiple of 128.
      absl::StrCat("--vocab_size=", m.vocab_size),
      "--make_vocab_size_divisible_by=1",
  };
  if (gpt2) {
    // A shorter --seq_length after these fine-tunes on the same table (NOTE [finetune]).
    flags.push_back(absl::StrCat("--max_position_embeddings=", m.max_positions));
    flags.push_back(absl::StrCat("--seq_length=", m.max_positions));
    flags.push_back("--position_embedding_type=learned_absolute");
    if (m.openai_gelu) flags.push_back("--openai_gelu");
  } else {
    flags.push_back("--position_embedding_type=rope");
    flags.push_back(absl::StrCat("--rotary_base=", DoubleText(m.rotary_base)));
    flags.push_back("--normalization=RMSNorm");
    flags.push_back("--swiglu");
    flags.push_back("--disable_bias_linear");
    if (m.num_query_groups != m.num_attention_heads) {
      flags.push_back("--group_query_attention");
      flags.push_back(absl::StrCat("--num_query_groups=", m.num_query_groups));
    }
    if (!m.tie_embeddings) flags.push_back("--untie_embeddings_and_output_weights");
  }
  if (m.num_experts > 0) {
    flags.push_back(absl::StrCat("--num_experts=", m.num_experts));
    flags.push_back("--moe_layer_freq=1");
    flags.push_back("--moe_router=mixtral");
    flags.push_back(absl::StrCat("--moe_router_topk=", m.experts_per_token));
    flags.push_back("--moe_capacity_factor=0");  // Mixtral drops no token.
    flags.push_back(absl::StrCat("--moe_aux_loss_coeff=", DoubleText(m.router_aux_loss_coef)));
  }
  return flags;
}

absl::StatusOr<HfModelConfig> HfConfigFromFulcrum(const nlohmann::json& model,
                                                  const nlohmann::json& feed_forward,
                                                  int64_t experts_per_token,
                                                  const nlohmann::json& imported_config) {
  if (!model.is_object()) {
    return absl::InvalidArgumentError("the checkpoint's config has no \"model\" object");
  }
  const Fields f(model, "checkpoint config.model");
  auto refuse = [](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("the checkpoint's model maps to no Hugging Face architecture: ", why));
  };
  HfModelConfig m;
  FULCRUM_ASSIGN_OR_RETURN(m.num_layers, f.Positive("num_layers"));
  FULCRUM_ASSIGN_OR_RETURN(m.hidden_size, f.Positive("hidden_size"));
  FULCRUM_ASSIGN_OR_RETURN(m.num_attention_heads, f.Positive("num_attention_heads"));
  FULCRUM_ASSIGN_OR_RETURN(m.ffn_hidden_size, f.Positive("ffn_hidden_size"));
  FULCRUM_ASSIGN_OR_RETURN(m.vocab_size, f.Positive("vocab_size"));
  FULCRUM_ASSIGN_OR_RETURN(m.max_positions, f.Positive("seq_length"));
  // Checkpoints from before grouped-query attention, RMSNorm and SwiGLU lack these fields:
  // their defaults are the model they trained.
  FULCRUM_ASSIGN_OR_RETURN(m.num_query_groups,
                           f.Positive("num_query_groups", m.num_attention_heads));
  FULCRUM_ASSIGN_OR_RETURN(m.tie_embeddings, f.Bool("tie_embeddings", true));
  FULCRUM_ASSIGN_OR_RETURN(m.norm_epsilon, f.Number("layernorm_epsilon", 1e-5));
  FULCRUM_ASSIGN_OR_RETURN(m.rotary_base, f.Number("rotary_base", 10000.0));
  FULCRUM_ASSIGN_OR_RETURN(m.init_std, f.Number("init_method_std", 0.02));
  FULCRUM_ASSIGN_OR_RETURN(m.hidden_dropout, f.Number("hidden_dropout", 0.0));
  FULCRUM_ASSIGN_OR_RETURN(m.attention_dropout, f.Number("attention_dropout", 0.0));
  FULCRUM_ASSIGN_OR_RETURN(m.openai_gelu, f.Bool("openai_gelu", false));
  FULCRUM_ASSIGN_OR_RETURN(const bool swiglu, f.Bool("swiglu", false));
  FULCRUM_ASSIGN_OR_RETURN(const bool bias, f.Bool("add_bias_linear", true));
  FULCRUM_ASSIGN_OR_RETURN(const std::string norm, f.String("normalization", "LayerNorm"));
  FULCRUM_ASSIGN_OR_RETURN(const std::string positions,
                           f.String("position_embedding_type", "learned_absolute"));
  if (positions == "learned_absolute") {
    // GPT-2's n_positions is the table's rows, which a run at a shorter seq_length keeps;
    // checkpoints from before the field had seq_length rows.
    FULCRUM_ASSIGN_OR_RETURN(m.max_positions, f.Positive("max_position_embeddings", m.max_positions));
  }
  if (m.hidden_size % m.num_attention_heads != 0 ||
      m.num_attention_heads % m.num_query_groups != 0) {
    return f.Error("num_query_groups", "does not divide the heads, or the heads the hidden size");
  }

  int64_t num_experts = 0;
  bool topk_router = false;
  if (feed_forward.is_object() && feed_forward.contains("num_experts")) {
    const nlohmann::json& e = feed_forward["num_experts"];
    const std::string text = e.is_string() ? e.get<std::string>() : e.dump();
    num_experts = std::atoll(text.c_str());
    if (num_experts > 0) {
      const std::string freq = feed_forward.value("moe_layer_freq", std::string("1"));
      if (freq != "1") {
        return refuse(absl::StrCat("--moe_layer_freq=", freq, " (Mixtral has experts in every "
                                   "layer: only 1)"));
      }
      const std::string router = feed_forward.value("moe_router", std::string("topk"));
      if (router != "mixtral" && router != "topk") {
        return refuse(absl::StrCat("--moe_router=", router, " (Mixtral routes by softmax top-k "
                                   "renormalised: only mixtral, or topk with k > 1)"));
      }
      topk_router = router == "topk";
      if (feed_forward.contains("moe_assignment_cache_threshold")) {
        return refuse("--moe_assignment_cache_threshold (Mixtral has no assignment cache)");
      }
      const std::string f_text = feed_forward.value("moe_ffn_hidden_size", std::string());
      if (!f_text.empty() && std::atoll(f_text.c_str()) != m.ffn_hidden_size) {
        return refuse(absl::StrCat("--moe_ffn_hidden_size=", f_text, " differs from ",
                                   "--ffn_hidden_size=", m.ffn_hidden_size,
                                   " (Mixtral has one intermediate_size)"));
      }
    }
  }

  if (norm == "LayerNorm") {
    m.architecture = HfArchitecture::kGpt2;
    if (positions != "learned_absolute") {
      return refuse(absl::StrCat("LayerNorm with --position_embedding_type=", positions,
                                 " (GPT-2 has learned positions; Llama has RMSNorm)"));
    }
    if (swiglu) return refuse("LayerNorm with --swiglu (GPT-2 has a GeLU MLP; Llama has RMSNorm)");
    if (!bias) return refuse("--disable_bias_linear with LayerNorm (GPT-2 has biases)");
    if (!m.tie_embeddings) {
      return refuse("--untie_embeddings_and_output_weights with LayerNorm (GPT-2 ties them)");
    }
    if (m.num_query_groups != m.num_attention_heads) {
      return refuse("--num_query_groups with LayerNorm (GPT-2 has one key/value head per head)");
    }
    if (num_experts > 0) return refuse("--num_experts with LayerNorm (Mixtral has RMSNorm)");
    return m;
  }
  if (norm != "RMSNorm") return refuse(absl::StrCat("--normalization=", norm));
  m.architecture = num_experts > 0 ? HfArchitecture::kMixtral : HfArchitecture::kLlama;
  if (positions != "rope") {
    return refuse(absl::StrCat("RMSNorm with --position_embedding_type=", positions,
                               " (Llama and Mixtral use rope; GPT-2 has LayerNorm)"));
  }
  if (!swiglu) return refuse("RMSNorm without --swiglu (Llama and Mixtral have SwiGLU MLPs)");
  if (bias) return refuse("RMSNorm without --disable_bias_linear (Llama and Mixtral have no biases)");
  if (m.openai_gelu) return refuse("--openai_gelu with --swiglu");
  if (num_experts > 0) {
    m.num_experts = num_experts;
    m.experts_per_token = experts_per_token;
    m.router_aux_loss_coef = 0.0;
    if (imported_config.is_object()) {
      if (m.experts_per_token == 0) {
        m.experts_per_token = imported_config.value("num_experts_per_tok", int64_t{0});
      }
      m.router_aux_loss_coef = imported_config.value("router_aux_loss_coef", 0.0);
    }
    if (m.experts_per_token < 1 || m.experts_per_token > m.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the checkpoint does not record the MoE top-k (num_experts_per_tok); pass "
          "--num_experts_per_tok=K with 1 ≤ K ≤ ", m.num_experts,
          " (the --moe_router_topk it trained with)"));
    }
    if (topk_router && m.experts_per_token == 1) {
      // For k = 1 `topk` keeps the probability as the gate; Mixtral renormalises it to 1.
      return refuse("--moe_router=topk with top-1 routing (Mixtral's gate would be 1: only "
                    "--moe_router=mixtral)");
    }
  }
  return m;
}

}  // namespace fulcrum::ckpt
