// The distributed save protocol (core/distributed_checkpoint.h) on a job of two ranks played
// by two threads over one directory: both shards reach the committed checkpoint, and one
// rank's failed write fails the save on the committing rank, without a hang and without a
// trace on disk.
#include <torch/torch.h>

#include <condition_variable>
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
#include "tests/core/test_util.h"

namespace fulcrum {
namespace {

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

// Fails the creation of every file whose path contains `needle`.
class RefusingFileSystem : public FileSystemWrapper {
 public:
  RefusingFileSystem(FileSystem* target, std::string needle)
      : FileSystemWrapper(target), needle_(std::move(needle)) {}
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    if (path.find(needle_) != std::string::npos) {
      return absl::UnavailableError(absl::StrCat("injected: cannot create ", path));
    }
    return target()->NewWritableFile(path);
  }

 private:
  std::string needle_;
};

// Rank `stage` of a two-stage pipeline: its roles, its part of the model.
RankRoles StageRoles(int stage) {
  RankRoles roles;
  roles.world_rank = stage;
  roles.world_size = 2;
  roles.pp_size = 2;
  roles.model_parallel_rank = stage;
  roles.model_parallel_size = 2;
  roles.is_logging_rank = stage == 1;
  roles.commits_checkpoint = stage == 0;
  roles.checkpoint_shard_name = stage == 0 ? "rank_00000" : "rank_00001";
  return roles;
}

struct TwoRankSave {
  absl::Status status[2];
};

// Saves iteration 3 of a two-stage model into `dir`, rank r writing through `fs[r]`.
TwoRankSave SaveOnTwoRanks(const std::string& dir, FileSystem* fs0, FileSystem* fs1) {
  const ModelOptions options = testing::SmallModelOf(/*num_layers=*/4, /*seq_length=*/8);
  GptModel stage0(options, EvenStage(options.num_layers, 2, 0));
  GptModel stage1(options, EvenStage(options.num_layers, 2, 1));
  const GptModel* stages[2] = {&stage0, &stage1};
  FileSystem* fs[2] = {fs0, fs1};
  ThreadJob job(2);
  TwoRankSave result;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CheckpointSave save;
      save.fs = fs[r];
      save.dir = dir;
      save.iteration = 3;
      save.manifest_fields = {{"iteration", 3}};
      result.status[r] = SaveCheckpoint(save, stages[r]->Units(), StageRoles(r), job.Collectives());
    });
  }
  for (std::thread& rank : ranks) rank.join();
  return result;
}

TEST(DistributedCheckpointTest, EveryWritersShardIsCommitted) {
  const std::string dir = testing::MakeTempDir("distributed_save");
  const TwoRankSave saved = SaveOnTwoRanks(dir, DefaultFileSystem(), DefaultFileSystem());
  ASSERT_TRUE(saved.status[0].ok()) << saved.status[0];
  ASSERT_TRUE(saved.status[1].ok()) << saved.status[1];
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

TEST(DistributedCheckpointTest, OneRanksFailedWriteFailsTheSaveWithoutAHang) {
  const std::string dir = testing::MakeTempDir("distributed_save_fails");
  RefusingFileSystem refusing(DefaultFileSystem(), "rank_00001");
  const TwoRankSave saved = SaveOnTwoRanks(dir, DefaultFileSystem(), &refusing);
  // The failing rank reports its own error; the committer learns of it through the sum.
  ASSERT_FALSE(saved.status[1].ok());
  EXPECT_NE(saved.status[1].message().find("injected"), std::string::npos) << saved.status[1];
  ASSERT_FALSE(saved.status[0].ok());
  EXPECT_NE(saved.status[0].message().find("1 rank(s) failed to write their shard"),
            std::string::npos)
      << saved.status[0];
  // Nothing committed, and the aborted save removed its temporary directory.
  auto names = DefaultFileSystem()->ListDir(dir);
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_TRUE(names->empty()) << names->front();
}

}  // namespace
}  // namespace fulcrum
