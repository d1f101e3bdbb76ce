// Hugging Face import/export (core/checkpoint/hf_checkpoint.h) on synthetic transformers
// directories written here: round trips are exact, the fused and grouped layouts agree with
// the spec's row formulas computed by hand, and every refused input names its field and
// leaves nothing behind. (Comparison against the transformers library itself is in
// tests/hf/, which runs the same fulcrum_ckpt binary.)
#include "core/checkpoint/hf_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "tests/core/checkpoint/test_util.h"
#include "tests/run_command.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::ScopedTempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Tensors = std::map<std::string, at::Tensor>;

// Distinct values everywhere, so any misplaced element is caught: tensor k holds
// 1000·k + 0, 1, 2, ...
at::Tensor Distinct(std::vector<int64_t> shape, int k) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return (at::arange(n, at::kFloat) + 1000.0 * k).reshape(shape);
}

// Writes config.json and the tensors into `dir`: one model.safetensors, or `shards` files
// with model.safetensors.index.json.
void WriteHfDir(const std::string& dir, const nlohmann::json& config, const Tensors& tensors,
                int shards = 1) {
  ASSERT_TRUE(DefaultFileSystem()->CreateDir(dir).ok());
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), JoinPath(dir, "config.json"), config.dump(2)).ok());
  if (shards == 1) {
    std::vector<std::pair<std::string, at::Tensor>> list(tensors.begin(), tensors.end());
    ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(), JoinPath(dir, "model.safetensors"), list, {{"format", "pt"}})
                    .ok());
    return;
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> parts(shards);
  nlohmann::json weight_map;
  int i = 0;
  for (const auto& [name, t] : tensors) {
    const int part = i++ % shards;
    parts[part].emplace_back(name, t);
    weight_map[name] = absl::StrFormat("model-%05d-of-%05d.safetensors", part + 1, shards);
  }
  for (int part = 0; part < shards; ++part) {
    ASSERT_TRUE(WriteSafetensors(DefaultFileSystem(),
                                 JoinPath(dir, absl::StrFormat("model-%05d-of-%05d.safetensors",
                                                               part + 1, shards)),
                                 parts[part], {})
                    .ok());
  }
  const nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), JoinPath(dir, "model.safetensors.index.json"), index.dump())
                  .ok());
}

// Every tensor of an exported directory (single or sharded).
Tensors ReadHfDir(const std::string& dir) {
  Tensors out;
  const std::vector<std::string> files = *DefaultFileSystem()->ListDir(dir);  // Outlives the loop.
  for (const std::string& file : files) {
    if (file.size() < 12 || file.substr(file.size() - 12) != ".safetensors") continue;
    auto reader = SafetensorsReader::Open(JoinPath(dir, file));
    EXPECT_TRUE(reader.ok()) << reader.status();
    for (const std::string& name : (*reader)->names()) out[name] = *(*reader)->Read(name);
  }
  return out;
}

void ExpectSameTensors(const Tensors& expected, const Tensors& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(actual.count(name)) << "missing " << name;
    EXPECT_EQ(t.scalar_type(), actual.at(name).scalar_type()) << name;
    EXPECT_TRUE(at::equal(t, actual.at(name))) << name;
  }
}

// A tensor of an imported checkpoint.
at::Tensor Imported(const std::string& out, const std::string& name) {
  auto reader = CheckpointReader::Open(out);
  EXPECT_TRUE(reader.ok()) << reader.status();
  auto t = reader->Read(name);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

// ----- GPT-2: h=8, 2 heads (d=4), 2 layers, f=16, V=10, 6 positions.
constexpr int64_t kH = 8, kHeads = 2, kD = 4, kF = 16, kV = 10, kS = 6, kLayers = 2;

nlohmann::json Gpt2Config() {
  return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"n_embd", kH},
          {"n_head", kHeads}, {"n_layer", kLayers}, {"n_inner", kF}, {"n_positions", kS},
          {"vocab_size", kV}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},
          {"tie_word_embeddings", true}};
}

Tensors Gpt2Tensors(const std::string& prefix = "transformer.") {
  Tensors t;
  int k = 0;
  t[prefix + "wte.weight"] = Distinct({kV, kH}, k++);
  t[prefix + "wpe.weight"] = Distinct({kS, kH}, k++);
  for (int i = 0; i < kLayers; ++i) {
    const std::string l = absl::StrCat(prefix, "h.", i, ".");
    t[l + "ln_1.weight"] = Distinct({kH}, k++);
    t[l + "ln_1.bias"] = Distinct({kH}, k++);
    t[l + "attn.c_attn.weight"] = Distinct({kH, 3 * kH}, k++);
    t[l + "attn.c_attn.bias"] = Distinct({3 * kH}, k++);
    t[l + "attn.c_proj.weight"] = Distinct({kH, kH}, k++);
    t[l + "attn.c_proj.bias"] = Distinct({kH}, k++);
    t[l + "ln_2.weight"] = Distinct({kH}, k++);
    t[l + "ln_2.bias"] = Distinct({kH}, k++);
    t[l + "mlp.c_fc.weight"] = Distinct({kH, kF}, k++);
    t[l + "mlp.c_fc.bias"] = Distinct({kF}, k++);
    t[l + "mlp.c_proj.weight"] = Distinct({kF, kH}, k++);
    t[l + "mlp.c_proj.bias"] = Distinct({kH}, k++);
  }
  t[prefix + "ln_f.weight"] = Distinct({kH}, k++);
  t[prefix + "ln_f.bias"] = Distinct({kH}, k++);
  return t;
}

// ----- Llama / Mixtral: h=16, 4 heads (d=4), 2 groups, f=12, V=10, 2 layers, 3 experts.
constexpr int64_t kLH = 16, kLHeads = 4, kLG = 2, kLD = 4, kLF = 12, kExperts = 3;

nlohmann::json LlamaConfig(bool tied = false) {
  return {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", kLH},
          {"num_hidden_layers", kLayers}, {"num_attention_heads", kLHeads},
          {"num_key_value_heads", kLG}, {"intermediate_size", kLF}, {"vocab_size", kV},
          {"max_position_embeddings", 64}, {"rms_norm_eps", 1e-6}, {"hidden_act", "silu"},
          {"attention_bias", false}, {"mlp_bias", false}, {"head_dim", kLD},
          {"rope_parameters", {{"rope_theta", 500000.0}, {"rope_type", "default"}}},
          {"tie_word_embeddings", tied}};
}

nlohmann::json MixtralConfig() {
  nlohmann::json c = LlamaConfig();
  c["architectures"] = {"MixtralForCausalLM"};
  c["model_type"] = "mixtral";
  c.erase("attention_bias");
  c.erase("mlp_bias");
  c["head_dim"] = nullptr;
  c["sliding_window"] = nullptr;
  c["num_local_experts"] = kExperts;
  c["num_experts_per_tok"] = 2;
  c["router_aux_loss_coef"] = 0.02;
  return c;
}

Tensors LlamaTensors(bool mixtral, bool tied = false) {
  Tensors t;
  int k = 0;
  t["model.embed_tokens.weight"] = Distinct({kV, kLH}, k++);
  for (int i = 0; i < kLayers; ++i) {
    const std::string l = absl::StrCat("model.layers.", i, ".");
    t[l + "input_layernorm.weight"] = Distinct({kLH}, k++);
    t[l + "self_attn.q_proj.weight"] = Distinct({kLHeads * kLD, kLH}, k++);
    t[l + "self_attn.k_proj.weight"] = Distinct({kLG * kLD, kLH}, k++);
    t[l + "self_attn.v_proj.weight"] = Distinct({kLG * kLD, kLH}, k++);
    t[l + "self_attn.o_proj.weight"] = Distinct({kLH, kLHeads * kLD}, k++);
    t[l + "post_attention_layernorm.weight"] = Distinct({kLH}, k++);
    if (!mixtral) {
      t[l + "mlp.gate_proj.weight"] = Distinct({kLF, kLH}, k++);
      t[l + "mlp.up_proj.weight"] = Distinct({kLF, kLH}, k++);
      t[l + "mlp.down_proj.weight"] = Distinct({kLH, kLF}, k++);
      continue;
    }
    t[l + "block_sparse_moe.gate.weight"] = Distinct({kExperts, kLH}, k++);
    for (int e = 0; e < kExperts; ++e) {
      const std::string x = absl::StrCat(l, "block_sparse_moe.experts.", e, ".");
      t[x + "w1.weight"] = Distinct({kLF, kLH}, k++);
      t[x + "w2.weight"] = Distinct({kLH, kLF}, k++);
      t[x + "w3.weight"] = Distinct({kLF, kLH}, k++);
    }
  }
  t["model.norm.weight"] = Distinct({kLH}, k++);
  if (!tied) t["lm_head.weight"] = Distinct({kV, kLH}, k++);
  return t;
}

// A refused input: `status` is an error naming `mentions`, and neither the output nor a
// staging directory exists afterwards.
void ExpectRefusedAndNothingWritten(const absl::Status& status, const std::string& mentions,
                                    const ScopedTempDir& tmp, const std::string& out) {
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr(mentions));
  EXPECT_FALSE(DefaultFileSystem()->FileExists(out)) << out << " was written";
  const std::vector<std::string> entries = *DefaultFileSystem()->ListDir(tmp.path());
  for (const std::string& entry : entries) {
    EXPECT_EQ(entry.find("_tmp_"), std::string::npos) << "staging left behind: " << entry;
  }
}

TEST(HfGpt2Test, RoundTripIsExact) {
  ScopedTempDir tmp;
  const Tensors original = Gpt2Tensors();
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), original);
  auto imported = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->tensors, static_cast<int64_t>(original.size()));
  auto exported = ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back"));
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));

  const nlohmann::json config = nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/config.json")));
  EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
  EXPECT_EQ(config["activation_function"], "gelu_new");
  EXPECT_EQ(config["n_inner"], kF);
  EXPECT_EQ(config["n_positions"], kS);
  EXPECT_EQ(config["tie_word_embeddings"], true);
}

TEST(HfGpt2Test, ImportedManifestSaysImportAndHoldsTheModelConfig) {
  ScopedTempDir tmp;
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), Gpt2Tensors());
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  auto reader = CheckpointReader::Open(tmp.Join("ckpt"));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 0);
  const nlohmann::json& m = reader->manifest();
  EXPECT_EQ(m["imported_from"]["format"], "huggingface");
  EXPECT_EQ(m["imported_from"]["architecture"], "GPT2LMHeadModel");
  EXPECT_EQ(m["imported_from"]["config"]["n_embd"], kH);
  const nlohmann::json& model = m["config"]["model"];
  EXPECT_EQ(model["hidden_size"], kH);
  EXPECT_EQ(model["num_layers"], kLayers);
  EXPECT_EQ(model["ffn_hidden_size"], kF);
  EXPECT_EQ(model["vocab_size"], kV);
  EXPECT_EQ(model["seq_length"], kS);
  EXPECT_EQ(model["position_embedding_type"], "learned_absolute");
  EXPECT_EQ(model["normalization"], "LayerNorm");
  EXPECT_EQ(model["openai_gelu"], true);
  EXPECT_EQ(model["add_bias_linear"], true);
  EXPECT_EQ(model["num_query_groups"], kHeads);
  EXPECT_TRUE(m["config"]["feed_forward"].empty());
  for (const std::string& name : reader->names()) {
    EXPECT_EQ(name.rfind("optimizer.", 0), std::string::npos) << name;
  }
}

TEST(HfGpt2Test, Conv1DTransposedAndCAttnReorderedAsTheSpecSays) {
  ScopedTempDir tmp;
  const Tensors hf = Gpt2Tensors();
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), hf);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  const at::Tensor c_attn = hf.at("transformer.h.1.attn.c_attn.weight");  // [in, out]
  const at::Tensor c_bias = hf.at("transformer.h.1.attn.c_attn.bias");
  const at::Tensor qkv = Imported(tmp.Join("ckpt"), "layers.1.self_attention.linear_qkv.weight");
  const at::Tensor qkv_bias = Imported(tmp.Join("ckpt"), "layers.1.self_attention.linear_qkv.bias");
  ASSERT_EQ(qkv.sizes(), (std::vector<int64_t>{3 * kH, kH}));
  // Row (head j, part p ∈ {q, k, v}, r) of ours is output column p·h + j·d + r of c_attn.
  for (int64_t j = 0; j < kHeads; ++j) {
    for (int64_t p = 0; p < 3; ++p) {
      for (int64_t r = 0; r < kD; ++r) {
        const int64_t ours = (j * 3 + p) * kD + r, theirs = p * kH + j * kD + r;
        EXPECT_TRUE(at::equal(qkv[ours], c_attn.select(1, theirs))) << j << " " << p << " " << r;
        EXPECT_EQ(qkv_bias[ours].item<float>(), c_bias[theirs].item<float>());
      }
    }
  }
  EXPECT_TRUE(at::equal(Imported(tmp.Join("ckpt"), "layers.1.mlp.linear_fc1.weight"),
                        hf.at("transformer.h.1.mlp.c_fc.weight").t()));
  EXPECT_TRUE(at::equal(Imported(tmp.Join("ckpt"), "layers.1.mlp.linear_fc2.weight"),
                        hf.at("transformer.h.1.mlp.c_proj.weight").t()));
  EXPECT_TRUE(at::equal(Imported(tmp.Join("ckpt"), "layers.1.self_attention.linear_proj.weight"),
                        hf.at("transformer.h.1.attn.c_proj.weight").t()));
}

TEST(HfGpt2Test, HubNamingWithoutPrefixAndMaskBuffersImport) {
  ScopedTempDir tmp;
  Tensors hub = Gpt2Tensors(/*prefix=*/"");
  hub["h.0.attn.bias"] = at::ones({1, 1, kS, kS});  // Causal mask saved by old transformers.
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), hub);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  ASSERT_TRUE(ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back")).ok());
  ExpectSameTensors(Gpt2Tensors(), ReadHfDir(tmp.Join("back")));  // Written with the prefix.
}

TEST(HfLlamaTest, ShardedRoundTripIsExact) {
  ScopedTempDir tmp;
  const Tensors original = LlamaTensors(/*mixtral=*/false);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), original, /*shards=*/3);
  auto imported = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->model.architecture, HfArchitecture::kLlama);
  EXPECT_EQ(imported->model.rotary_base, 500000.0);
  auto exported = ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back"));
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));
  const nlohmann::json config = nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/config.json")));
  EXPECT_EQ(config["num_key_value_heads"], kLG);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["rope_theta"], 500000.0);
  EXPECT_EQ(config["max_position_embeddings"], 64);
}

TEST(HfLlamaTest, GroupedQkvAndSwiGluRowsAsTheSpecSays) {
  ScopedTempDir tmp;
  const Tensors hf = LlamaTensors(/*mixtral=*/false);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), hf);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  const at::Tensor qkv = Imported(tmp.Join("ckpt"), "layers.0.self_attention.linear_qkv.weight");
  const at::Tensor q = hf.at("model.layers.0.self_attn.q_proj.weight");
  const at::Tensor k = hf.at("model.layers.0.self_attn.k_proj.weight");
  const at::Tensor v = hf.at("model.layers.0.self_attn.v_proj.weight");
  const int64_t per_group = kLHeads / kLG;           // 2 query heads per group.
  const int64_t group_rows = (per_group + 2) * kLD;  // q of its heads, k, v.
  ASSERT_EQ(qkv.size(0), kLG * group_rows);
  for (int64_t j = 0; j < kLHeads; ++j) {
    const int64_t g = j / per_group;  // HF repeat_kv: head j reads key/value head j / per_group.
    for (int64_t r = 0; r < kLD; ++r) {
      EXPECT_TRUE(at::equal(qkv[g * group_rows + (j % per_group) * kLD + r], q[j * kLD + r]))
          << "q head " << j << " row " << r;
    }
  }
  for (int64_t g = 0; g < kLG; ++g) {
    for (int64_t r = 0; r < kLD; ++r) {
      EXPECT_TRUE(at::equal(qkv[g * group_rows + per_group * kLD + r], k[g * kLD + r]));
      EXPECT_TRUE(at::equal(qkv[g * group_rows + (per_group + 1) * kLD + r], v[g * kLD + r]));
    }
  }
  const at::Tensor fc1 = Imported(tmp.Join("ckpt"), "layers.0.mlp.linear_fc1.weight");
  ASSERT_EQ(fc1.size(0), 2 * kLF);
  for (int64_t j = 0; j < kLF; ++j) {
    EXPECT_TRUE(at::equal(fc1[2 * j], hf.at("model.layers.0.mlp.gate_proj.weight")[j]));
    EXPECT_TRUE(at::equal(fc1[2 * j + 1], hf.at("model.layers.0.mlp.up_proj.weight")[j]));
  }
  EXPECT_TRUE(at::equal(Imported(tmp.Join("ckpt"), "head.output_layer.weight"),
                        hf.at("lm_head.weight")));
  auto reader = CheckpointReader::Open(tmp.Join("ckpt"));
  const nlohmann::json& model = reader->manifest()["config"]["model"];
  EXPECT_EQ(model["normalization"], "RMSNorm");
  EXPECT_EQ(model["swiglu"], true);
  EXPECT_EQ(model["add_bias_linear"], false);
  EXPECT_EQ(model["num_query_groups"], kLG);
  EXPECT_EQ(model["position_embedding_type"], "rope");
  EXPECT_EQ(model["tie_embeddings"], false);
}

TEST(HfLlamaTest, Bfloat16StaysBfloat16) {
  ScopedTempDir tmp;
  Tensors original = LlamaTensors(/*mixtral=*/false);
  for (auto& [name, t] : original) t = t.to(at::kBFloat16);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), original);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  EXPECT_EQ(Imported(tmp.Join("ckpt"), "layers.0.mlp.linear_fc1.weight").scalar_type(),
            at::kBFloat16);
  ASSERT_TRUE(ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back")).ok());
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));
  const nlohmann::json config = nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/config.json")));
  EXPECT_EQ(config["dtype"], "bfloat16");
}

TEST(HfLlamaTest, TiedEmbeddingsHaveNoHeadWeight) {
  ScopedTempDir tmp;
  const Tensors original = LlamaTensors(/*mixtral=*/false, /*tied=*/true);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(/*tied=*/true), original);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  auto reader = CheckpointReader::Open(tmp.Join("ckpt"));
  EXPECT_FALSE(reader->Has("head.output_layer.weight"));
  ASSERT_TRUE(ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back")).ok());
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));
}

TEST(HfMixtralTest, RoundTripIsExactAndExpertsInterleaved) {
  ScopedTempDir tmp;
  const Tensors original = LlamaTensors(/*mixtral=*/true);
  WriteHfDir(tmp.Join("hf"), MixtralConfig(), original, /*shards=*/2);
  auto imported = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  const at::Tensor fc1 = Imported(tmp.Join("ckpt"), "layers.1.mlp.experts.2.linear_fc1.weight");
  const std::string x = "model.layers.1.block_sparse_moe.experts.2.";
  for (int64_t j = 0; j < kLF; ++j) {
    EXPECT_TRUE(at::equal(fc1[2 * j], original.at(x + "w1.weight")[j]));
    EXPECT_TRUE(at::equal(fc1[2 * j + 1], original.at(x + "w3.weight")[j]));
  }
  EXPECT_TRUE(at::equal(Imported(tmp.Join("ckpt"), "layers.1.mlp.router.weight"),
                        original.at("model.layers.1.block_sparse_moe.gate.weight")));
  auto reader = CheckpointReader::Open(tmp.Join("ckpt"));
  const nlohmann::json& ff = reader->manifest()["config"]["feed_forward"];
  EXPECT_EQ(ff["num_experts"], "3");
  EXPECT_EQ(ff["moe_layer_freq"], "1");
  EXPECT_EQ(ff["moe_router"], "mixtral");

  auto exported = ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back"));
  ASSERT_TRUE(exported.ok()) << exported.status();
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));
  const nlohmann::json config = nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/config.json")));
  EXPECT_EQ(config["num_local_experts"], kExperts);
  EXPECT_EQ(config["num_experts_per_tok"], 2);  // From the imported config.
  EXPECT_EQ(config["router_aux_loss_coef"], 0.02);
}

TEST(HfMixtralTest, FusedExpertsOfTransformersV5ImportAlike) {
  ScopedTempDir tmp;
  const Tensors legacy = LlamaTensors(/*mixtral=*/true);
  Tensors fused;
  for (const auto& [name, t] : legacy) {
    if (name.find("block_sparse_moe") == std::string::npos) fused[name] = t;
  }
  for (int i = 0; i < kLayers; ++i) {
    const std::string l = absl::StrCat("model.layers.", i, ".");
    std::vector<at::Tensor> gate_up, down;
    for (int e = 0; e < kExperts; ++e) {
      const std::string x = absl::StrCat(l, "block_sparse_moe.experts.", e, ".");
      gate_up.push_back(at::cat({legacy.at(x + "w1.weight"), legacy.at(x + "w3.weight")}, 0));
      down.push_back(legacy.at(x + "w2.weight"));
    }
    fused[l + "mlp.experts.gate_up_proj"] = at::stack(gate_up);
    fused[l + "mlp.experts.down_proj"] = at::stack(down);
    fused[l + "mlp.gate.weight"] = legacy.at(l + "block_sparse_moe.gate.weight");
  }
  WriteHfDir(tmp.Join("a"), MixtralConfig(), legacy);
  WriteHfDir(tmp.Join("b"), MixtralConfig(), fused);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("a"), tmp.Join("ca")).ok());
  auto imported = ImportHuggingFace(DefaultFileSystem(), tmp.Join("b"), tmp.Join("cb"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  auto a = CheckpointReader::Open(tmp.Join("ca"));
  auto b = CheckpointReader::Open(tmp.Join("cb"));
  ASSERT_EQ(a->names(), b->names());
  for (const std::string& name : a->names()) {
    EXPECT_TRUE(at::equal(*a->Read(name), *b->Read(name))) << name;
  }
}

TEST(HfExportTest, ShardsAboveMaxShardSizeWithAnIndexThatReimports) {
  ScopedTempDir tmp;
  const Tensors original = LlamaTensors(/*mixtral=*/false);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), original);
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).ok());
  HfExportOptions options;
  options.max_shard_bytes = 2000;
  auto exported = ExportHuggingFace(DefaultFileSystem(), tmp.Join("ckpt"), tmp.Join("back"), options);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_GT(exported->files.size(), 3u);
  EXPECT_TRUE(DefaultFileSystem()->FileExists(tmp.Join("back/model.safetensors.index.json")));
  EXPECT_FALSE(DefaultFileSystem()->FileExists(tmp.Join("back/model.safetensors")));
  EXPECT_TRUE(DefaultFileSystem()->FileExists(tmp.Join("back/model-00001-of-" +
                                         absl::StrFormat("%05d", exported->files.size() - 2) +
                                         ".safetensors")));
  ExpectSameTensors(original, ReadHfDir(tmp.Join("back")));
  const nlohmann::json index =
      nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/model.safetensors.index.json")));
  EXPECT_EQ(index["weight_map"].size(), original.size());
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("back"), tmp.Join("again")).ok());
}

// Writes the GPT-2 Hugging Face directory into tmp/hf and imports it into tmp/imported;
// returns the imported checkpoint's tensors and its config.model.
void ImportGpt2(const ScopedTempDir& tmp, std::vector<std::pair<std::string, at::Tensor>>* state,
                nlohmann::json* model) {
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), Gpt2Tensors());
  ASSERT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("imported")).ok());
  auto imported = CheckpointReader::Open(tmp.Join("imported"));
  ASSERT_TRUE(imported.ok()) << imported.status();
  for (const std::string& name : imported->names()) {
    state->emplace_back(name, *imported->Read(name));
  }
  *model = imported->manifest()["config"]["model"];
}

TEST(HfExportTest, TrainedGpt2StyleCheckpointExportsWithPlainGelu) {
  // A checkpoint as fulcrum_train writes it before the model gained RMSNorm/SwiGLU fields:
  // its config.model lacks them, and their defaults are the GPT-2 model.
  ScopedTempDir tmp;
  std::vector<std::pair<std::string, at::Tensor>> state;
  nlohmann::json model;
  ASSERT_NO_FATAL_FAILURE(ImportGpt2(tmp, &state, &model));
  state.emplace_back("optimizer.embedding.step", at::tensor(int64_t{5}));
  state.emplace_back("optimizer.embedding.word_embeddings.weight.exp_avg", at::zeros({kV, kH}));
  state.emplace_back("rng.torch_cpu", at::zeros({8}, at::kByte));
  for (const char* field : {"normalization", "swiglu", "num_query_groups", "add_bias_linear",
                            "openai_gelu"}) {
    model.erase(field);
  }
  auto writer = CheckpointWriter::Begin(DefaultFileSystem(), tmp.Join("trained"), 5);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->WriteShard("rank_00000", state).ok());
  ASSERT_TRUE(writer->Commit({{"config", {{"model", model}, {"feed_forward", nlohmann::json::object()}}}}).ok());
  auto exported = ExportHuggingFace(DefaultFileSystem(), tmp.Join("trained"), tmp.Join("back"));
  ASSERT_TRUE(exported.ok()) << exported.status();
  const nlohmann::json config = nlohmann::json::parse(*DefaultFileSystem()->ReadFile(tmp.Join("back/config.json")));
  EXPECT_EQ(config["activation_function"], "gelu");
  ExpectSameTensors(Gpt2Tensors(), ReadHfDir(tmp.Join("back")));  // Optimizer, rng skipped.
}

TEST(HfExportTest, ModelWithNoHfArchitectureIsRefusedNamingTheReason) {
  ScopedTempDir tmp;
  std::vector<std::pair<std::string, at::Tensor>> state;
  nlohmann::json model;
  ASSERT_NO_FATAL_FAILURE(ImportGpt2(tmp, &state, &model));
  model["position_embedding_type"] = "rope";  // LayerNorm + rope: neither GPT-2 nor Llama.
  auto writer = CheckpointWriter::Begin(DefaultFileSystem(), tmp.Join("odd"), 1);
  ASSERT_TRUE(writer->WriteShard("rank_00000", state).ok());
  ASSERT_TRUE(writer->Commit({{"config", {{"model", model}}}}).ok());
  ExpectRefusedAndNothingWritten(
      ExportHuggingFace(DefaultFileSystem(), tmp.Join("odd"), tmp.Join("back")).status(),
      "position_embedding_type=rope", tmp, tmp.Join("back"));
}

// ----- Refused imports: each names the field or file, and writes nothing.

struct BadConfigCase {
  const char* name;
  bool llama;
  const char* field;
  nlohmann::json value;
  const char* mentions;
};

class HfBadConfigTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(HfBadConfigTest, RefusedNamingTheField) {
  const BadConfigCase& c = GetParam();
  ScopedTempDir tmp;
  nlohmann::json config = c.llama ? LlamaConfig() : Gpt2Config();
  config[c.field] = c.value;
  WriteHfDir(tmp.Join("hf"), config, c.llama ? LlamaTensors(false) : Gpt2Tensors());
  const absl::Status status = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  ExpectRefusedAndNothingWritten(status, c.mentions, tmp, tmp.Join("ckpt"));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, HfBadConfigTest,
    ::testing::Values(
        BadConfigCase{"UnknownArchitecture", true, "architectures", {"BertForMaskedLM"},
                      "architectures=[\"BertForMaskedLM\"] is not supported"},
        BadConfigCase{"UnknownModelType", true, "model_type", "bert",
                      "model_type='bert' does not match"},
        BadConfigCase{"SlidingWindow", true, "sliding_window", 4096, "sliding_window=4096"},
        BadConfigCase{"RopeScaling", true, "rope_scaling",
                      {{"type", "linear"}, {"factor", 2.0}}, "rope_scaling="},
        BadConfigCase{"RopeType", true, "rope_parameters",
                      {{"rope_type", "yarn"}, {"rope_theta", 1e4}}, "rope_parameters.rope_type"},
        BadConfigCase{"AttentionBias", true, "attention_bias", true, "attention_bias=true"},
        BadConfigCase{"MlpBias", true, "mlp_bias", true, "mlp_bias=true"},
        BadConfigCase{"HeadDim", true, "head_dim", 8, "head_dim=8"},
        BadConfigCase{"HiddenAct", true, "hidden_act", "gelu", "hidden_act='gelu'"},
        BadConfigCase{"KvHeads", true, "num_key_value_heads", 3, "num_key_value_heads=3"},
        BadConfigCase{"Gpt2Activation", false, "activation_function", "relu",
                      "activation_function='relu'"},
        BadConfigCase{"Gpt2Untied", false, "tie_word_embeddings", false,
                      "tie_word_embeddings=false"},
        BadConfigCase{"Gpt2LayerIdxScaling", false, "scale_attn_by_inverse_layer_idx", true,
                      "scale_attn_by_inverse_layer_idx=true"},
        BadConfigCase{"MissingField", false, "n_embd", nullptr, "n_embd is missing"}),
    [](const ::testing::TestParamInfo<BadConfigCase>& info) { return info.param.name; });

TEST(HfBadInputTest, MixtralRouterJitterAndTooManyExpertsPerToken) {
  ScopedTempDir tmp;
  nlohmann::json jitter = MixtralConfig();
  jitter["router_jitter_noise"] = 0.01;
  WriteHfDir(tmp.Join("a"), jitter, LlamaTensors(/*mixtral=*/true));
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("a"), tmp.Join("ca")).status(),
                                 "router_jitter_noise=0.01", tmp, tmp.Join("ca"));
  nlohmann::json topk = MixtralConfig();
  topk["num_experts_per_tok"] = kExperts + 1;
  WriteHfDir(tmp.Join("b"), topk, LlamaTensors(/*mixtral=*/true));
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("b"), tmp.Join("cb")).status(),
                                 "num_experts_per_tok=4", tmp, tmp.Join("cb"));
}

TEST(HfBadInputTest, MissingShardFile) {
  ScopedTempDir tmp;
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), LlamaTensors(false), /*shards=*/2);
  ASSERT_TRUE(DefaultFileSystem()->DeleteRecursively(tmp.Join("hf/model-00002-of-00002.safetensors")).ok());
  const absl::Status status = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  ExpectRefusedAndNothingWritten(status, "model-00002-of-00002.safetensors", tmp, tmp.Join("ckpt"));
}

TEST(HfBadInputTest, TensorShapeDisagreesWithConfig) {
  ScopedTempDir tmp;
  Tensors t = LlamaTensors(false);
  t["model.layers.1.mlp.up_proj.weight"] = Distinct({kLF + 1, kLH}, 99);
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), t);
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).status(),
                                 "model.layers.1.mlp.up_proj.weight", tmp, tmp.Join("ckpt"));
  const absl::Status status = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("ckpt")).status();
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("[13, 16]"), HasSubstr("[12, 16]")));
}

TEST(HfBadInputTest, MissingAndUnexpectedTensors) {
  ScopedTempDir tmp;
  Tensors missing = LlamaTensors(false);
  missing.erase("model.layers.0.self_attn.k_proj.weight");
  WriteHfDir(tmp.Join("a"), LlamaConfig(), missing);
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("a"), tmp.Join("ca")).status(),
                                 "model.layers.0.self_attn.k_proj.weight", tmp, tmp.Join("ca"));
  Tensors extra = LlamaTensors(false);
  extra["model.layers.2.input_layernorm.weight"] = Distinct({kLH}, 77);  // A third layer.
  WriteHfDir(tmp.Join("b"), LlamaConfig(), extra);
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("b"), tmp.Join("cb")).status(),
                                 "model.layers.2.input_layernorm.weight", tmp, tmp.Join("cb"));
}

TEST(HfBadInputTest, NoWeightsOrNoConfig) {
  ScopedTempDir tmp;
  ASSERT_TRUE(DefaultFileSystem()->CreateDir(tmp.Join("hf")).ok());
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("c")).status(),
                                 "config.json", tmp, tmp.Join("c"));
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), tmp.Join("hf/config.json"), LlamaConfig().dump()).ok());
  ExpectRefusedAndNothingWritten(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("c")).status(),
                                 "neither model.safetensors", tmp, tmp.Join("c"));
}

TEST(HfBadInputTest, OutputDirectoryMustBeNewOrEmpty) {
  ScopedTempDir tmp;
  WriteHfDir(tmp.Join("hf"), Gpt2Config(), Gpt2Tensors());
  ASSERT_TRUE(DefaultFileSystem()->CreateDir(tmp.Join("out")).ok());
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), tmp.Join("out/keep.txt"), "mine").ok());
  const absl::Status status = ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("out")).status();
  EXPECT_THAT(std::string(status.message()), HasSubstr("is not empty"));
  EXPECT_EQ(*DefaultFileSystem()->ListDir(tmp.Join("out")), std::vector<std::string>{"keep.txt"});
  // An empty directory is fine.
  ASSERT_TRUE(DefaultFileSystem()->CreateDir(tmp.Join("empty")).ok());
  EXPECT_TRUE(ImportHuggingFace(DefaultFileSystem(), tmp.Join("hf"), tmp.Join("empty")).ok());
}

// ----- The command line: what tests/hf/ (transformers' side) relies on.

struct ToolResult {
  int exit_code = -1;
  std::string output;
};

ToolResult RunHfTool(const std::string& args) {
  ToolResult r;
  r.exit_code = fulcrum::testing::RunCommand(
      std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt " + args + " 2>&1", &r.output);
  return r;
}

TEST(HfToolTest, ImportExportExitCodes) {
  ASSERT_TRUE(DefaultFileSystem()->FileExists(std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt"));
  ScopedTempDir tmp;
  WriteHfDir(tmp.Join("hf"), LlamaConfig(), LlamaTensors(false));
  ToolResult r = RunHfTool("import-hf " + tmp.Join("hf") + " " + tmp.Join("ckpt"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("imported LlamaForCausalLM"), HasSubstr("--finetune"),
                              HasSubstr("--num_query_groups=2")));
  r = RunHfTool("export-hf " + tmp.Join("ckpt") + " " + tmp.Join("back") + " --max_shard_size=1KB");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(DefaultFileSystem()->FileExists(tmp.Join("back/model.safetensors.index.json")));

  nlohmann::json bad = LlamaConfig();
  bad["rope_scaling"] = {{"type", "dynamic"}, {"factor", 4.0}};
  WriteHfDir(tmp.Join("bad"), bad, LlamaTensors(false));
  r = RunHfTool("import-hf " + tmp.Join("bad") + " " + tmp.Join("ckpt2"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rope_scaling"));
  EXPECT_FALSE(DefaultFileSystem()->FileExists(tmp.Join("ckpt2")));
  r = RunHfTool("export-hf " + tmp.Join("ckpt") + " " + tmp.Join("back2") + " --max_shard_size=lots");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--max_shard_size='lots'"));
  r = RunHfTool("import-hf " + tmp.Join("hf"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

}  // namespace
}  // namespace fulcrum::ckpt
