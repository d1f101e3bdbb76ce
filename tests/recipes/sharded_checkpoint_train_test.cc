// Sharded checkpoints (--ckpt_format=sharded, NOTE [sharded checkpoints] in
// core/checkpoint/manifest_json.h) written by real jobs: every rank writes its own pieces,
// the tensors equal a full save of the same run bit for bit, and the checkpoint resumes
// under other layouts, with and without the distributed optimizer, after layers moved.
// Written in the background (--async_save), the checkpoints are those of the synchronous
// saves, and a rank killed during a background write leaves the previous one `latest`.
// The format itself (tiling, checks, slice reads) is tests/core/checkpoint/
// sharded_checkpoint_test.cc; fulcrum_ckpt's shard/consolidate, ckpt_tool_test.cc.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/recipes/train_runs.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

// Three layers move: one in iteration 3, two back in 7; the save at 10 comes after both.
constexpr char kMoves[] = " --rebalance_script='3:1->1;7:3,1'";

std::string ShardedTiny() {
  return "--recipe=tiny --train_iters=20 --eval_interval=0 --log_interval=10 "
         "--global_batch_size=16 --micro_batch_size=4" +
         std::string(testing::kPastWarmup);
}

std::vector<double> ShardedLosses(int n, const std::string& flags, const std::string& dir,
                           const std::string& name) {
  return testing::LossesOf(testing::TrainRecords(n, flags, dir + "/" + name + ".jsonl"));
}

// Both checkpoints hold the same tensors, bit for bit, by whole name — the default
// generator's state (rng.torch_cpu) too: fulcrum_train seeds it from --seed.
void ExpectSameTensors(const std::string& a, const std::string& b) {
  auto ra = ckpt::CheckpointReader::Open(a);
  auto rb = ckpt::CheckpointReader::Open(b);
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
  ASSERT_EQ(ra->names(), rb->names());
  EXPECT_TRUE(ra->Has("rng.torch_cpu"));
  for (const std::string& name : ra->names()) {
    const auto x = ra->Read(name);
    const auto y = rb->Read(name);
    ASSERT_TRUE(x.ok() && y.ok()) << name;
    EXPECT_TRUE(x->dtype() == y->dtype() && torch::equal(*x, *y)) << name;
  }
}

// The size of the largest file of the checkpoint `save_dir` names.
uint64_t LargestFile(const std::string& save_dir) {
  auto reader = ckpt::CheckpointReader::Open(save_dir);
  uint64_t largest = 0;
  for (const auto& [file, info] : reader->manifest()["files"].items()) {
    largest = std::max(largest, info["bytes"].get<uint64_t>());
  }
  return largest;
}

struct Resume {
  int n;
  std::string flags;
};

// Saves the run of `layout` (on `n` ranks, layers moving) at iteration 10, sharded and
// full; checks the sharded checkpoint's pieces and that it equals the full one; resumes the
// sharded one under each of `resumes` against the uninterrupted one-process run; resumes
// both under `twin` and expects the same losses bit for bit.
void SaveShardedAndResume(int n, const std::string& layout, const std::vector<Resume>& resumes,
                          const Resume& twin, const std::string& tag) {
  const std::string dir = testing::MakeTempDir(tag);
  // fp64: tensor parallelism's fp32 rounding depends on the CPU (testing::kFp64).
  const std::string tiny = ShardedTiny() + testing::kFp64;
  const std::vector<double> one = ShardedLosses(1, tiny, dir, "one");
  ASSERT_EQ(one.size(), 20u);
  const std::vector<double> expected(one.begin() + 10, one.end());
  const std::string sharded = dir + "/sharded";
  const std::string full = dir + "/full";
  const auto saved = testing::TrainRecords(
      n, tiny + layout + kMoves + " --exit_interval=10 --save=" + sharded, dir + "/save.jsonl");
  ASSERT_EQ(saved.size(), 10u);
  EXPECT_EQ(saved.back()["layers_moved"].get<int64_t>(), 3);
  ShardedLosses(n, tiny + layout + kMoves + " --exit_interval=10 --ckpt_format=full --save=" + full,
         dir, "save_full");

  auto reader = ckpt::CheckpointReader::Open(sharded);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 10);
  EXPECT_EQ(reader->manifest()["layer_placement"].dump(),
            R"([{"layer_begin":0,"layer_end":3,"stage":0},{"layer_begin":3,"layer_end":4,"stage":1}])")
      << "after the moves";
  // Every rank wrote its own file, and some tensors are pieces from several of them.
  EXPECT_EQ(reader->manifest()["files"].size(), static_cast<size_t>(n));
  EXPECT_FALSE(reader->sharded().empty());
  ExpectSameTensors(sharded, full);
  const uint64_t sharded_bytes = LargestFile(sharded);
  const uint64_t full_bytes = LargestFile(full);
  std::cout << tag << ": largest file a rank writes: sharded " << sharded_bytes << " B, full "
            << full_bytes << " B (" << static_cast<double>(sharded_bytes) / full_bytes << ")\n";
  EXPECT_LT(sharded_bytes, full_bytes);

  for (size_t i = 0; i < resumes.size(); ++i) {
    const Resume& r = resumes[i];
    const std::vector<double> resumed =
        ShardedLosses(r.n, tiny + r.flags + " --load=" + sharded, dir, "resumed_" + std::to_string(i));
    ASSERT_EQ(resumed.size(), 10u) << r.flags;
    const double worst = testing::MaxRelativeDifference(resumed, expected);
    std::cout << tag << " -> " << r.n << " procs '" << r.flags << "': max relative difference "
              << worst << "\n";
    EXPECT_LE(worst, testing::kFp64LayoutTolerance) << r.flags;
  }
  EXPECT_EQ(ShardedLosses(twin.n, tiny + twin.flags + " --load=" + sharded, dir, "twin_sharded"),
            ShardedLosses(twin.n, tiny + twin.flags + " --load=" + full, dir, "twin_full"))
      << "the same state, loaded from pieces or whole, trains the same";
}

// tp=2 × pp=2 after moves: the tensor-parallel shards are boxes written by each tp rank.
TEST(SlowShardedCheckpointTest, Tp2Pp2AfterMovesResumesUnderOtherLayouts) {
  SaveShardedAndResume(
      4, " --tensor_model_parallel_size=2 --pipeline_model_parallel_size=2",
      {{1, ""},
       {4, " --tensor_model_parallel_size=2"},
       {4, " --pipeline_model_parallel_size=4"}},
      {4, " --tensor_model_parallel_size=2"}, "sharded_tp2pp2");
}

// pp=2 × dp=2 with the distributed optimizer after moves: each dp rank writes the moment
// slices it owns (flat ranges), nothing gathered; resumed without it, under tp=2 × dp=2
// with it, and under pp=4.
TEST(SlowShardedCheckpointTest, DistributedOptimizerSlicesResumeUnderOtherLayouts) {
  SaveShardedAndResume(
      4, std::string(testing::kZero) + " --pipeline_model_parallel_size=2",
      {{1, ""},
       {4, std::string(testing::kZero) + " --tensor_model_parallel_size=2"},
       {4, " --pipeline_model_parallel_size=4"}},
      {4, std::string(testing::kZero) + " --tensor_model_parallel_size=2"}, "sharded_zero");
}

// A 0-dim parameter (the cosine router's temperature) under the distributed optimizer: its
// moments are one flat piece of an empty box. dp=2, tiny_moe: the sharded save equals the
// full one and both resume to the same losses.
TEST(SlowShardedCheckpointTest, ScalarParametersUnderTheDistributedOptimizer) {
  const std::string dir = testing::MakeTempDir("sharded_scalar");
  const std::string flags =
      "--recipe=tiny_moe --moe_router=cosine --num_layers=2 --train_iters=6 --eval_interval=0 "
      "--log_interval=10 --global_batch_size=8 --micro_batch_size=2" +
      std::string(testing::kPastWarmup) + testing::kZero;
  ShardedLosses(2, flags + " --exit_interval=3 --save=" + dir + "/sharded", dir, "save_sharded");
  ShardedLosses(2, flags + " --exit_interval=3 --ckpt_format=full --save=" + dir + "/full", dir,
         "save_full");
  ExpectSameTensors(dir + "/sharded", dir + "/full");
  auto reader = ckpt::CheckpointReader::Open(dir + "/sharded");
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto scalar =
      reader->sharded().find("optimizer.layers.0.mlp.router.log_inv_temperature.exp_avg");
  ASSERT_NE(scalar, reader->sharded().end()) << "a piece of its owner";
  EXPECT_TRUE(scalar->second.shape.empty());
  const auto resumed = ShardedLosses(2, flags + " --load=" + dir + "/sharded", dir, "resumed_sharded");
  EXPECT_EQ(resumed.size(), 3u);
  EXPECT_EQ(resumed, ShardedLosses(2, flags + " --load=" + dir + "/full", dir, "resumed_full"));
}

// The pids of the processes whose command line holds `needle` and whose environment sets
// RANK=`rank` (-1: any rank).
std::vector<pid_t> RanksRunning(const std::string& needle, int rank) {
  std::vector<pid_t> pids;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return pids;
  auto read_all = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  while (dirent* entry = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0) continue;
    const std::string base = "/proc/" + std::string(entry->d_name);
    const std::string cmdline = read_all(base + "/cmdline");
    if (cmdline.find("fulcrum_train") == std::string::npos ||
        cmdline.find(needle) == std::string::npos) {
      continue;
    }
    const std::string environ = read_all(base + "/environ");
    if (rank < 0 || environ.find(std::string("\0RANK=") + std::to_string(rank) + '\0') !=
                        std::string::npos) {
      pids.push_back(pid);
    }
  }
  closedir(proc);
  return pids;
}

// Whether `dir` holds a file whose name starts with "rank_".
bool HoldsARankFile(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return false;
  bool found = false;
  while (dirent* entry = readdir(d)) {
    if (std::string(entry->d_name).rfind("rank_", 0) == 0) found = true;
  }
  closedir(d);
  return found;
}

// Runs the 4-rank job `command` (saving to `save` at 10 and 20) and SIGKILLs rank `victim`
// as soon as a rank's file of the save of iteration 20 appears, before that save commits.
// Returns false when the kill came too late (the save of 20 committed first).
bool KillRankDuringTheSecondSave(const std::string& command, const std::string& save,
                                 int victim) {
  const pid_t job = fork();
  if (job == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", (command + " >" + save + ".log 2>&1").c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::string temp = save + "/.tmp_iter_0000020";
  bool killed = false;
  int status = 0;
  while (waitpid(job, &status, WNOHANG) == 0) {
    if (!killed && HoldsARankFile(temp)) {
      for (const pid_t pid : RanksRunning(save, victim)) kill(pid, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return killed && access((save + "/iter_0000020").c_str(), F_OK) != 0;
}

// NOTE [checkpoint crash safety] across ranks: a rank killed while the ranks write their
// pieces of a sharded save — the committing rank 0, or rank 3 — leaves the previous
// checkpoint `latest`, complete and loadable; the job resumes from it and its next save
// clears what the killed one left.
TEST(SlowShardedCheckpointTest, ARankKilledDuringASaveLeavesThePreviousCheckpoint) {
  for (const int victim : {0, 3}) {
    const std::string dir = testing::MakeTempDir("sharded_kill");
    const std::string flags = ShardedTiny() + std::string(testing::kZero) +
                              " --tensor_model_parallel_size=2 --save_interval=10 --save=";
    std::string save;
    bool landed = false;
    for (int attempt = 0; attempt < 3 && !landed; ++attempt) {
      save = dir + "/save" + std::to_string(attempt);
      landed = KillRankDuringTheSecondSave(testing::TrainCommand(4, flags + save), save, victim);
    }
    ASSERT_TRUE(landed) << "three kills of rank " << victim << " came after the save committed";
    auto reader = ckpt::CheckpointReader::Open(save);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ(reader->iteration(), 10) << "rank " << victim;
    EXPECT_TRUE(reader->VerifyAll().ok());
    EXPECT_EQ(access((save + "/.tmp_iter_0000020").c_str(), F_OK), 0) << "the kill was mid-save";
    const auto resumed =
        testing::TrainRecords(4, flags + save + " --load=" + save, dir + "/resumed.jsonl");
    ASSERT_FALSE(resumed.empty());
    EXPECT_EQ(resumed.front()["iteration"].get<int64_t>(), 11);
    reader = ckpt::CheckpointReader::Open(save);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ(reader->iteration(), 20);
    EXPECT_NE(access((save + "/.tmp_iter_0000020").c_str(), F_OK), 0) << "cleared by the save";
  }
}

// NOTE [background saves] in a real job: pp=2 with layers moving, saving every 5 iterations
// in the background. Every checkpoint equals the synchronous run's bit for bit, the saves
// of 5, 10 and 15 were committed after training had gone on, and the one of 10 resumes to
// the same losses.
TEST(SlowShardedCheckpointTest, AsyncSavesOfAPipelineJobAreTheSynchronousOnes) {
  const std::string dir = testing::MakeTempDir("async_pp2");
  const std::string flags = ShardedTiny() + " --pipeline_model_parallel_size=2" + kMoves +
                            " --save_interval=5 --save=";
  std::string printed;
  std::vector<nlohmann::json> async_records;
  ASSERT_NO_FATAL_FAILURE(testing::RunTrainOrFail(2, flags + dir + "/async --async_save",
                                                  dir + "/async.jsonl", &async_records, &printed));
  ASSERT_EQ(async_records.size(), 20u);
  EXPECT_EQ(async_records.back()["layers_moved"].get<int64_t>(), 3);
  for (const int iteration : {5, 10, 15}) {
    EXPECT_THAT(printed, ::testing::HasSubstr(absl::StrCat(
                             "checkpoint of iteration ", iteration, ": training waited")));
    EXPECT_THAT(printed, ::testing::ContainsRegex(absl::StrCat(
                             "checkpoint of iteration ", iteration,
                             " committed after iteration [0-9]+ \\(written in the background;")));
  }
  ShardedLosses(2, flags + dir + "/sync", dir, "sync");
  for (const int iteration : {5, 10, 15, 20}) {
    const std::string name = "/" + ckpt::IterationDirName(iteration);
    ExpectSameTensors(dir + "/async" + name, dir + "/sync" + name);
  }
  const auto resumed = testing::TrainRecords(
      2, ShardedTiny() + " --pipeline_model_parallel_size=2" + kMoves + " --load=" + dir +
             "/async/iter_0000010",
      dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.size(), 10u);
  const std::vector<double> straight = testing::LossesOf(async_records);
  EXPECT_EQ(testing::LossesOf(resumed), std::vector<double>(straight.begin() + 10, straight.end()));
}

// A rank killed while its background write of the interval save of 20 is in flight: the
// committing rank 0, the one whose commit would make it `latest`.
TEST(SlowShardedCheckpointTest, ARankKilledDuringABackgroundSaveLeavesThePreviousCheckpoint) {
  const std::string dir = testing::MakeTempDir("async_kill");
  const std::string flags = ShardedTiny() + " --train_iters=30 --async_save" +
                            std::string(testing::kZero) +
                            " --tensor_model_parallel_size=2 --save_interval=10 --save=";
  std::string save;
  bool landed = false;
  for (int attempt = 0; attempt < 3 && !landed; ++attempt) {
    save = dir + "/save" + std::to_string(attempt);
    landed = KillRankDuringTheSecondSave(testing::TrainCommand(4, flags + save), save, 0);
  }
  ASSERT_TRUE(landed) << "three kills of rank 0 came after the save committed";
  std::ifstream log(save + ".log");
  std::stringstream printed;
  printed << log.rdbuf();
  // The saves of 10 and 20 are interval saves, so background ones (the kill may come before
  // rank 0 logs the one of 20).
  EXPECT_THAT(printed.str(), ::testing::HasSubstr("checkpoint of iteration 10: training waited"));
  auto reader = ckpt::CheckpointReader::Open(save);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 10);
  EXPECT_TRUE(reader->VerifyAll().ok());
  const auto resumed =
      testing::TrainRecords(4, flags + save + " --load=" + save, dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.size(), 20u);
  EXPECT_EQ(resumed.front()["iteration"].get<int64_t>(), 11);
  reader = ckpt::CheckpointReader::Open(save);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 30);
}

}  // namespace
}  // namespace fulcrum
