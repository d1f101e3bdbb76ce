// Crash safety of CheckpointWriter (NOTE [checkpoint crash safety]): whatever operation
// of a save fails or is killed, `latest` names a complete checkpoint afterwards, and the
// next save succeeds. Injected errors run in-process; real kills run the save in a
// fork()ed child that SIGKILLs itself, so no destructor or cleanup code runs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "core/checkpoint/checkpoint.h"
#include "tests/core/checkpoint/fault_injection_file_system.h"
#include "tests/core/checkpoint/test_util.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::FaultInjectionFileSystem;
using ::fulcrum::testing_util::ReadBytes;
using ::fulcrum::testing_util::ScopedTempDir;
using Action = FaultInjectionFileSystem::Action;
using Op = FaultInjectionFileSystem::Op;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Big enough that a shard takes several appends, small enough to keep the sweeps fast.
NamedTensors State(float value) {
  return {
      {"layers.0.weight", torch::full({64, 64}, value)},
      {"layers.1.weight", torch::full({64, 64}, value + 1)},
      {"optimizer.step", torch::tensor(static_cast<int64_t>(value)).reshape({})},
  };
}

// Two shards, like two pipeline ranks, so a crash can fall between them.
absl::Status SaveThrough(FileSystem* fs, const std::string& save_dir, int64_t iteration,
                  const NamedTensors& state) {
  absl::StatusOr<CheckpointWriter> writer = CheckpointWriter::Begin(fs, save_dir, iteration);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->WriteShard("pp0", {state[0]}); !s.ok()) return s;
  if (absl::Status s = writer->WriteShard("pp1", {state[1], state[2]}); !s.ok()) return s;
  return writer->Commit({{"consumed_samples", iteration * 8}});
}

// Asserts that `save_dir` holds a complete checkpoint that `latest` names, of `iteration`
// with `state` or of `alt_iteration` with `alt_state`; returns the iteration found.
int64_t ExpectLoadableCheckpoint(const std::string& save_dir, int64_t iteration,
                                 const NamedTensors& state, int64_t alt_iteration,
                                 const NamedTensors& alt_state) {
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save_dir);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return -1;
  EXPECT_TRUE(reader->VerifyAll().ok()) << reader->VerifyAll();
  const std::string latest = ReadBytes(JoinPath(save_dir, kLatestFileName));
  EXPECT_EQ(latest, IterationDirName(reader->iteration()) + "\n");
  // Either state, but entirely one of them: never a mix of an old and a new shard.
  bool matches_state = true;
  bool matches_alt = true;
  for (size_t i = 0; i < state.size(); ++i) {
    absl::StatusOr<at::Tensor> tensor = reader->Read(state[i].first);
    EXPECT_TRUE(tensor.ok()) << tensor.status();
    if (!tensor.ok()) return -1;
    matches_state = matches_state && tensor->equal(state[i].second);
    matches_alt = matches_alt && tensor->equal(alt_state[i].second);
  }
  EXPECT_TRUE((reader->iteration() == iteration && matches_state) ||
              (reader->iteration() == alt_iteration && matches_alt))
      << "iteration " << reader->iteration();
  return reader->iteration();
}

// The number of mutating file-system operations of SaveThrough(iteration) over a save directory
// holding one checkpoint of iteration 10, the starting state of every crash test.
int64_t CountOps(int64_t iteration) {
  ScopedTempDir scratch;
  EXPECT_TRUE(SaveThrough(DefaultFileSystem(), scratch.path(), 10, State(1)).ok());
  FaultInjectionFileSystem counter(DefaultFileSystem());
  EXPECT_TRUE(SaveThrough(&counter, scratch.path(), iteration, State(2)).ok());
  return counter.op_count();
}

// Runs SaveThrough(iteration, State(2)) in a child process through `configure`d fault injection.
// Returns true if the child was killed, false if it finished the save.
bool SaveInChild(const std::string& save_dir, int64_t iteration,
                 const std::function<void(FaultInjectionFileSystem&)>& configure) {
  const NamedTensors state = State(2);  // Built before fork: the child only writes.
  const pid_t pid = ::fork();
  if (pid == 0) {
    FaultInjectionFileSystem faulty(DefaultFileSystem());
    configure(faulty);
    const absl::Status status = SaveThrough(&faulty, save_dir, iteration, state);
    ::_exit(status.ok() ? 0 : 3);
  }
  EXPECT_GT(pid, 0);
  int wait_status = 0;
  EXPECT_EQ(::waitpid(pid, &wait_status, 0), pid);
  if (WIFSIGNALED(wait_status)) {
    EXPECT_EQ(WTERMSIG(wait_status), SIGKILL);
    return true;
  }
  EXPECT_TRUE(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)
      << "child save failed without being killed";
  return false;
}

// After any crash, a plain save must succeed and win.
void ExpectNextSaveSucceeds(const std::string& save_dir) {
  ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save_dir, 30, State(3)).ok());
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save_dir);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 30);
  EXPECT_TRUE(reader->VerifyAll().ok());
  const std::vector<std::string> names = *DefaultFileSystem()->ListDir(save_dir);
  for (const std::string& name : names) {
    EXPECT_FALSE(absl::StartsWith(name, ".")) << "left behind: " << name;
  }
}

TEST(CheckpointCrashTest, ErrorHalfwayThroughSecondSaveKeepsFirstCheckpoint) {
  ScopedTempDir save;
  ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save.path(), 10, State(1)).ok());
  FaultInjectionFileSystem faulty(DefaultFileSystem());
  faulty.FaultAfterBytes(64 * 64 * 4 + 1000, Action::kFail);  // Into the second shard.
  const absl::Status status = SaveThrough(&faulty, save.path(), 20, State(2));
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("injected fault"));
  EXPECT_EQ(ExpectLoadableCheckpoint(save.path(), 10, State(1), 10, State(1)), 10);
  EXPECT_TRUE(DefaultFileSystem()->IsDirectory(save.Join(".tmp_iter_0000020")));
  ExpectNextSaveSucceeds(save.path());
}

// Every operation of a save, failed in turn (in-process, so this also covers error paths
// that leave partial state behind), for a new iteration and for re-saving the current one.
TEST(CheckpointCrashTest, ErrorAtEveryOperationKeepsALoadableCheckpoint) {
  for (const int64_t iteration : {20, 10}) {
    const int64_t num_ops = CountOps(iteration);
    ASSERT_GT(num_ops, 20);
    for (int64_t k = 0; k < num_ops; ++k) {
      SCOPED_TRACE(absl::StrCat("iteration ", iteration, ", failing operation ", k));
      ScopedTempDir save;
      ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save.path(), 10, State(1)).ok());
      FaultInjectionFileSystem faulty(DefaultFileSystem());
      faulty.FaultAtOp(k, Action::kFail);
      // Commit succeeds if only the final clean-up of a replaced directory fails.
      const bool saved = SaveThrough(&faulty, save.path(), iteration, State(2)).ok();
      const int64_t found =
          ExpectLoadableCheckpoint(save.path(), 10, State(1), iteration, State(2));
      if (saved) {
        EXPECT_EQ(found, iteration);
      }
      ExpectNextSaveSucceeds(save.path());
    }
  }
}

// The --save check before training on a full disk: the probe file is created but writing
// it fails (at the append, the sync or the close, wherever the file system reports it).
// The check fails naming the directory, and the probe is gone.
TEST(CheckpointCrashTest, FailedWriteProbeLeavesNothingBehind) {
  for (const std::string kind : {"Append", "Sync", "Close"}) {
    SCOPED_TRACE(kind);
    ScopedTempDir save;
    FaultInjectionFileSystem faulty(DefaultFileSystem());
    faulty.FaultWhen([&](const Op& op) { return op.kind == kind; }, Action::kFailOnce);
    const absl::Status status = CheckSaveDirWritable(&faulty, save.path());
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()),
                ::testing::AllOf(::testing::HasSubstr("cannot save checkpoints to " + save.path()),
                                 ::testing::HasSubstr("injected fault"),
                                 ::testing::HasSubstr(kind)));
    bool created = false;
    for (const Op& op : faulty.log()) created = created || op.kind == "NewWritableFile";
    ASSERT_TRUE(created) << "the probe was never created";
    EXPECT_THAT(*DefaultFileSystem()->ListDir(save.path()), ::testing::IsEmpty());
  }
}

// Real kills. Named Slow* because they fork (see tests/CMakeLists.txt).
TEST(SlowCheckpointCrashTest, KillHalfwayThroughShardKeepsPreviousCheckpoint) {
  ScopedTempDir save;
  ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save.path(), 10, State(1)).ok());
  const uint64_t half_shard = 64 * 64 * 4 / 2;
  ASSERT_TRUE(SaveInChild(save.path(), 20, [&](FaultInjectionFileSystem& faulty) {
    faulty.FaultAfterBytes(half_shard, Action::kKill);
  }));
  // The child really died mid-write: a partial shard sits in the temp dir.
  const absl::StatusOr<uint64_t> partial =
      DefaultFileSystem()->FileSize(save.Join(".tmp_iter_0000020/pp0.safetensors"));
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_EQ(*partial, half_shard);
  EXPECT_EQ(ExpectLoadableCheckpoint(save.path(), 10, State(1), 10, State(1)), 10);
  ExpectNextSaveSucceeds(save.path());
}

TEST(SlowCheckpointCrashTest, KillRightBeforeLatestRenameKeepsPreviousCheckpoint) {
  for (const int64_t iteration : {20, 10}) {  // New iteration, then a re-save.
    SCOPED_TRACE(absl::StrCat("iteration ", iteration));
    ScopedTempDir save;
    ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save.path(), 10, State(1)).ok());
    ASSERT_TRUE(SaveInChild(save.path(), iteration, [](FaultInjectionFileSystem& faulty) {
      faulty.FaultWhen(
          [](const Op& op) { return op.kind == "RenameFile" && absl::EndsWith(op.to, "/latest"); },
          Action::kKill);
    }));
    EXPECT_TRUE(DefaultFileSystem()->FileExists(save.Join("latest.tmp")));
    EXPECT_EQ(ReadBytes(save.Join("latest")), "iter_0000010\n");
    // For the re-save, iter_0000010 already holds the new state and the old copy is
    // aside; both are complete, and `latest` (unchanged) names iter_0000010.
    ExpectLoadableCheckpoint(save.path(), 10, State(1), iteration, State(2));
    ExpectNextSaveSucceeds(save.path());
  }
}

TEST(SlowCheckpointCrashTest, KillAtEveryOperationKeepsALoadableCheckpoint) {
  for (const int64_t iteration : {20, 10}) {
    const int64_t num_ops = CountOps(iteration);
    int64_t killed = 0;
    for (int64_t k = 0; k <= num_ops; ++k) {
      SCOPED_TRACE(absl::StrCat("iteration ", iteration, ", killed at operation ", k));
      ScopedTempDir save;
      ASSERT_TRUE(SaveThrough(DefaultFileSystem(), save.path(), 10, State(1)).ok());
      const bool was_killed = SaveInChild(
          save.path(), iteration,
          [k](FaultInjectionFileSystem& faulty) { faulty.FaultAtOp(k, Action::kKill); });
      EXPECT_EQ(was_killed, k < num_ops);
      killed += was_killed;
      const int64_t found =
          ExpectLoadableCheckpoint(save.path(), 10, State(1), iteration, State(2));
      if (k == num_ops) {
        EXPECT_EQ(found, iteration);  // The save completed.
      }
      ExpectNextSaveSucceeds(save.path());
    }
    EXPECT_EQ(killed, num_ops);
  }
}

}  // namespace
}  // namespace fulcrum::ckpt
