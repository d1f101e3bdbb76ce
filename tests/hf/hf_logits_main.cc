// fulcrum_hf_logits: Fulcrum's half of the comparison with Hugging Face transformers
// (tests/hf/hf_interop_test.py). It opens a Fulcrum checkpoint, builds the model its
// manifest describes, and writes what tests/hf/hf_reference.py `reference` writes for the
// same tokens with the Hugging Face model: the logits, the mean token loss, and the loss
// after one AdamW step (core/optimizer/adamw.h) on the same tokens — in the same file format
// (NOTE [hf comparison file] in hf_reference.py), so one `compare` reads both.
//
//   fulcrum_hf_logits --load=CKPT --tokens=TOKENS.json --out=RESULT.safetensors
//                     [--lr=1e-3 --weight_decay=0.1 --adam_beta1 ... --adam_eps ...]
//
// The model configuration is the manifest's "config"."model" (ConfigToJson in
// core/trainer.cc, which fulcrum_ckpt import-hf writes too). A key this binary does not
// know is an error rather than ignored: a model option it cannot set would make the
// comparison silently compare another model.
//
// A test tool: built with the tests, not installed. Exit status: 0 done, 1 failure
// (message on stderr), 2 wrong usage.
#include <gflags/gflags.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <iostream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "core/config.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/logging.h"
#include "core/optimizer/adamw.h"
#include "core/status.h"
#include "moe/moe_layer.h"

DEFINE_string(load, "", "Fulcrum checkpoint: a save directory or an iter_NNNNNNN directory.");
DEFINE_string(tokens, "",
              "JSON file {\"tokens\": [[...], ...]}: b rows of s+1 token ids; the inputs are the "
              "first s columns, the labels the last s (GptModel::ForwardLoss).");
DEFINE_string(out, "", "Result file (safetensors): logits, loss, loss_after_step.");
DEFINE_double(lr, 1e-3, "Learning rate of the one AdamW step.");
DEFINE_double(weight_decay, 0.0, "Decoupled weight decay (none on biases and norms).");
DEFINE_double(adam_beta1, 0.9, "AdamW beta1.");
DEFINE_double(adam_beta2, 0.999, "AdamW beta2.");
DEFINE_double(adam_eps, 1e-8, "AdamW epsilon.");
DEFINE_string(params_dtype, "fp32", "fp32 or fp64: the dtype the checkpoint is computed in.");
DEFINE_int64(moe_router_topk, 0,
             "MoE checkpoints: experts per token; 0 = the imported config's "
             "num_experts_per_tok (manifest imported_from.config).");
DEFINE_double(moe_aux_loss_coeff, 0.0,
              "MoE checkpoints: the router's balancing-loss scale in the AdamW step (0: the "
              "plain token loss, as hf_reference.py's step).");

namespace fulcrum {
namespace {

enum ExitCode { kOk = 0, kFailed = 1, kUsageError = 2 };

// A typed field of the manifest's model config, or an error naming it.
template <typename T>
absl::Status ReadField(const nlohmann::json& model, const char* key, T* out,
                       std::set<std::string>* seen) {
  seen->insert(key);
  if (!model.contains(key)) return absl::OkStatus();  // Keeps the option's default.
  try {
    *out = model.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest config.model.", key, ": ", model.at(key).dump(), " is not the ",
                     "expected type (", e.what(), ")"));
  }
  return absl::OkStatus();
}

// ModelOptions from ConfigToJson's "model" object (core/trainer.cc).
absl::StatusOr<ModelOptions> ModelOptionsFromJson(const nlohmann::json& model) {
  if (!model.is_object()) {
    return absl::InvalidArgumentError("manifest has no object config.model");
  }
  ModelOptions m;
  std::set<std::string> seen;
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "num_layers", &m.num_layers, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "hidden_size", &m.hidden_size, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "num_attention_heads", &m.num_attention_heads, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "ffn_hidden_size", &m.ffn_hidden_size, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "vocab_size", &m.vocab_size, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "seq_length", &m.seq_length, &seen));
  FULCRUM_RETURN_IF_ERROR(
      ReadField(model, "max_position_embeddings", &m.max_position_embeddings, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "rotary_base", &m.rotary_base, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "tie_embeddings", &m.tie_embeddings, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "init_method_std", &m.init_method_std, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "layernorm_epsilon", &m.layernorm_epsilon, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "hidden_dropout", &m.hidden_dropout, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "attention_dropout", &m.attention_dropout, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "seed", &m.seed, &seen));
  std::string position = PositionEmbeddingName(m.position_embedding);
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "position_embedding_type", &position, &seen));
  FULCRUM_RETURN_IF_ERROR(ParsePositionEmbedding(position, &m.position_embedding));
  // The checkpoint's own dtype is not what the comparison runs in: --params_dtype is.
  seen.insert("params_dtype");
  std::string normalization = NormalizationName(m.normalization);
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "normalization", &normalization, &seen));
  FULCRUM_RETURN_IF_ERROR(ParseNormalization(normalization, &m.normalization));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "swiglu", &m.swiglu, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "num_query_groups", &m.num_query_groups, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "add_bias_linear", &m.add_bias_linear, &seen));
  FULCRUM_RETURN_IF_ERROR(ReadField(model, "openai_gelu", &m.openai_gelu, &seen));
  std::vector<std::string> unknown;
  for (const auto& [key, value] : model.items()) {
    if (seen.count(key) == 0) unknown.push_back(key);
  }
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest config.model has keys this binary cannot set: ", absl::StrJoin(unknown, ", "),
        " (fulcrum_hf_logits would compute another model)"));
  }
  return m;
}

// The MoE layers of the manifest's "config"."feed_forward" (moe::MoeShape: string values),
// or a null factory for a dense model. Routing as Mixtral's: softmax top-k renormalised
// (the `topk` router), dropless (capacity factor 0: transformers drops no token), no
// jitter or noise.
absl::StatusOr<FeedForwardFactory> MoeFactory(const nlohmann::json& manifest,
                                              const ModelOptions& model) {
  const nlohmann::json& config = manifest["config"];
  if (!config.contains("feed_forward") || config["feed_forward"].empty()) return FeedForwardFactory();
  const nlohmann::json& shape = config["feed_forward"];
  moe::MoeOptions o;
  std::set<std::string> seen;
  auto integer = [&](const char* key, int64_t* out) -> absl::Status {
    seen.insert(key);
    if (!shape.contains(key) || !shape[key].is_string() ||
        !absl::SimpleAtoi(shape[key].get<std::string>(), out)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest config.feed_forward.", key, " must be an integer string, got ",
          shape.contains(key) ? shape[key].dump() : "nothing"));
    }
    return absl::OkStatus();
  };
  FULCRUM_RETURN_IF_ERROR(integer("num_experts", &o.num_experts));
  FULCRUM_RETURN_IF_ERROR(integer("moe_ffn_hidden_size", &o.ffn_hidden_size));
  seen.insert("moe_layer_freq");
  seen.insert("moe_router");
  if (!shape.contains("moe_layer_freq") || !shape["moe_layer_freq"].is_string() ||
      !shape.contains("moe_router") || !shape["moe_router"].is_string()) {
    return absl::InvalidArgumentError(
        "manifest config.feed_forward needs string moe_layer_freq and moe_router");
  }
  FULCRUM_RETURN_IF_ERROR(moe::ParseMoeLayerFreq(shape["moe_layer_freq"].get<std::string>(), &o));
  o.router = shape["moe_router"].get<std::string>();
  for (const auto& [key, value] : shape.items()) {
    if (seen.count(key) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "manifest config.feed_forward.", key, " is not something fulcrum_hf_logits can set"));
    }
  }
  o.topk = FLAGS_moe_router_topk;
  if (o.topk == 0) {
    const nlohmann::json imported =
        manifest.value("imported_from", nlohmann::json::object()).value("config", nlohmann::json::object());
    if (!imported.contains("num_experts_per_tok") || !imported["num_experts_per_tok"].is_number_integer()) {
      return absl::InvalidArgumentError(
          "an MoE checkpoint without imported_from.config.num_experts_per_tok needs --moe_router_topk");
    }
    o.topk = imported["num_experts_per_tok"].get<int64_t>();
  }
  o.capacity_factor = 0.0;
  moe::RouterOptions& r = o.router_options;
  r.num_experts = o.num_experts;
  r.topk = o.topk;
  r.aux_loss_coeff = FLAGS_moe_aux_loss_coeff;
  r.z_loss_coeff = 0.0;
  r.input_jitter_eps = 0.0;
  r.seed = model.seed;
  r.hidden_size = model.hidden_size;
  FULCRUM_RETURN_IF_ERROR(moe::ValidateMoeOptions(o, model, /*expert_parallel_size=*/1,
                                                  /*tensor_parallel_size=*/1));
  return moe::MakeMoeFactory(o, model, moe::MoeGroups());
}

absl::StatusOr<at::Tensor> ReadTokens(const std::string& path) {
  FULCRUM_ASSIGN_OR_RETURN(const std::string text, DefaultFileSystem()->ReadFile(path));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array() || j["tokens"].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected {\"tokens\": [[...], ...]}"));
  }
  const int64_t b = static_cast<int64_t>(j["tokens"].size());
  const int64_t n = static_cast<int64_t>(j["tokens"][0].size());
  std::vector<int64_t> flat;
  for (const nlohmann::json& row : j["tokens"]) {
    if (!row.is_array() || static_cast<int64_t>(row.size()) != n || n < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": every row must hold the same number (≥ 2) of tokens"));
    }
    for (const nlohmann::json& t : row) {
      if (!t.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": token ", t.dump(), " is not an integer"));
      }
      flat.push_back(t.get<int64_t>());
    }
  }
  return at::tensor(flat, at::kLong).view({b, n});
}

// Logits [b, s, V] of the inputs (the first s columns of tokens [b, s+1]).
at::Tensor Logits(const GptModel& model, const at::Tensor& tokens, const ForwardContext& ctx) {
  const int64_t s = tokens.size(1) - 1;
  at::Tensor hidden = model.Embed(tokens.narrow(1, 0, s), ctx);
  hidden = model.ForwardLayers(std::move(hidden), ctx);
  at::Tensor logits = model.head()->Logits(hidden, model.embedding()->word_embeddings());
  return logits.transpose(0, 1).contiguous();  // [s, b, V] → [b, s, V]
}

// Mean token loss, as the trainer computes it: the summed token loss over the token count.
at::Tensor MeanLoss(const GptModel& model, const at::Tensor& tokens, const ForwardContext& ctx) {
  LossSum loss = model.ForwardLoss(tokens, ctx);
  return loss.sum / static_cast<double>(loss.tokens);
}

absl::Status Run() {
  FULCRUM_ASSIGN_OR_RETURN(const ckpt::CheckpointReader reader, ckpt::CheckpointReader::Open(FLAGS_load));
  const nlohmann::json& manifest = reader.manifest();
  if (!manifest.contains("config") || !manifest["config"].contains("model")) {
    return absl::InvalidArgumentError(
        absl::StrCat(reader.dir(), ": the manifest has no config.model"));
  }
  FULCRUM_ASSIGN_OR_RETURN(ModelOptions options, ModelOptionsFromJson(manifest["config"]["model"]));
  FULCRUM_RETURN_IF_ERROR(ParseParamsDtype(FLAGS_params_dtype, &options.device_spec));
  FULCRUM_RETURN_IF_ERROR(options.Validate());
  FULCRUM_ASSIGN_OR_RETURN(const at::Tensor tokens, ReadTokens(FLAGS_tokens));
  if (tokens.size(1) - 1 > options.seq_length) {
    return absl::InvalidArgumentError(absl::StrCat(FLAGS_tokens, ": ", tokens.size(1) - 1,
                                                   " inputs per row exceed seq_length ",
                                                   options.seq_length));
  }
  if (tokens.min().item<int64_t>() < 0 || tokens.max().item<int64_t>() >= options.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(FLAGS_tokens, ": token ids must lie in [0, ", options.vocab_size, ")"));
  }

  FULCRUM_ASSIGN_OR_RETURN(FeedForwardFactory moe_layers, MoeFactory(manifest, options));
  GptModel model(options, StageSpec(), /*tp=*/nullptr, std::move(moe_layers));
  const std::vector<Unit*> units = model.Units();
  auto lookup = [&reader](const std::string& name) { return reader.Read(name); };
  for (Unit* unit : units) {
    // Parameters only: the comparison starts the optimizer afresh, as hf_reference.py does.
    FULCRUM_RETURN_IF_ERROR(unit->LoadStateTensors(lookup, /*optimizer_slots=*/{}));
    unit->set_optimizer_step(0);
    for (Parameter& p : unit->parameters()) p.optimizer_state.clear();
  }
  // Every tensor of the checkpoint's model must have been read: one the model does not
  // have (a bias the importer wrote for a model without biases) would otherwise be ignored.
  std::set<std::string> expected;
  for (Unit* unit : units) {
    for (const auto& [name, tensor] : unit->ParameterTensors()) expected.insert(name);
    for (const auto& [name, buffer] : unit->buffers()) expected.insert(unit->GlobalName(name));
  }
  std::vector<std::string> extra;
  for (const std::string& name : reader.names()) {
    if (name.rfind("optimizer.", 0) == 0 || name.rfind("rng.", 0) == 0) continue;
    if (expected.count(name) == 0) extra.push_back(name);
  }
  if (!extra.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        reader.dir(), " holds tensors the model has no place for: ", absl::StrJoin(extra, ", ")));
  }

  const int64_t num_tokens = tokens.size(0) * (tokens.size(1) - 1);
  at::Tensor logits, loss;
  {
    at::NoGradGuard no_grad;
    const ForwardContext eval(/*training=*/false);
    logits = Logits(model, tokens, eval).to(at::kFloat);
    loss = MeanLoss(model, tokens, eval).to(at::kDouble);
  }
  // One step as the trainer takes it (iteration 1, loss scaled by 1 / tokens; no clipping).
  const ForwardContext train(/*training=*/true, /*iteration=*/1, /*first_sample=*/0,
                             /*loss_scale=*/1.0 / static_cast<double>(num_tokens));
  model.ZeroGrad();
  LossSum step_loss = model.ForwardLoss(tokens, train);
  (step_loss.sum * train.loss_scale).backward();
  OptimizerOptions adam;
  adam.lr = FLAGS_lr;
  adam.weight_decay = FLAGS_weight_decay;
  adam.adam_beta1 = FLAGS_adam_beta1;
  adam.adam_beta2 = FLAGS_adam_beta2;
  adam.adam_eps = FLAGS_adam_eps;
  adam.clip_grad = 0.0;
  FULCRUM_RETURN_IF_ERROR(adam.Validate());
  AdamW(adam).Step(units, FLAGS_lr);
  at::Tensor loss_after_step;
  {
    at::NoGradGuard no_grad;
    loss_after_step = MeanLoss(model, tokens, ForwardContext(/*training=*/false)).to(at::kDouble);
  }
  FULCRUM_LOG(INFO) << "loss " << loss.item<double>() << ", after one AdamW step "
                    << loss_after_step.item<double>();
  return ckpt::WriteSafetensors(DefaultFileSystem(), FLAGS_out,
                                {{"logits", logits},
                                 {"loss", loss.reshape({})},
                                 {"loss_after_step", loss_after_step.reshape({})}},
                                {{"producer", "fulcrum_hf_logits"}, {"checkpoint", reader.dir()}});
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "fulcrum_hf_logits --load=CKPT --tokens=TOKENS.json --out=RESULT.safetensors: logits, "
      "loss and the loss after one AdamW step of a Fulcrum checkpoint (tests/hf)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  fulcrum::InitLogging(argv[0]);
  if (argc != 1 || FLAGS_load.empty() || FLAGS_tokens.empty() || FLAGS_out.empty()) {
    std::cerr << "fulcrum_hf_logits: --load, --tokens and --out are required (no positional "
                 "arguments)\n";
    return fulcrum::kUsageError;
  }
  const absl::Status status = fulcrum::Run();
  if (!status.ok()) {
    std::cerr << "fulcrum_hf_logits: " << status << "\n";
    return fulcrum::kFailed;
  }
  return fulcrum::kOk;
}
