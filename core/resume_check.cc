// CheckResume (core/training_manifest.h): whether a run may resume a saved one. Apart from
// the manifest parser because it needs the trainer's configuration (LibTorch), which the
// parser and its fuzz target do not.
#include <functional>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/trainer.h"
#include "core/training_manifest.h"

namespace fulcrum {
namespace {

// Configuration fields that must agree between a checkpoint and the run loading it: they
// decide the shape of the parameters. Named by their flag.
constexpr std::pair<const char*, const char*> kShapeFields[] = {
    {"num_layers", "num_layers"},
    {"hidden_size", "hidden_size"},
    {"num_attention_heads", "num_attention_heads"},
    {"ffn_hidden_size", "ffn_hidden_size"},
    {"vocab_size", "vocab_size (--make_vocab_size_divisible_by, --tokenizer_model)"},
    {"seq_length", "seq_length"},
    {"position_embedding_type", "position_embedding_type"},
    {"max_position_embeddings", "max_position_embeddings"},
    {"tie_embeddings", "untie_embeddings_and_output_weights"},
    {"normalization", "normalization"},
    {"swiglu", "swiglu"},
    {"num_query_groups", "num_query_groups"},
    {"add_bias_linear", "disable_bias_linear"},
};

// What a checkpoint saved before a shape field existed had: the GPT-2 shape.
nlohmann::json DefaultShapeField(const std::string& field, const nlohmann::json& model) {
  if (field == "normalization") return "LayerNorm";
  if (field == "swiglu") return false;
  if (field == "add_bias_linear") return true;
  if (field == "num_query_groups") return model.value("num_attention_heads", nlohmann::json());
  // The learned table had seq_length rows; rotary positions have none (ConfigToJson's 0).
  if (field == "max_position_embeddings") {
    return model.value("position_embedding_type", std::string("learned_absolute")) == "rope"
               ? nlohmann::json(0)
               : model.value("seq_length", nlohmann::json());
  }
  return nlohmann::json();
}

std::string Show(const nlohmann::json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

// The MLP replacement (MoE) must have the same shape; a checkpoint without the field is
// from a dense model. Fields are flag names. `refuse` makes the error.
absl::Status CompareFeedForward(const nlohmann::json& saved_config, const nlohmann::json& mine,
                                const std::function<absl::Status(const std::string&)>& refuse) {
  const nlohmann::json saved_blocks = saved_config.value("feed_forward", nlohmann::json::object());
  const nlohmann::json& our_blocks = mine["feed_forward"];
  // num_experts first: a dense model against an MoE one differs in every field, and the
  // expert count is what the user changed.
  std::vector<std::string> fields = {"num_experts"};
  for (const nlohmann::json* side : {&saved_blocks, &our_blocks}) {
    for (const auto& [field, value] : side->items()) fields.push_back(field);
  }
  for (const std::string& field : fields) {
    const std::string unset = field == "num_experts" ? "0" : "(unset)";  // dense
    const std::string a = saved_blocks.contains(field) ? Show(saved_blocks[field]) : unset;
    const std::string b = our_blocks.contains(field) ? Show(our_blocks[field]) : unset;
    if (a != b) {
      return refuse(absl::StrCat("checkpoint has --", field, "=", a, " but this run has --", field,
                                 "=", b));
    }
  }
  return absl::OkStatus();
}

// Not a shape, but what the model computes: --finetune refuses a mismatch (NOTE [finetune]).
// Checkpoints from before the field trained with plain GeLU.
constexpr std::pair<const char*, const char*> kFunctionFields[] = {
    {"openai_gelu", "openai_gelu"},
};

}  // namespace

absl::Status CheckResume(const TrainingManifest& saved, const TrainerConfig& ours,
                         const DataIdentity& our_data, const std::string& source,
                         std::vector<std::string>* warnings) {
  auto refuse = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  };
  const nlohmann::json mine = ConfigToJson(ours);
  const nlohmann::json& theirs = saved.config["model"];
  for (const auto& [field, flag] : kShapeFields) {
    const nlohmann::json value =
        theirs.contains(field) ? theirs[field] : DefaultShapeField(field, theirs);
    if (value != mine["model"][field]) {
      return refuse(absl::StrCat("checkpoint has ", field, "=", Show(value), " but this run has ",
                                 field, "=", Show(mine["model"][field]), " (--", flag, ")"));
    }
  }
  FULCRUM_RETURN_IF_ERROR(CompareFeedForward(saved.config, mine, refuse));
  if (ours.train.train_iters < saved.iteration) {
    return refuse(absl::StrCat("--train_iters=", ours.train.train_iters,
                               " is below the checkpoint's iteration ", saved.iteration,
                               "; nothing would be trained (raise --train_iters)"));
  }
  // The data and its order (NOTE [resume checks]).
  std::vector<std::string> changes;
  if (saved.data_seed != ours.data.seed) {
    changes.push_back(absl::StrCat("--seed ", saved.data_seed, " → ", ours.data.seed));
  }
  if (saved.split != ours.data.split) {
    changes.push_back(absl::StrCat("--split '", saved.split, "' → '", ours.data.split, "'"));
  }
  const bool identified = saved.data.documents > 0;
  if (identified &&
      (saved.data.documents != our_data.documents || saved.data.tokens != our_data.tokens)) {
    changes.push_back(absl::StrCat(
        "data ", saved.data.path.empty() ? "(embedded corpus)" : saved.data.path, " with ",
        saved.data.documents, " documents / ", saved.data.tokens, " tokens → ",
        our_data.path.empty() ? "(embedded corpus)" : our_data.path, " with ", our_data.documents,
        " documents / ", our_data.tokens, " tokens (--data_path)"));
  } else if (identified && saved.data.path != our_data.path) {
    warnings->push_back(absl::StrCat("the checkpoint trained on ", saved.data.path,
                                     "; this run reads ", our_data.path,
                                     " (same documents and tokens: taken as the same data)"));
  }
  if (!changes.empty()) {
    std::string list;
    for (const std::string& c : changes) absl::StrAppend(&list, list.empty() ? "" : "; ", c);
    if (!ours.train.allow_data_change) {
      return refuse(absl::StrCat("this run would not continue the saved run's data: ", list,
                                 ". Pass --allow_data_change to resume on other data on purpose"));
    }
    warnings->push_back(absl::StrCat("resuming on changed data (--allow_data_change): ", list));
  }
  return absl::OkStatus();
}

absl::Status CheckFinetune(const nlohmann::json& saved_config, const TrainerConfig& ours,
                           const std::string& source, std::vector<std::string>* warnings) {
  if (!saved_config.is_object() || !saved_config.contains("model") ||
      !saved_config["model"].is_object()) {
    return absl::DataLossError(
        absl::StrCat(source, ": no config.model, so the model's shape cannot be checked"));
  }
  auto refuse = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": ", what, "; --finetune loads the checkpoint's weights into this run's model, "
        "which must be the same model"));
  };
  const nlohmann::json mine = ConfigToJson(ours);
  const nlohmann::json& theirs = saved_config["model"];
  const bool rope = theirs.value("position_embedding_type", std::string()) == "rope" &&
                    mine["model"]["position_embedding_type"] == "rope";
  for (const auto& [field, flag] : kShapeFields) {
    const nlohmann::json value =
        theirs.contains(field) ? theirs[field] : DefaultShapeField(field, theirs);
    const nlohmann::json& our_value = mine["model"][field];
    if (std::string(field) == "seq_length") {
      // Not a shape of any weight. Rotary positions have no parameters: any length loads, a
      // longer one extrapolates. Learned ones: the table's rows (max_position_embeddings,
      // next) must agree, and ModelOptions::Validate keeps seq_length within them.
      if (rope && value.is_number() && our_value.is_number() &&
          our_value.get<double>() > value.get<double>()) {
        warnings->push_back(absl::StrCat("--seq_length=", Show(our_value),
                                         " is longer than the checkpoint's ", Show(value),
                                         " (rotary positions beyond those it trained on)"));
      }
      continue;
    }
    if (value != our_value && std::string(field) == "max_position_embeddings" &&
        value.is_number_integer() && value.get<int64_t>() > 0 && our_value.is_number_integer() &&
        our_value.get<int64_t>() > 0) {
      return refuse(absl::StrCat(
          "the checkpoint's learned position table has ", Show(value), " rows but this run's has ",
          Show(our_value), " (--max_position_embeddings",
          ours.model.max_position_embeddings == 0
              ? absl::StrCat(" unset: --seq_length=", ours.model.seq_length)
              : std::string(),
          "); a run at any --seq_length up to ", Show(value), " keeps the table with "
          "--max_position_embeddings=", Show(value)));
    }
    if (value != our_value) {
      return refuse(absl::StrCat("checkpoint has ", field, "=", Show(value), " but this run has ",
                                 field, "=", Show(our_value), " (--", flag, ")"));
    }
  }
  for (const auto& [field, flag] : kFunctionFields) {
    const nlohmann::json value = theirs.value(field, false);
    const nlohmann::json& our_value = mine["model"][field];
    if (value != our_value) {
      return refuse(absl::StrCat("checkpoint has ", field, "=", Show(value), " but this run has ",
                                 field, "=", Show(our_value), " (--", flag, ")"));
    }
  }
  FULCRUM_RETURN_IF_ERROR(CompareFeedForward(saved_config, mine, refuse));
  // Not shapes, but what the weights were trained with.
  for (const char* field : {"rotary_base", "layernorm_epsilon"}) {
    const nlohmann::json value = theirs.value(field, nlohmann::json());
    if (!value.is_null() && value != mine["model"][field] &&
        (std::string(field) != "rotary_base" || rope)) {
      warnings->push_back(absl::StrCat("the checkpoint's model has ", field, "=", Show(value),
                                       "; this run has ", Show(mine["model"][field])));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDataFitsVocabulary(const nlohmann::json& saved_config, int64_t data_max_token,
                                     const std::string& source) {
  if (!saved_config.is_object() || !saved_config.contains("model") ||
      !saved_config["model"].is_object()) {
    return absl::OkStatus();
  }
  const nlohmann::json vocab = saved_config["model"].value("vocab_size", nlohmann::json());
  if (!vocab.is_number_integer()) return absl::OkStatus();
  if (data_max_token >= vocab.get<int64_t>()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": the data holds token id ", data_max_token, " but the checkpoint's model has a "
        "vocabulary of ", vocab.get<int64_t>(), " entries: the data was tokenized for another "
        "model (--data_path, --tokenizer_model)"));
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
