// The trainer's manifest fields (core/training_manifest.h): written and read back; every
// field checked for type, range and consistency with one clear error; a resume checked
// against the run (NOTE [resume checks]).
#include "core/training_manifest.h"

#include "core/trainer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

TrainingManifest Example() {
  TrainingManifest m;
  m.iteration = 20;
  m.consumed_samples = 320;
  m.lr = 1e-3;
  m.data_seed = 1234;
  m.split = "969,30,1";
  m.seq_length = 64;
  m.samples_per_epoch = 100;
  m.data = {"/data/corpus_text_document", 40, 8000};
  TrainerConfig config = testing::SmallTrainerConfig();
  config.model.seq_length = 64;
  m.config = ConfigToJson(config);
  m.pp = 2;
  m.layer_placement = {{0, 1}, {1, config.model.num_layers}};
  return m;
}

TEST(TrainingManifestTest, RoundTrips) {
  const TrainingManifest m = Example();
  auto parsed = ParseTrainingManifest(TrainingManifestToJson(m), "m.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->iteration, 20);
  EXPECT_EQ(parsed->consumed_samples, 320);
  EXPECT_EQ(parsed->data_seed, 1234u);
  EXPECT_EQ(parsed->data.path, "/data/corpus_text_document");
  EXPECT_EQ(parsed->data.documents, 40);
  EXPECT_EQ(parsed->pp, 2);
  EXPECT_EQ(parsed->layer_placement, m.layer_placement);
}

struct BadField {
  std::string pointer;
  nlohmann::json value;  // null: remove the field.
  std::string expected;
};

TEST(TrainingManifestTest, EveryBadFieldIsOneClearError) {
  const std::vector<BadField> cases = {
      {"/iteration", -7, "field '/iteration' must be in [0, "},
      {"/iteration", "20", "field '/iteration' must be an integer, found \"20\""},
      {"/iteration", 20.5, "field '/iteration' must be an integer"},
      {"/consumed_samples", -1, "field '/consumed_samples' must be in [0, "},
      {"/consumed_samples", 5, "fewer than one sample per iteration"},
      {"/sampler/consumed_samples", 321, "(321) differs from '/consumed_samples' (320)"},
      {"/optimizer_step", 19, "must equal the iteration (20)"},
      {"/lr_schedule/step", 21, "must equal the iteration (20)"},
      {"/lr_schedule/lr", -1.0, "field '/lr_schedule/lr' must be a finite number"},
      {"/lr_schedule/lr", nullptr, "field '/lr_schedule/lr' is missing"},
      {"/sampler/seed", -3, "field '/sampler/seed' must be a non-negative integer"},
      {"/sampler/split", 969, "field '/sampler/split' must be a string"},
      {"/sampler/seq_length", 32, "differs from the model's (64)"},
      {"/config/model", "x", "field '/config/model' must be an object"},
      {"/layer_placement/1/layer_begin", 2, "stages must hold contiguous, non-empty ranges"},
      {"/layer_placement/1/layer_end", 99, "field '/layer_placement/1/layer_end' must be in [0, "},
      {"/parallel/tp", 0, "field '/parallel/tp' must be in [1, "},
  };
  for (const BadField& c : cases) {
    nlohmann::json j = TrainingManifestToJson(Example());
    const nlohmann::json::json_pointer pointer(c.pointer);
    if (c.value.is_null()) {
      j[pointer.parent_pointer()].erase(pointer.back());
    } else {
      j[pointer] = c.value;
    }
    auto parsed = ParseTrainingManifest(j, "/ckpt/iter_0000020/manifest.json");
    ASSERT_FALSE(parsed.ok()) << c.pointer << " = " << c.value.dump();
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << c.pointer;
    EXPECT_THAT(std::string(parsed.status().message()),
                ::testing::AllOf(HasSubstr("/ckpt/iter_0000020/manifest.json"), HasSubstr(c.expected)))
        << c.pointer << " = " << c.value.dump();
  }
  EXPECT_EQ(ParseTrainingManifest(nlohmann::json::array(), "m").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TrainingManifestTest, ResumeChecks) {
  const TrainingManifest saved = Example();
  TrainerConfig ours = testing::SmallTrainerConfig();
  ours.model.seq_length = 64;
  ours.data.seq_length = 64;
  ours.data.seed = 1234;
  ours.data.split = "969,30,1";
  ours.train.train_iters = 100;
  const DataIdentity same = saved.data;
  std::vector<std::string> warnings;
  EXPECT_TRUE(CheckResume(saved, ours, same, "m", &warnings).ok());
  EXPECT_TRUE(warnings.empty());

  auto refused = [&](const TrainerConfig& config, const DataIdentity& data) {
    std::vector<std::string> w;
    const absl::Status s = CheckResume(saved, config, data, "m", &w);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  TrainerConfig shorter = ours;
  shorter.train.train_iters = 19;
  EXPECT_THAT(refused(shorter, same),
              HasSubstr("--train_iters=19 is below the checkpoint's iteration 20"));
  TrainerConfig wider = ours;
  wider.model.hidden_size *= 2;
  EXPECT_THAT(refused(wider, same), HasSubstr("hidden_size"));
  TrainerConfig moe = ours;
  moe.feed_forward_shape = {{"num_experts", "8"}, {"moe_ffn_hidden_size", "64"}};
  EXPECT_THAT(refused(moe, same),
              HasSubstr("checkpoint has --num_experts=0 but this run has --num_experts=8"));
  TrainerConfig split = ours;
  split.data.split = "90,10,0";
  EXPECT_THAT(refused(split, same), HasSubstr("--split '969,30,1' → '90,10,0'"));
  DataIdentity bigger = same;
  bigger.tokens += 1;
  EXPECT_THAT(refused(ours, bigger), HasSubstr("(--data_path)"));

  // Allowed on purpose: a warning instead.
  split.train.allow_data_change = true;
  warnings.clear();
  EXPECT_TRUE(CheckResume(saved, split, same, "m", &warnings).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("--allow_data_change"));
  // The same data under another path: taken as the same data, with a warning.
  DataIdentity moved = same;
  moved.path = "/elsewhere/corpus_text_document";
  warnings.clear();
  EXPECT_TRUE(CheckResume(saved, ours, moved, "m", &warnings).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("/elsewhere/corpus_text_document"));
}

}  // namespace
}  // namespace fulcrum
