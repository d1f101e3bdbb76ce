// --finetune (TrainOptions::finetune, NOTE [finetune]): the weights of a checkpoint, imported
// from Hugging Face or trained here, load into a fresh run at iteration 0; an import without
// --finetune, another model shape and data outside the model's vocabulary are refused.
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "core/trainer.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing::SmallTrainerConfig;
using testing::SyntheticCorpus;

std::map<std::string, at::Tensor> Weights(Trainer& trainer) {
  std::map<std::string, at::Tensor> out;
  for (Unit* unit : trainer.model().Units()) {
    for (const Parameter& p : unit->parameters()) {
      out[unit->GlobalName(p.name)] = p.value.detach().clone();
    }
  }
  return out;
}

// Trains a run of `config` (train.save set) for `iterations` iterations on the synthetic
// corpus and saves it; its weights into `weights` when given.
void TrainAndSave(const TrainerConfig& config, int iterations,
                  std::map<std::string, at::Tensor>* weights = nullptr) {
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  for (int i = 0; i < iterations; ++i) ASSERT_TRUE((*trainer)->TrainIteration().ok());
  ASSERT_TRUE((*trainer)->Save().ok());
  if (weights != nullptr) *weights = Weights(**trainer);
}

// A model trained for 3 iterations, saved under `dir`/trained, exported to Hugging Face
// (`dir`/hf: GPT2LMHeadModel, the architecture of today's default model) and imported back
// (`dir`/imported). Returns the trained weights.
std::map<std::string, at::Tensor> TrainExportImport(const std::string& dir) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = JoinPath(dir, "trained");
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE((*trainer)->TrainIteration().ok());
  EXPECT_TRUE((*trainer)->Save().ok());
  auto exported = ckpt::ExportHuggingFace(DefaultFileSystem(), config.train.save,
                                          JoinPath(dir, "hf"));
  EXPECT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->model.architecture, ckpt::HfArchitecture::kGpt2);
  auto imported = ckpt::ImportHuggingFace(DefaultFileSystem(), JoinPath(dir, "hf"),
                                          JoinPath(dir, "imported"));
  EXPECT_TRUE(imported.ok()) << imported.status();
  return Weights(**trainer);
}

TEST(FinetuneTest, ImportedWeightsLoadAtIterationZeroWithAFreshOptimizer) {
  const std::string dir = testing::MakeTempDir("finetune_import");
  const auto trained = TrainExportImport(dir);

  TrainerConfig config = SmallTrainerConfig();
  config.data.seed = 99;  // Other data order: no data checks under --finetune.
  config.train.load = JoinPath(dir, "imported");
  config.train.finetune = true;
  auto trainer = Trainer::Create(config, SyntheticCorpus(30, 100, config.model.vocab_size, 7));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const auto before = Weights(**trainer);
  ASSERT_FALSE(at::equal(before.at("layers.0.self_attention.linear_qkv.weight"),
                         trained.at("layers.0.self_attention.linear_qkv.weight")));
  absl::Status loaded = (*trainer)->Load(config.train.load);
  ASSERT_TRUE(loaded.ok()) << loaded;

  // The load happened: every weight is the trained model's, through export and import.
  const auto after = Weights(**trainer);
  ASSERT_EQ(after.size(), trained.size());
  for (const auto& [name, value] : trained) {
    EXPECT_TRUE(at::equal(after.at(name), value)) << name;
  }
  EXPECT_EQ((*trainer)->iteration(), 0);
  EXPECT_EQ((*trainer)->consumed_samples(), 0);
  for (Unit* unit : (*trainer)->model().Units()) EXPECT_EQ(unit->optimizer_step(), 0);
  auto stats = (*trainer)->TrainIteration();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->iteration, 1);
  // The schedule starts afresh: the first step's learning rate is a new run's.
  auto fresh = Trainer::Create(config, SyntheticCorpus(30, 100, config.model.vocab_size, 7));
  ASSERT_TRUE(fresh.ok());
  auto fresh_stats = (*fresh)->TrainIteration();
  ASSERT_TRUE(fresh_stats.ok());
  EXPECT_DOUBLE_EQ(stats->lr, fresh_stats->lr);
}

TEST(FinetuneTest, ImportedCheckpointWithoutFinetuneSaysToAddIt) {
  const std::string dir = testing::MakeTempDir("finetune_missing");
  TrainExportImport(dir);
  TrainerConfig config = SmallTrainerConfig();
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(trainer.ok());
  const absl::Status status = (*trainer)->Load(JoinPath(dir, "imported"));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("add --finetune"), std::string::npos) << status;
  EXPECT_NE(status.message().find("GPT2LMHeadModel"), std::string::npos) << status;
}

TEST(FinetuneTest, ShapeMismatchIsRefusedNamingTheFlag) {
  const std::string dir = testing::MakeTempDir("finetune_shape");
  TrainExportImport(dir);
  TrainerConfig config = SmallTrainerConfig();
  config.model.ffn_hidden_size = 32;
  config.train.load = JoinPath(dir, "imported");
  config.train.finetune = true;
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(trainer.ok());
  const absl::Status status = (*trainer)->Load(config.train.load);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("(--ffn_hidden_size)"), std::string::npos) << status;
  EXPECT_NE(status.message().find("--finetune"), std::string::npos) << status;
}

// A LlamaForCausalLM of SmallModel's sizes (one layer, 2 key/value heads, tied) written
// into `dir`/hf and imported into `dir`/imported.
void ImportSmallLlama(const std::string& dir) {
  const std::string hf = JoinPath(dir, "hf");
  ASSERT_TRUE(DefaultFileSystem()->CreateDir(hf).ok());
  const ModelOptions m = SmallTrainerConfig().model;
  const int64_t h = m.hidden_size, f = m.ffn_hidden_size, v = m.vocab_size;
  const int64_t kv = 2 * m.head_dim();
  const nlohmann::json llama = {
      {"architectures", {"LlamaForCausalLM"}}, {"hidden_size", h},
      {"num_hidden_layers", 1}, {"num_attention_heads", m.num_attention_heads},
      {"num_key_value_heads", 2}, {"intermediate_size", f}, {"vocab_size", v},
      {"max_position_embeddings", 16}, {"rms_norm_eps", 1e-5}, {"tie_word_embeddings", true}};
  ASSERT_TRUE(WriteStringToFile(DefaultFileSystem(), JoinPath(hf, "config.json"), llama.dump()).ok());
  torch::manual_seed(3);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"model.embed_tokens.weight", torch::randn({v, h})},
      {"model.layers.0.input_layernorm.weight", torch::rand({h}) + 0.5},
      {"model.layers.0.self_attn.q_proj.weight", torch::randn({h, h}) * 0.1},
      {"model.layers.0.self_attn.k_proj.weight", torch::randn({kv, h}) * 0.1},
      {"model.layers.0.self_attn.v_proj.weight", torch::randn({kv, h}) * 0.1},
      {"model.layers.0.self_attn.o_proj.weight", torch::randn({h, h}) * 0.1},
      {"model.layers.0.post_attention_layernorm.weight", torch::rand({h}) + 0.5},
      {"model.layers.0.mlp.gate_proj.weight", torch::randn({f, h}) * 0.1},
      {"model.layers.0.mlp.up_proj.weight", torch::randn({f, h}) * 0.1},
      {"model.layers.0.mlp.down_proj.weight", torch::randn({h, f}) * 0.1},
      {"model.norm.weight", torch::rand({h}) + 0.5}};
  ASSERT_TRUE(ckpt::WriteSafetensors(DefaultFileSystem(), JoinPath(hf, "model.safetensors"),
                                     tensors, {})
                  .ok());
  auto imported = ckpt::ImportHuggingFace(DefaultFileSystem(), hf, JoinPath(dir, "imported"));
  ASSERT_TRUE(imported.ok()) << imported.status();
}

TEST(FinetuneTest, ImportedLlamaLoadsIntoTheLlamaModel) {
  const std::string dir = testing::MakeTempDir("finetune_llama_ok");
  ImportSmallLlama(dir);
  TrainerConfig config = SmallTrainerConfig();
  config.model.num_layers = 1;
  config.model.position_embedding = PositionEmbedding::kRotary;
  config.model.normalization = Normalization::kRMSNorm;
  config.model.swiglu = true;
  config.model.num_query_groups = 2;
  config.model.add_bias_linear = false;
  config.train.load = JoinPath(dir, "imported");
  config.train.finetune = true;
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  absl::Status loaded = (*trainer)->Load(config.train.load);
  ASSERT_TRUE(loaded.ok()) << loaded;
  // Every parameter of the model is the imported tensor of its name.
  auto reader = ckpt::CheckpointReader::Open(config.train.load);
  ASSERT_TRUE(reader.ok());
  const auto weights = Weights(**trainer);
  EXPECT_EQ(weights.size(), reader->names().size());
  for (const auto& [name, value] : weights) {
    auto stored = reader->Read(name);
    ASSERT_TRUE(stored.ok()) << name << ": " << stored.status();
    EXPECT_TRUE(at::equal(value, *stored)) << name;
  }
  auto stats = (*trainer)->TrainIteration();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(std::isfinite(stats->loss));
}

TEST(FinetuneTest, ArchitectureMismatchIsRefusedNamingTheFlag) {
  // The imported Llama into today's default (LayerNorm, GeLU) model of the same sizes.
  const std::string dir = testing::MakeTempDir("finetune_llama");
  ImportSmallLlama(dir);
  TrainerConfig config = SmallTrainerConfig();
  config.model.num_layers = 1;
  config.model.position_embedding = PositionEmbedding::kRotary;
  config.train.load = JoinPath(dir, "imported");
  config.train.finetune = true;
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(trainer.ok());
  const absl::Status status = (*trainer)->Load(config.train.load);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("normalization=RMSNorm"), std::string::npos) << status;
  EXPECT_NE(status.message().find("(--normalization)"), std::string::npos) << status;
}

TEST(FinetuneTest, TrainedCheckpointLoadsWeightsOnlyOnOtherData) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = testing::MakeTempDir("finetune_trained");
  std::map<std::string, at::Tensor> trained;
  ASSERT_NO_FATAL_FAILURE(TrainAndSave(config, 4, &trained));

  TrainerConfig tuned = config;
  tuned.train.save.clear();
  tuned.train.load = config.train.save;
  tuned.train.finetune = true;
  tuned.train.train_iters = 2;  // Below the checkpoint's iteration: fine, it starts at 0.
  tuned.data.split = "80,20,0";
  auto other = Trainer::Create(tuned, SyntheticCorpus(25, 150, config.model.vocab_size, 3));
  ASSERT_TRUE(other.ok());
  absl::Status loaded = (*other)->Load(tuned.train.load);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ((*other)->iteration(), 0);
  const auto after = Weights(**other);
  for (const auto& [name, value] : trained) EXPECT_TRUE(at::equal(after.at(name), value)) << name;
  for (Unit* unit : (*other)->model().Units()) EXPECT_EQ(unit->optimizer_step(), 0);
  ASSERT_TRUE((*other)->Run().ok());
  EXPECT_EQ((*other)->iteration(), 2);
}

TEST(FinetuneTest, RotaryModelsFinetuneAtAnotherSequenceLength) {
  // Rotary positions have no parameters, so seq_length is no shape; learned ones are.
  TrainerConfig config = SmallTrainerConfig();
  config.model.position_embedding = PositionEmbedding::kRotary;
  config.train.save = testing::MakeTempDir("finetune_rope");
  ASSERT_NO_FATAL_FAILURE(TrainAndSave(config, 0));
  TrainerConfig longer = config;
  longer.model.seq_length = longer.data.seq_length = 2 * config.model.seq_length;
  longer.train.load = config.train.save;
  longer.train.finetune = true;
  auto other = Trainer::Create(longer, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(other.ok());
  absl::Status status = (*other)->Load(longer.train.load);
  EXPECT_TRUE(status.ok()) << status;

  TrainerConfig learned = SmallTrainerConfig();
  learned.train.save = testing::MakeTempDir("finetune_learned");
  ASSERT_NO_FATAL_FAILURE(TrainAndSave(learned, 0));
  learned.model.seq_length = learned.data.seq_length = 2 * learned.model.seq_length;
  learned.train.load = learned.train.save;
  learned.train.finetune = true;
  auto refused = Trainer::Create(learned, SyntheticCorpus(40, 200, learned.model.vocab_size));
  ASSERT_TRUE(refused.ok());
  status = (*refused)->Load(learned.train.load);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("learned position table has 16 rows but this run's has 32"),
            std::string::npos)
      << status;
  EXPECT_NE(status.message().find("(--max_position_embeddings"), std::string::npos) << status;
}

// NOTE [finetune]: a learned table of 16 rows (a checkpoint trained at 16 tokens) fine-tunes
// at 8 tokens with --max_position_embeddings=16: the whole table loads, the run trains rows
// 0-7 and leaves rows 8-15 as they were (no weight decay here); without the flag this run's
// table would have 8 rows, and the load is refused saying which value keeps it.
TEST(FinetuneTest, LearnedPositionsFinetuneAtAShorterSequenceOnTheWholeTable) {
  TrainerConfig config = SmallTrainerConfig();  // seq_length 16
  config.train.save = testing::MakeTempDir("finetune_shorter");
  std::map<std::string, at::Tensor> trained;
  ASSERT_NO_FATAL_FAILURE(TrainAndSave(config, 3, &trained));

  TrainerConfig shorter = config;
  shorter.train.save.clear();
  shorter.train.load = config.train.save;
  shorter.train.finetune = true;
  shorter.model.seq_length = shorter.data.seq_length = 8;
  shorter.optimizer.weight_decay = 0;
  {
    auto refused = Trainer::Create(shorter, SyntheticCorpus(40, 200, config.model.vocab_size));
    ASSERT_TRUE(refused.ok()) << refused.status();
    const absl::Status status = (*refused)->Load(shorter.train.load);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("--max_position_embeddings=16"), std::string::npos) << status;
  }
  shorter.model.max_position_embeddings = 16;
  auto tuned = Trainer::Create(shorter, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_TRUE(tuned.ok()) << tuned.status();
  const absl::Status loaded = (*tuned)->Load(shorter.train.load);
  ASSERT_TRUE(loaded.ok()) << loaded;
  const auto after = Weights(**tuned);
  ASSERT_EQ(after.size(), trained.size());
  for (const auto& [name, value] : trained) EXPECT_TRUE(at::equal(after.at(name), value)) << name;

  ASSERT_TRUE((*tuned)->TrainIteration().ok());
  const at::Tensor table = Weights(**tuned).at("embedding.position_embeddings.weight");
  const at::Tensor before = trained.at("embedding.position_embeddings.weight");
  ASSERT_EQ(table.size(0), 16);
  for (int64_t row = 0; row < 16; ++row) {
    EXPECT_EQ(at::equal(table[row], before[row]), row >= 8)
        << "row " << row << (row < 8 ? " did not train" : " changed past the sequence");
  }
}

// What a model at 8 tokens on a 16-row table computes is what the 16-token model computes
// at its first 8 positions (causal attention: they see nothing later), to the last bits in
// fp64 — and only rows 0-7 of the table are read.
TEST(FinetuneTest, AShorterSequenceComputesTheFirstPositionsOfTheLongerOne) {
  ModelOptions whole = testing::SmallModel();  // seq_length 16: a 16-row table
  ASSERT_TRUE(ParseParamsDtype("fp64", &whole.device_spec).ok());
  ModelOptions shorter = whole;
  shorter.seq_length = 8;
  shorter.max_position_embeddings = 16;
  ASSERT_TRUE(shorter.Validate().ok());
  GptModel longer_model(whole), shorter_model(shorter);
  at::manual_seed(3);
  const at::Tensor tokens = at::randint(whole.vocab_size, {3, 17}, at::TensorOptions().dtype(at::kLong));
  const ForwardContext ctx{false, 1, 0};
  const at::Tensor hidden =
      longer_model.ForwardLayers(longer_model.Embed(tokens.narrow(1, 0, 16), ctx), ctx);
  const LossSum reference = longer_model.HeadLoss(hidden.narrow(0, 0, 8), tokens.narrow(1, 1, 8));
  const LossSum loss = shorter_model.ForwardLoss(tokens.narrow(1, 0, 9), ctx);
  ASSERT_EQ(loss.tokens, 24);
  ASSERT_EQ(reference.tokens, 24);
  const double expected = reference.sum.item<double>();
  EXPECT_NEAR(loss.sum.item<double>(), expected, 1e-12 * std::abs(expected));
  // Rows past the sequence are never read; row 7 is.
  const Parameter* table = shorter_model.embedding()->FindParameter("position_embeddings.weight");
  ASSERT_NE(table, nullptr);
  ASSERT_EQ(table->value.size(0), 16);
  {
    at::NoGradGuard no_grad;
    // Not a constant: LayerNorm removes a constant shift of a row exactly.
    table->value.narrow(0, 8, 8).add_(at::randn({8, whole.hidden_size}, table->value.options()));
  }
  EXPECT_EQ(shorter_model.ForwardLoss(tokens.narrow(1, 0, 9), ctx).sum.item<double>(),
            loss.sum.item<double>());
  {
    at::NoGradGuard no_grad;
    table->value[7].add_(at::randn({whole.hidden_size}, table->value.options()));
  }
  EXPECT_GT(std::abs(shorter_model.ForwardLoss(tokens.narrow(1, 0, 9), ctx).sum.item<double>() -
                     loss.sum.item<double>()),
            1e-6);
}

TEST(FinetuneTest, MaxPositionEmbeddingsMistakesAreRefusedNamingTheFlag) {
  ModelOptions m = testing::SmallModel();  // seq_length 16, learned positions
  m.max_position_embeddings = 8;
  absl::Status status = m.Validate();
  EXPECT_NE(status.message().find("--seq_length=16 exceeds --max_position_embeddings=8"),
            std::string::npos)
      << status;
  m.max_position_embeddings = -1;
  status = m.Validate();
  EXPECT_NE(status.message().find("--max_position_embeddings=-1 must be ≥ 0"), std::string::npos)
      << status;
  m.max_position_embeddings = 32;
  EXPECT_TRUE(m.Validate().ok());
  m.position_embedding = PositionEmbedding::kRotary;
  status = m.Validate();
  EXPECT_NE(status.message().find("rotary positions have none"), std::string::npos) << status;
}

TEST(FinetuneTest, DataOutsideTheCheckpointsVocabularyIsRefused) {
  TrainerConfig config = SmallTrainerConfig();  // vocab 64
  config.train.save = testing::MakeTempDir("finetune_vocab");
  ASSERT_NO_FATAL_FAILURE(TrainAndSave(config, 0));
  for (const bool finetune : {false, true}) {
    TrainerConfig wider = config;
    wider.model.vocab_size = 128;  // The run's own model fits the data...
    wider.train.finetune = finetune;
    wider.train.load = config.train.save;
    auto other = Trainer::Create(wider, SyntheticCorpus(40, 200, /*vocab=*/100));
    ASSERT_TRUE(other.ok()) << other.status();
    // ...the checkpoint's does not.
    const absl::Status status = (*other)->Load(config.train.save);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << finetune;
    EXPECT_NE(status.message().find("token id 99"), std::string::npos) << status;
    EXPECT_NE(status.message().find("vocabulary of 64"), std::string::npos) << status;
  }
}

TEST(FinetuneTest, FinetuneNeedsLoad) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.finetune = true;
  const absl::Status status = config.Validate();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("--finetune needs --load"), std::string::npos) << status;
}

}  // namespace
}  // namespace fulcrum
