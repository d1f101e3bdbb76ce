// --async_save in the training loop (TrainOptions::async_save, NOTE [background saves] in
// core/distributed_checkpoint.h): training goes on while an interval save is written, the
// checkpoints are bit for bit those of the synchronous saves, and a failed background write
// fails the run with the previous checkpoint still `latest`. The protocol across ranks is
// tests/core/distributed_checkpoint_test.cc; real multi-process jobs,
// tests/recipes/sharded_checkpoint_train_test.cc.
#include <torch/torch.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/file_system.h"
#include "core/trainer.h"
#include "gtest/gtest.h"
#include "tests/core/file_system_doubles.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing_util::GatedFileSystem;
using testing_util::RefusingFileSystem;
using testing::SmallTrainerConfig;
using testing::SyntheticCorpus;

struct AsyncVariant {
  const char* name;
  bool sharded;
  bool distributed_optimizer;
};
void PrintTo(const AsyncVariant& variant, std::ostream* os) { *os << variant.name; }

class AsyncSaveTest : public ::testing::TestWithParam<AsyncVariant> {
 protected:
  TrainerConfig Config(const std::string& save) const {
    TrainerConfig config = SmallTrainerConfig();
    config.train.train_iters = 8;
    config.train.save_interval = 2;
    config.train.save = save;
    config.train.sharded_checkpoints = GetParam().sharded;
    config.optimizer.use_distributed_optimizer = GetParam().distributed_optimizer;
    return config;
  }
};

// The save of iteration 2 is held back until training reaches iteration 4: iterations 3 and
// 4 run while it is in flight, uncommitted. Every checkpoint (2, 4 and 6 in the background,
// 8 at the end) then equals the synchronous run's bit for bit — the one of 2 too, although
// the model changed in place twice while it was written.
TEST_P(AsyncSaveTest, TrainingGoesOnWhileASaveIsWrittenAndTheCheckpointsAreTheSynchronousOnes) {
  const std::string dir = testing::MakeTempDir(absl::StrCat("async_save_", GetParam().name));
  auto corpus = SyntheticCorpus(40, 200, SmallTrainerConfig().model.vocab_size);

  TrainerConfig sync_config = Config(dir + "/sync");
  auto sync = Trainer::Create(sync_config, corpus);
  ASSERT_TRUE(sync.ok()) << sync.status();
  ASSERT_TRUE((*sync)->Run().ok());

  TrainerConfig async_config = Config(dir + "/async");
  async_config.train.async_save = true;
  GatedFileSystem gated(DefaultFileSystem(), ".tmp_iter_0000002");
  auto async = Trainer::Create(async_config, corpus, /*layout=*/{}, &gated);
  ASSERT_TRUE(async.ok()) << async.status();
  // The stop request is read once per iteration, on the training thread: the test's hook.
  std::vector<int64_t> uncommitted_during;
  Trainer* trainer = async->get();
  trainer->SetStopRequest([&] {
    const int64_t running = trainer->iteration() + 1;
    if (running >= 3 && !DefaultFileSystem()->FileExists(dir + "/async/latest")) {
      uncommitted_during.push_back(running);
    }
    if (running == 4) gated.Open();
    return false;
  });
  const absl::Status ran = trainer->Run();
  ASSERT_TRUE(ran.ok()) << ran;
  EXPECT_EQ(uncommitted_during, (std::vector<int64_t>{3, 4}))
      << "iterations run while the save of 2 was held back";

  for (const int64_t iteration : {2, 4, 6, 8}) {
    const std::string name = ckpt::IterationDirName(iteration);
    auto a = ckpt::CheckpointReader::Open(absl::StrCat(dir, "/async/", name));
    auto s = ckpt::CheckpointReader::Open(absl::StrCat(dir, "/sync/", name));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_EQ(a->names(), s->names()) << name;
    EXPECT_EQ(a->manifest()["consumed_samples"], s->manifest()["consumed_samples"]);
    for (const std::string& tensor : s->names()) {
      auto x = a->Read(tensor);
      auto y = s->Read(tensor);
      ASSERT_TRUE(x.ok() && y.ok()) << tensor;
      EXPECT_TRUE(x->dtype() == y->dtype() && at::equal(*x, *y)) << name << ": " << tensor;
    }
  }
  auto latest = ckpt::CheckpointReader::Open(dir + "/async");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->iteration(), 8);
}

INSTANTIATE_TEST_SUITE_P(Formats, AsyncSaveTest,
                         ::testing::Values(AsyncVariant{"sharded", true, false},
                                           AsyncVariant{"full", false, false},
                                           AsyncVariant{"sharded_distopt", true, true},
                                           AsyncVariant{"full_distopt", false, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// A background write that fails fails the run at the next iteration end; the checkpoint
// before it stays `latest`, complete, and the failed one leaves nothing behind.
TEST(AsyncSaveFailureTest, AFailedBackgroundWriteFailsTheRunAndKeepsThePreviousCheckpoint) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.train_iters = 8;
  config.train.save_interval = 2;
  config.train.async_save = true;
  config.train.save = testing::MakeTempDir("async_save_fails");
  RefusingFileSystem refusing(DefaultFileSystem(), ".tmp_iter_0000004");
  auto trainer =
      Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size), {}, &refusing);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const absl::Status ran = (*trainer)->Run();
  ASSERT_FALSE(ran.ok());
  EXPECT_NE(ran.message().find("injected"), std::string::npos) << ran;
  // Reported at the first iteration end after the write ended, or when the next save came
  // due (the write fails at once, but its thread may not have run by then).
  EXPECT_TRUE((*trainer)->iteration() == 5 || (*trainer)->iteration() == 6)
      << (*trainer)->iteration();
  auto reader = ckpt::CheckpointReader::Open(config.train.save);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 2);
  EXPECT_TRUE(reader->VerifyAll().ok());
  auto names = DefaultFileSystem()->ListDir(config.train.save);
  ASSERT_TRUE(names.ok());
  std::sort(names->begin(), names->end());
  EXPECT_EQ(*names, (std::vector<std::string>{"iter_0000002", "latest"}));
}

TEST(AsyncSaveFailureTest, AsyncSaveWithoutASaveDirectoryIsRefused) {
  TrainerConfig config = SmallTrainerConfig();
  config.train.async_save = true;
  auto trainer = Trainer::Create(config, SyntheticCorpus(40, 200, config.model.vocab_size));
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("--async_save needs --save"), std::string::npos)
      << trainer.status();
}

}  // namespace
}  // namespace fulcrum
