// Runs the built fulcrum_ckpt binary on good and damaged checkpoints and checks its output
// and exit codes (0 ok, 1 damaged or missing, 2 wrong usage).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/checkpoint/checkpoint.h"
#include "tests/core/checkpoint/test_util.h"
#include "tests/run_command.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::FlipByte;
using ::fulcrum::testing_util::ReadBytes;
using ::fulcrum::testing_util::WriteBytes;
using ::fulcrum::testing_util::ScopedTempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together.
};

const std::string& ToolPath() {
  static const std::string path = std::string(FULCRUM_BIN_DIR) + "/fulcrum_ckpt";
  return path;
}

RunResult RunTool(const std::string& args) {
  RunResult result;
  result.exit_code = fulcrum::testing::RunCommand(ToolPath() + " " + args, &result.output);
  return result;
}

class CkptToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A missing tool fails every test here (a skip would pass them vacuously).
    ASSERT_TRUE(DefaultFileSystem()->FileExists(ToolPath()))
        << ToolPath() << " is not built (ninja fulcrum_ckpt)";
    absl::StatusOr<CheckpointWriter> writer =
        CheckpointWriter::Begin(DefaultFileSystem(), save_.path(), 20);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(writer
                    ->WriteShard("model", {{"layers.0.mlp.fc1.weight", torch::ones({4, 3})},
                                           {"optimizer.layers.0.mlp.fc1.weight.exp_avg",
                                            torch::zeros({4, 3})},
                                           {"optimizer.step", torch::tensor(int64_t{20})}})
                    .ok());
    ASSERT_TRUE(writer->Commit({{"consumed_samples", 640}, {"config", {{"hidden_size", 3}}}}).ok());
  }

  ScopedTempDir save_;
};

TEST_F(CkptToolTest, ListPrintsFieldsTableAndTotals) {
  const RunResult result = RunTool("list " + save_.path());
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output,
              AllOf(HasSubstr("iteration:  20"), HasSubstr("consumed_samples: 640"),
                    HasSubstr(R"(config: {"hidden_size":3})"), HasSubstr("layers.0.mlp.fc1.weight"),
                    HasSubstr("[4, 3]"), HasSubstr("model.safetensors"),
                    HasSubstr("total: 3 tensors, 12 parameters, 13 optimizer-state elements"),
                    HasSubstr("104 bytes, 1 shard files")));
}

TEST_F(CkptToolTest, VerifyReportsOkThenCorruption) {
  RunResult result = RunTool("verify " + save_.path());
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("OK: 3 tensors"));

  FlipByte(save_.Join("iter_0000020/model.safetensors"), -1);
  result = RunTool("verify " + save_.Join("iter_0000020"));
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, AllOf(HasSubstr("FAILED"), HasSubstr("checksum mismatch")));

  ::fulcrum::testing_util::TruncateTo(save_.Join("iter_0000020/model.safetensors"), 50);
  result = RunTool("verify " + save_.path());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, AllOf(HasSubstr("model.safetensors"), HasSubstr("truncated")));
}

TEST_F(CkptToolTest, VerifyCatchesAnEditedManifest) {
  // The issue's check: one field changed by hand, in a checkpoint whose tensors are intact.
  const std::string manifest_path = save_.Join("iter_0000020/manifest.json");
  std::string text = ReadBytes(manifest_path);
  const size_t at = text.find("\"consumed_samples\": 640");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, std::string("\"consumed_samples\": 640").size(), "\"consumed_samples\": 64");
  WriteBytes(manifest_path, text);
  const RunResult result = RunTool("verify " + save_.path());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output, AllOf(HasSubstr("FAILED"), HasSubstr("manifest.json"),
                                   HasSubstr("the manifest was changed after it was written")));
}

// The issue's bypass: format_version set to 1 (before manifest checksums), the checksum
// deleted and a field edited. `verify` fails it unless told to accept an unchecksummed
// manifest, and then says what it could not check; `show` displays it either way.
TEST_F(CkptToolTest, VerifyFailsAManifestWithoutChecksumUnlessAllowed) {
  const std::string manifest_path = save_.Join("iter_0000020/manifest.json");
  nlohmann::json manifest = nlohmann::json::parse(ReadBytes(manifest_path));
  manifest["format_version"] = 1;
  manifest.erase(kManifestChecksumKey);
  manifest["consumed_samples"] = 64;
  WriteBytes(manifest_path, manifest.dump(2));

  RunResult result = RunTool("verify " + save_.path());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_THAT(result.output,
              AllOf(HasSubstr("FAILED"), HasSubstr("manifest.json: format_version 1 predates "
                                                   "manifest checksums"),
                    HasSubstr("--allow_unchecksummed_manifest"),
                    // "OK:" with the colon: the temp directory's random name, printed in
                    // the output, can itself contain "OK" (CI failed on that once).
                    Not(HasSubstr("OK:"))));

  result = RunTool("verify " + save_.path() + " --allow_unchecksummed_manifest");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, AllOf(HasSubstr("OK: 3 tensors"),
                                   HasSubstr("the manifest itself has no checksum")));

  result = RunTool("show " + save_.path() + " --key=consumed_samples");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("64\n"));
  EXPECT_EQ(RunTool("list " + save_.path() + " --allow_unchecksummed_manifest").exit_code, 2);
}

TEST_F(CkptToolTest, ShowPrintsOneField) {
  RunResult result = RunTool("show " + save_.path() + " --key=iteration");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output, "20\n");
  result = RunTool("show " + save_.path() + " --key=/config/hidden_size");
  EXPECT_EQ(result.output, "3\n");
  result = RunTool("show " + save_.path());
  EXPECT_EQ(result.exit_code, 0);
  // Every field but the tensor table (and so no tensor checksums).
  EXPECT_THAT(result.output, AllOf(HasSubstr("\"consumed_samples\": 640"),
                                   HasSubstr("\"manifest_xxh3\""), Not(HasSubstr("\"tensors\"")),
                                   Not(HasSubstr("\"xxh3\""))));
  result = RunTool("show " + save_.path() + " --key=nope");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.output, HasSubstr("no field 'nope'"));
}

// shard cuts every tensor of at least --pieces elements into that many files; list shows
// the whole tensors with their piece counts; consolidate makes them whole again, the same
// bits and manifest fields as the original.
TEST_F(CkptToolTest, ShardThenConsolidateRoundTripsEveryTensor) {
  ScopedTempDir out;
  const std::string sharded = out.Join("sharded");
  const std::string whole = out.Join("whole");
  RunResult result = RunTool("shard --pieces=3 " + save_.path() + " " + sharded);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("(3 pieces)"));
  auto reader = CheckpointReader::Open(DefaultFileSystem(), sharded);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->sharded().size(), 2u);  // the scalar step stays whole
  EXPECT_EQ(reader->manifest()["files"].size(), 3u);
  EXPECT_EQ(reader->iteration(), 20);
  EXPECT_EQ(reader->manifest()["consumed_samples"], 640);
  result = RunTool("list " + sharded);
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, AllOf(HasSubstr("3 pieces"), HasSubstr("total: 3 tensors"),
                                   HasSubstr("3 shard files (2 tensors stored as pieces)")));
  EXPECT_THAT(result.output, Not(HasSubstr("@piece_")));
  result = RunTool("verify " + sharded);
  EXPECT_EQ(result.exit_code, 0) << result.output;

  result = RunTool("consolidate " + sharded + " " + whole);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  auto original = CheckpointReader::Open(DefaultFileSystem(), save_.path());
  auto rebuilt = CheckpointReader::Open(DefaultFileSystem(), whole);
  ASSERT_TRUE(original.ok() && rebuilt.ok());
  EXPECT_TRUE(rebuilt->sharded().empty());
  EXPECT_EQ(rebuilt->names(), original->names());
  for (const std::string& name : original->names()) {
    EXPECT_TRUE(torch::equal(*rebuilt->Read(name), *original->Read(name))) << name;
  }
  EXPECT_EQ(rebuilt->manifest()["config"], original->manifest()["config"]);

  // Into a directory that holds something: refused (2), nothing written.
  result = RunTool("consolidate " + sharded + " " + whole);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("is not an empty directory"));
  result = RunTool("shard --pieces=0 " + save_.path() + " " + out.Join("zero"));
  EXPECT_EQ(result.exit_code, 2) << result.output;
  result = RunTool("consolidate --pieces=2 " + sharded + " " + out.Join("x"));
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_THAT(result.output, HasSubstr("--pieces only applies to `shard`"));
}

TEST_F(CkptToolTest, WrongUsageExitsTwoAndMissingCheckpointOne) {
  EXPECT_EQ(RunTool("").exit_code, 2);
  EXPECT_EQ(RunTool("frobnicate " + save_.path()).exit_code, 2);
  EXPECT_EQ(RunTool("list " + save_.path() + " --key=iteration").exit_code, 2);
  EXPECT_EQ(RunTool("list " + save_.path() + " --frobnicate").exit_code, 2);
  const RunResult help = RunTool("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.output, AllOf(HasSubstr("verify PATH"), HasSubstr("--key")));
  const RunResult missing = RunTool("list " + save_.Join("empty"));
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.output, HasSubstr("no checkpoint at"));
}

}  // namespace
}  // namespace fulcrum::ckpt
