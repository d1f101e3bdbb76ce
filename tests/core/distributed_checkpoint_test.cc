// The distributed save protocol (core/distributed_checkpoint.h) on jobs whose ranks are
// played by threads over one directory: every shard reaches the committed checkpoint, and
// one rank's failed write fails the save on every rank, without a hang and without a trace
// on disk. A background save (NOTE [background saves]) writes the state of its start
// while the model changes, and commits only once the slower rank's write has ended.
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "core/distributed_checkpoint.h"
#include "core/file_system.h"
#include "core/gpt_model.h"
#include "gtest/gtest.h"
#include "tests/core/file_system_doubles.h"
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

using testing_util::GatedFileSystem;
using testing_util::RefusingFileSystem;
// The collectives of `size` threads: a reusable barrier and a sum that every thread joins.
class ThreadJob {
 public:
  explicit ThreadJob(int size) : size_(size) {}

  void Barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return generation_ != generation; });
    }
  }

  void Sum(std::vector<double>& values) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (sum_.size() != values.size()) sum_.assign(values.size(), 0.0);
      for (size_t i = 0; i < values.size(); ++i) sum_[i] += values[i];
    }
    Barrier();  // Every rank has added.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      values = sum_;
    }
    Barrier();  // Every rank has read.
    std::lock_guard<std::mutex> lock(mutex_);
    sum_.clear();
  }

  CheckpointCollectives Collectives() {
    CheckpointCollectives c;
    c.barrier = [this] { Barrier(); };
    c.sum_over_job = [this](std::vector<double>& values) { Sum(values); };
    return c;
  }

 private:
  const int size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  std::vector<double> sum_;
};

// Rank `stage` of a pipeline of `stages`: its roles. Rank 0 commits.
RankRoles StageRoles(int stage, int stages) {
  RankRoles roles;
  roles.world_rank = stage;
  roles.world_size = stages;
  roles.pp_size = stages;
  roles.model_parallel_rank = stage;
  roles.model_parallel_size = stages;
  roles.is_logging_rank = stage == stages - 1;
  roles.commits_checkpoint = stage == 0;
  roles.checkpoint_shard_name = absl::StrCat("rank_0000", stage);
  return roles;
}

// The save of iteration 3 into `dir`, written through `fs`: what every test here saves.
CheckpointSave SaveOfIterationThree(FileSystem* fs, const std::string& dir) {
  CheckpointSave save;
  save.fs = fs;
  save.dir = dir;
  save.iteration = 3;
  save.manifest_fields = {{"iteration", 3}};
  return save;
}

// Saves iteration 3 of a model of two layers per stage into `dir` on one thread-rank per
// stage, rank r writing through `fs[r]`; each rank's status.
std::vector<absl::Status> SaveOnRanks(const std::string& dir, const std::vector<FileSystem*>& fs) {
  const int n = static_cast<int>(fs.size());
  const ModelOptions options = testing::SmallModelOf(/*num_layers=*/2 * n, /*seq_length=*/8);
  std::vector<std::unique_ptr<GptModel>> stages;
  for (int r = 0; r < n; ++r) {
    stages.push_back(std::make_unique<GptModel>(options, EvenStage(options.num_layers, n, r)));
  }
  ThreadJob job(n);
  std::vector<absl::Status> status(n);
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      const CheckpointSave save = SaveOfIterationThree(fs[r], dir);
      status[r] = SaveCheckpoint(save, stages[r]->Units(), StageRoles(r, n), job.Collectives());
    });
  }
  for (std::thread& rank : ranks) rank.join();
  return status;
}

TEST(DistributedCheckpointTest, EveryWritersShardIsCommitted) {
  const std::string dir = testing::MakeTempDir("distributed_save");
  const std::vector<absl::Status> saved = SaveOnRanks(dir, {DefaultFileSystem(), DefaultFileSystem()});
  ASSERT_TRUE(saved[0].ok()) << saved[0];
  ASSERT_TRUE(saved[1].ok()) << saved[1];
  auto reader = ckpt::CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 3);
  EXPECT_TRUE(reader->VerifyAll().ok());
  // Every tensor of both stages (the first's embedding and layers, the second's layers
  // and head), and the committer's random state.
  const ModelOptions options = testing::SmallModelOf(/*num_layers=*/4, /*seq_length=*/8);
  std::set<std::string> expected = {"rng.torch_cpu"};
  for (int s = 0; s < 2; ++s) {
    GptModel stage(options, EvenStage(options.num_layers, 2, s));
    for (Unit* unit : stage.Units()) {
      for (const auto& [name, tensor] : unit->StateTensors()) expected.insert(name);
    }
  }
  ASSERT_GT(expected.size(), 10u);
  const std::vector<std::string> names = reader->names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), expected);
}

// Three ranks: rank 1's write fails. It reports its own error, the committer learns of it
// through the sum, and rank 2, whose write succeeded, learns that nothing was committed —
// so no rank trains on into collectives the others have left.
TEST(DistributedCheckpointTest, OneRanksFailedWriteFailsTheSaveOnEveryRankWithoutAHang) {
  const std::string dir = testing::MakeTempDir("distributed_save_fails");
  RefusingFileSystem refusing(DefaultFileSystem(), "rank_00001");
  const std::vector<absl::Status> saved =
      SaveOnRanks(dir, {DefaultFileSystem(), &refusing, DefaultFileSystem()});
  ASSERT_FALSE(saved[1].ok());
  EXPECT_NE(saved[1].message().find("injected"), std::string::npos) << saved[1];
  ASSERT_FALSE(saved[0].ok());
  EXPECT_NE(saved[0].message().find("1 rank(s) failed to write their shard"), std::string::npos)
      << saved[0];
  ASSERT_FALSE(saved[2].ok());
  EXPECT_NE(saved[2].message().find("the checkpoint of iteration 3 was not committed: 1 rank(s) "
                                    "failed to write their shard"),
            std::string::npos)
      << saved[2];
  // Nothing committed, and the aborted save removed its temporary directory.
  auto names = DefaultFileSystem()->ListDir(dir);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->empty()) << names->front();
}

// Every state tensor of `stage` by global name, copied.
std::map<std::string, at::Tensor> StateOf(const GptModel& stage) {
  std::map<std::string, at::Tensor> state;
  for (Unit* unit : stage.Units()) {
    for (const auto& [name, tensor] : unit->StateTensors()) state[name] = tensor.clone();
  }
  return state;
}

// NOTE [background saves] on two thread-ranks: rank 1's write is held back, each rank's model
// changes right after the save starts (as training goes on), and the ranks poll while it is
// held. The checkpoint appears only after rank 1's write, and holds the state of the start.
TEST(DistributedCheckpointTest, ABackgroundSaveWritesItsStartAndCommitsAfterTheSlowerRank) {
  const std::string dir = testing::MakeTempDir("background_save");
  const ModelOptions options = testing::SmallModelOf(/*num_layers=*/4, /*seq_length=*/8);
  GptModel stage0(options, EvenStage(options.num_layers, 2, 0));
  GptModel stage1(options, EvenStage(options.num_layers, 2, 1));
  GptModel* stages[2] = {&stage0, &stage1};
  std::map<std::string, at::Tensor> at_start = StateOf(stage0);
  at_start.merge(StateOf(stage1));
  GatedFileSystem gated(DefaultFileSystem(), "rank_00001");
  FileSystem* fs[2] = {DefaultFileSystem(), &gated};
  ThreadJob job(2);
  absl::Status status[2];
  bool committed_while_held[2] = {true, true};
  int polls[2] = {0, 0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CheckpointSave save = SaveOfIterationThree(fs[r], dir);
      save.snapshot = true;
      const CheckpointCollectives collectives = job.Collectives();
      BackgroundSave background(StartSave(save, stages[r]->Units(), StageRoles(r, 2), collectives));
      // Training goes on: every parameter and moment changes in place.
      at::NoGradGuard no_grad;
      for (Unit* unit : stages[r]->Units()) {
        for (Parameter& p : unit->parameters()) {
          p.value.fill_(42.0);
          for (auto& [slot, moment] : p.optimizer_state) moment.fill_(42.0);
        }
      }
      // While rank 1's write is held, every rank's poll says "still writing".
      const std::optional<absl::Status> held = background.FinishIfWritten(collectives);
      committed_while_held[r] = held.has_value() || DefaultFileSystem()->FileExists(dir + "/latest");
      job.Barrier();  // Both looked before the gate opens.
      if (r == 1) gated.Open();
      std::optional<absl::Status> finished;
      while (!(finished = background.FinishIfWritten(collectives)).has_value()) {
        ++polls[r];
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      status[r] = *finished;
    });
  }
  for (std::thread& rank : ranks) rank.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(committed_while_held[r]) << "rank " << r;
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  }
  EXPECT_EQ(polls[0], polls[1]) << "the poll is collective: every rank finishes at the same one";
  auto reader = ckpt::CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 3);
  EXPECT_EQ(reader->manifest()["files"].size(), 2u);
  ASSERT_GT(at_start.size(), 10u);
  for (const auto& [name, tensor] : at_start) {
    auto stored = reader->Read(name);
    ASSERT_TRUE(stored.ok()) << name << ": " << stored.status();
    EXPECT_TRUE(at::equal(*stored, tensor)) << name << " is not the state of the save's start";
    // So a save that wrote the live state, changed since, would fail the line above.
    EXPECT_FALSE(at::equal(tensor, at::full_like(tensor, 42.0))) << name;
  }
}

}  // namespace
}  // namespace fulcrum
