// The training loop: loss falls, gradient accumulation is exact in exact arithmetic,
// resume is bit-identical, and a failed save leaves the previous checkpoint in charge.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/checkpoint/checkpoint.h"
#include "core/file_system.h"
#include "core/trainer.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing::SmallTrainerConfig;
using testing::SyntheticCorpus;

std::vector<double> TrainLosses(const TrainerConfig& config,
                                std::shared_ptr<const data::IndexedDataset> corpus,
                                int64_t iterations, Trainer* resume_into = nullptr) {
  auto trainer = Trainer::Create(config, corpus);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  std::vector<double> losses;
  for (int64_t i = 0; i < iterations; ++i) {
    auto stats = (*trainer)->TrainIteration();
    EXPECT_TRUE(stats.ok()) << stats.status();
    losses.push_back(stats->loss);
  }
  return losses;
}

TEST(TrainerTest, LossFallsOnLearnableData) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.train_iters = 60;
  config.optimizer.lr = config.schedule.lr = 1e-2;
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  std::vector<double> losses = TrainLosses(config, corpus, 60);
  EXPECT_NEAR(losses.front(), std::log(64.0), 0.2);
  EXPECT_LT(losses.back(), 0.6 * losses.front());
}

// Micro-batch 2 × 2 accumulated and micro-batch 4 compute the same mean-loss gradient;
// only float summation order differs.
TEST(TrainerTest, GradientAccumulationMatchesOneLargeMicroBatch) {
  TrainerConfig config = SmallTrainerConfig();
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  std::vector<double> accumulated = TrainLosses(config, corpus, 5);
  config.train.micro_batch_size = 4;
  std::vector<double> single = TrainLosses(config, corpus, 5);
  for (size_t i = 0; i < single.size(); ++i) EXPECT_NEAR(accumulated[i], single[i], 1e-5) << i;
}

// 2N iterations straight vs N, save, fresh process state, load, N: bit-identical losses
// and weights — with dropout on, so the dropout keys are exercised too.
TEST(TrainerTest, ResumeIsBitIdentical) {
  TrainerConfig config = SmallTrainerConfig();
  config.model.hidden_dropout = 0.1;
  config.model.attention_dropout = 0.1;
  config.train.save = testing::MakeTempDir("resume");
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);

  auto straight = Trainer::Create(config, corpus);
  ASSERT_TRUE(straight.ok()) << straight.status();
  std::vector<double> straight_losses;
  for (int i = 0; i < 8; ++i) {
    auto stats = (*straight)->TrainIteration();
    ASSERT_TRUE(stats.ok());
    straight_losses.push_back(stats->loss);
    if (i == 3) {
      absl::Status saved = (*straight)->Save();
      ASSERT_TRUE(saved.ok()) << saved;
    }
  }

  auto resumed = Trainer::Create(config, corpus);
  ASSERT_TRUE(resumed.ok());
  absl::Status loaded = (*resumed)->Load(config.train.save);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ((*resumed)->iteration(), 4);
  EXPECT_EQ((*resumed)->consumed_samples(), 16);
  for (int i = 4; i < 8; ++i) {
    auto stats = (*resumed)->TrainIteration();
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->loss, straight_losses[i]) << "iteration " << i + 1;
  }
  auto a = (*straight)->model().Units();
  auto b = (*resumed)->model().Units();
  for (size_t u = 0; u < a.size(); ++u) {
    for (size_t p = 0; p < a[u]->parameters().size(); ++p) {
      EXPECT_TRUE(at::equal(a[u]->parameters()[p].value, b[u]->parameters()[p].value));
      EXPECT_TRUE(at::equal(a[u]->parameters()[p].OptimizerState("exp_avg_sq"), b[u]->parameters()[p].OptimizerState("exp_avg_sq")));
    }
  }
}

// A file system that fails every write after a byte budget is spent.
class FailingFileSystem : public FileSystemWrapper {
 public:
  FailingFileSystem(FileSystem* target, int64_t budget) : FileSystemWrapper(target), budget_(budget) {}
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    auto file = target()->NewWritableFile(path);
    if (!file.ok()) return file;
    return std::unique_ptr<WritableFile>(new File(std::move(*file), &budget_));
  }

 private:
  class File : public WritableFile {
   public:
    File(std::unique_ptr<WritableFile> file, int64_t* budget) : file_(std::move(file)), budget_(budget) {}
    absl::Status Append(std::string_view data) override {
      *budget_ -= static_cast<int64_t>(data.size());
      if (*budget_ < 0) return absl::UnavailableError("injected: disk full");
      return file_->Append(data);
    }
    absl::Status Flush() override { return file_->Flush(); }
    absl::Status Sync() override { return file_->Sync(); }
    absl::Status Close() override { return file_->Close(); }
    const std::string& path() const override { return file_->path(); }

   private:
    std::unique_ptr<WritableFile> file_;
    int64_t* budget_;
  };
  int64_t budget_;
};

TEST(TrainerTest, FailedSaveKeepsPreviousCheckpoint) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = testing::MakeTempDir("failed_save");
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->TrainIteration().ok());
  ASSERT_TRUE((*trainer)->Save().ok());

  FailingFileSystem failing(DefaultFileSystem(), /*budget=*/20000);
  auto doomed = Trainer::Create(config, corpus, /*layout=*/{}, &failing);
  ASSERT_TRUE(doomed.ok());
  ASSERT_TRUE((*doomed)->Load(config.train.save).ok());
  ASSERT_TRUE((*doomed)->TrainIteration().ok());
  absl::Status status = (*doomed)->Save();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("injected"), std::string::npos) << status;

  auto reader = ckpt::CheckpointReader::Open(config.train.save);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 1);
  EXPECT_TRUE(reader->VerifyAll().ok());
  // The failed save left nothing behind: no temporary directory, no second checkpoint.
  auto names = DefaultFileSystem()->ListDir(config.train.save);
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"iter_0000001", "latest"}));
}

TEST(TrainerTest, SaveKeepLastKeepsTheNewestCheckpoints) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = testing::MakeTempDir("keep_last");
  config.train.save_keep_last = 2;
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_TRUE(trainer.ok());
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE((*trainer)->TrainIteration().ok());
    ASSERT_TRUE((*trainer)->Save().ok());
  }
  auto names = DefaultFileSystem()->ListDir(config.train.save);
  ASSERT_TRUE(names.ok());
  std::sort(names->begin(), names->end());
  EXPECT_EQ(*names, (std::vector<std::string>{"iter_0000003", "iter_0000004", "latest"}));
}

TEST(TrainerTest, StopRequestEndsTheRunAfterTheIterationAndSavesIt) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.train_iters = 50;
  config.train.save = testing::MakeTempDir("stop");
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_TRUE(trainer.ok());
  int asked = 0;
  (*trainer)->SetStopRequest([&asked] { return ++asked >= 3; });  // "signal" in iteration 3
  ASSERT_TRUE((*trainer)->Run().ok());
  EXPECT_TRUE((*trainer)->stopped());
  EXPECT_EQ((*trainer)->iteration(), 3);
  auto reader = ckpt::CheckpointReader::Open(config.train.save);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 3);
}

TEST(TrainerTest, LoadRejectsAnotherModelShape) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = testing::MakeTempDir("shape");
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->Save().ok());
  config.model.hidden_size = 64;
  auto other = Trainer::Create(config, corpus);
  ASSERT_TRUE(other.ok());
  absl::Status status = (*other)->Load(config.train.save);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("hidden_size"), std::string::npos) << status;
}

TEST(TrainerTest, LoadRefusesOtherDataUnlessAllowed) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.save = testing::MakeTempDir("other_data");
  auto corpus = SyntheticCorpus(40, 200, config.model.vocab_size);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->TrainIteration().ok());
  ASSERT_TRUE((*trainer)->Save().ok());

  TrainerConfig reseeded = config;
  reseeded.data.seed = config.data.seed + 1;
  auto other_seed = Trainer::Create(reseeded, corpus);
  ASSERT_TRUE(other_seed.ok());
  absl::Status status = (*other_seed)->Load(config.train.save);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("--seed"), std::string::npos) << status;
  EXPECT_NE(status.message().find("--allow_data_change"), std::string::npos) << status;

  auto other_corpus = Trainer::Create(config, SyntheticCorpus(41, 200, config.model.vocab_size));
  ASSERT_TRUE(other_corpus.ok());
  status = (*other_corpus)->Load(config.train.save);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("40 documents"), std::string::npos) << status;

  reseeded.train.allow_data_change = true;
  auto allowed = Trainer::Create(reseeded, corpus);
  ASSERT_TRUE(allowed.ok());
  EXPECT_TRUE((*allowed)->Load(config.train.save).ok());
  EXPECT_EQ((*allowed)->iteration(), 1);

  TrainerConfig shorter = config;
  shorter.train.train_iters = 0 + 1;
  auto done = Trainer::Create(shorter, corpus);
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE((*done)->Load(config.train.save).ok()) << "train_iters == iteration: nothing left";
}

TEST(TrainerTest, CreateRejectsTokensOutsideTheVocabulary) {
  TrainerConfig config = SmallTrainerConfig();
  auto corpus = SyntheticCorpus(40, 200, /*vocab=*/100);
  auto trainer = Trainer::Create(config, corpus);
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("token id 99"), std::string::npos) << trainer.status();
}

// A pipeline runner that only counts what it is asked; it leaves the gradients at zero and
// reports 6 per micro-batch as the loss sum.
class CountingRunner final : public ForwardBackwardRunner {
 public:
  absl::StatusOr<std::pair<double, int64_t>> Run(GptModel& /*stage*/, int64_t /*iteration*/,
                                                 const MicroBatchPlan& plan,
                                                 double /*loss_scale*/) override {
    ++runs;
    micro_batches += plan.count;
    return std::make_pair(6.0 * plan.count, int64_t{0});
  }
  absl::StatusOr<std::pair<double, int64_t>> Evaluate(GptModel& /*stage*/,
                                                      const MicroBatchPlan& /*plan*/) override {
    return std::make_pair(0.0, int64_t{0});
  }
  void Metrics(nlohmann::json* /*record*/, std::string* /*log_line*/) const override {}
  int runs = 0;
  int64_t micro_batches = 0;
};

TEST(TrainerTest, RunsItsIterationsThroughTheRunnerItIsHanded) {
  TrainerConfig config = SmallTrainerConfig();
  CountingRunner runner;
  TrainerLayout layout;
  layout.runner = &runner;
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size), layout);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  auto stats = (*trainer)->TrainIteration();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const int64_t micro = config.train.global_batch_size / config.train.micro_batch_size;
  EXPECT_EQ(runner.runs, 1);
  EXPECT_EQ(runner.micro_batches, micro);
  EXPECT_DOUBLE_EQ(stats->loss, 6.0 * static_cast<double>(micro) /
                                    (config.train.global_batch_size * config.data.seq_length));
}

TEST(TrainerTest, RolesOfABiggerJobNeedAParallelContext) {
  TrainerLayout layout;
  layout.roles.world_size = 2;
  layout.roles.world_rank = 1;
  TrainerConfig config = SmallTrainerConfig();
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size), layout);
  ASSERT_FALSE(trainer.ok());
  EXPECT_EQ(trainer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(trainer.status().message().find("rank 1 of 2 ranks need a ParallelContext"),
            std::string::npos)
      << trainer.status();
}

}  // namespace
}  // namespace fulcrum
