#include "core/checkpoint/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <limits>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tests/core/checkpoint/test_util.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::FlipByte;
using ::fulcrum::testing_util::ReadBytes;
using ::fulcrum::testing_util::ScopedTempDir;
using ::fulcrum::testing_util::TruncateTo;
using ::fulcrum::testing_util::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

FileSystem* fs() { return DefaultFileSystem(); }

// Model and optimizer state of a two-layer toy model; `seed` makes saves distinguishable.
NamedTensors ToyState(int seed) {
  torch::manual_seed(seed);
  return {
      {"embedding.weight", torch::randn({16, 8})},
      {"layers.0.attention.qkv.weight", torch::randn({24, 8}).to(torch::kBFloat16)},
      {"layers.1.mlp.fc1.weight", torch::randn({32, 8}).to(torch::kHalf)},
      {"optimizer.layers.0.attention.qkv.weight.exp_avg", torch::randn({24, 8})},
      {"optimizer.step", torch::tensor(seed, torch::kLong).reshape({})},
  };
}

nlohmann::json ToyFields(int64_t iteration) {
  return {{"iteration", iteration},
          {"consumed_samples", iteration * 32},
          {"rng", {{"seed", 1234}, {"offset", iteration}}},
          {"config", {{"num_layers", 2}, {"hidden_size", 8}}},
          {"layer_placement", {{0, 1}, {1, 2}}}};
}

absl::Status Save(FileSystem* file_system, const std::string& save_dir, int64_t iteration,
                  const NamedTensors& tensors) {
  absl::StatusOr<CheckpointWriter> writer =
      CheckpointWriter::Begin(file_system, save_dir, iteration);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->WriteShard("model", tensors); !s.ok()) return s;
  return writer->Commit(ToyFields(iteration));
}

void ExpectHolds(const CheckpointReader& reader, const NamedTensors& tensors) {
  ASSERT_EQ(reader.names().size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    SCOPED_TRACE(name);
    absl::StatusOr<at::Tensor> actual = reader.Read(name);
    ASSERT_TRUE(actual.ok()) << actual.status();
    EXPECT_EQ(actual->scalar_type(), expected.scalar_type());
    EXPECT_TRUE(actual->equal(expected));
  }
}

std::string Latest(const std::string& save_dir) {
  return ReadBytes(JoinPath(save_dir, kLatestFileName));
}

TEST(IterationDirNameTest, SevenDigitsLikeMegatron) {
  EXPECT_EQ(IterationDirName(20), "iter_0000020");
  EXPECT_EQ(IterationDirName(0), "iter_0000000");
  EXPECT_EQ(IterationDirName(123456789), "iter_123456789");
  EXPECT_EQ(ParseIterationDirName("iter_0000020"), 20);
  EXPECT_EQ(ParseIterationDirName("iter_123456789"), 123456789);
  for (const char* bad : {"iter_20", "iter_00000020", ".tmp_iter_0000020", "iter_00000a0",
                          "../iter_0000020", "iter_0000020/", "latest"}) {
    EXPECT_EQ(ParseIterationDirName(bad), std::nullopt) << bad;
  }
}

TEST(CheckpointTest, RoundTripsTensorsAndManifestFields) {
  ScopedTempDir save;
  const NamedTensors state = ToyState(1);
  ASSERT_TRUE(Save(fs(), save.path(), 20, state).ok());

  EXPECT_EQ(Latest(save.path()), "iter_0000020\n");
  EXPECT_THAT(*fs()->ListDir(save.path()), ElementsAre("iter_0000020", "latest"));
  EXPECT_THAT(*fs()->ListDir(save.Join("iter_0000020")),
              ElementsAre("manifest.json", "model.index.json", "model.safetensors"));

  for (const std::string& path : {save.path(), save.Join("iter_0000020")}) {
    SCOPED_TRACE(path);
    absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(path);
    ASSERT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ(reader->dir(), save.Join("iter_0000020"));
    EXPECT_EQ(reader->iteration(), 20);
    ExpectHolds(*reader, state);
    EXPECT_TRUE(reader->VerifyAll().ok());
    const nlohmann::json& manifest = reader->manifest();
    const nlohmann::json fields = ToyFields(20);
    for (const auto& [key, value] : fields.items()) EXPECT_EQ(manifest.at(key), value) << key;
    // No pieces: format 2, which builds before sharded checkpoints read.
    EXPECT_EQ(manifest["format_version"], 2);
    const nlohmann::json& row = manifest["tensors"]["layers.0.attention.qkv.weight"];
    EXPECT_EQ(row["file"], "model.safetensors");
    EXPECT_EQ(row["dtype"], "BF16");
    EXPECT_EQ(row["shape"], nlohmann::json({24, 8}));
    EXPECT_EQ(row["xxh3"].get<std::string>().size(), 16u);
    EXPECT_TRUE(reader->Has("optimizer.step"));
    EXPECT_FALSE(reader->Has("layers.2.mlp.fc1.weight"));
    EXPECT_EQ(reader->Read("layers.2.mlp.fc1.weight").status().code(), absl::StatusCode::kNotFound);
  }
}

TEST(CheckpointTest, LaterSaveMovesLatestAndKeepsEarlierCheckpoint) {
  ScopedTempDir save;
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(1)).ok());
  ASSERT_TRUE(Save(fs(), save.path(), 40, ToyState(2)).ok());
  EXPECT_EQ(Latest(save.path()), "iter_0000040\n");
  absl::StatusOr<CheckpointReader> latest = CheckpointReader::Open(save.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->iteration(), 40);
  ExpectHolds(*latest, ToyState(2));
  absl::StatusOr<CheckpointReader> earlier = CheckpointReader::Open(save.Join("iter_0000020"));
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  ExpectHolds(*earlier, ToyState(1));
}

TEST(CheckpointTest, ResavingTheSameIterationReplacesIt) {
  ScopedTempDir save;
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(1)).ok());
  ASSERT_TRUE(Save(fs(), save.path(), 40, ToyState(2)).ok());
  // Resumed from 20 and saved 20 again: the new contents win and `latest` follows.
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(3)).ok());
  EXPECT_EQ(Latest(save.path()), "iter_0000020\n");
  EXPECT_THAT(*fs()->ListDir(save.path()), ElementsAre("iter_0000020", "iter_0000040", "latest"));
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectHolds(*reader, ToyState(3));
}

TEST(CheckpointTest, ShardsFromSeveralWritersMergeIntoOneManifest) {
  ScopedTempDir save;
  const NamedTensors state = ToyState(5);
  // As three ranks would: rank 0 begins; ranks 1 and 2 join; each writes its own shard;
  // rank 2 commits.
  absl::StatusOr<CheckpointWriter> rank0 = CheckpointWriter::Begin(fs(), save.path(), 7);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  absl::StatusOr<CheckpointWriter> rank1 = CheckpointWriter::Join(fs(), save.path(), 7);
  absl::StatusOr<CheckpointWriter> rank2 = CheckpointWriter::Join(fs(), save.path(), 7);
  ASSERT_TRUE(rank1.ok() && rank2.ok());
  ASSERT_TRUE(rank0->WriteShard("pp0", {state[0], state[1]}).ok());
  ASSERT_TRUE(rank1->WriteShard("pp1", {state[2], state[3]}).ok());
  ASSERT_TRUE(rank2->WriteShard("pp1_extra", {state[4]}).ok());
  ASSERT_TRUE(rank2->Commit({{"layer_placement", {{0, 1}, {1, 2}}}}).ok());

  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 7);
  ExpectHolds(*reader, state);
  EXPECT_EQ(reader->manifest()["files"].size(), 3u);
  EXPECT_EQ(reader->entries().at("layers.1.mlp.fc1.weight").file, "pp1.safetensors");
  EXPECT_EQ(reader->entries().at("optimizer.step").file, "pp1_extra.safetensors");
  EXPECT_TRUE(reader->VerifyAll().ok());
}

TEST(CheckpointTest, WriterRejectsMisuse) {
  ScopedTempDir save;
  EXPECT_EQ(CheckpointWriter::Join(fs(), save.path(), 3).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(CheckpointWriter::Begin(fs(), save.path(), -1).ok());

  absl::StatusOr<CheckpointWriter> writer = CheckpointWriter::Begin(fs(), save.path(), 3);
  ASSERT_TRUE(writer.ok());
  EXPECT_EQ(writer->Commit({}).code(), absl::StatusCode::kFailedPrecondition);  // No shard.
  for (const char* bad : {"", ".hidden", "a/b", "..", "x y"}) {
    EXPECT_FALSE(writer->WriteShard(bad, ToyState(1)).ok()) << bad;
  }
  ASSERT_TRUE(writer->WriteShard("a", {{"w", torch::ones({2})}}).ok());
  EXPECT_FALSE(writer->WriteShard("a", {{"v", torch::ones({2})}}).ok());
  ASSERT_TRUE(writer->WriteShard("b", {{"w", torch::ones({2})}}).ok());
  EXPECT_THAT(std::string(writer->Commit({}).message()),
              AllOf(HasSubstr("'w' is in two checkpoint shards"), HasSubstr("a.index.json"),
                    HasSubstr("b.index.json")));
  ASSERT_TRUE(fs()->DeleteRecursively(JoinPath(writer->temp_dir(), "b.index.json")).ok());
  EXPECT_THAT(std::string(writer->Commit({{"tensors", 1}}).message()),
              HasSubstr("'tensors' is reserved"));
  EXPECT_THAT(std::string(writer->Commit({{"iteration", 4}}).message()), HasSubstr("iteration 3"));
  EXPECT_FALSE(writer->Commit(nlohmann::json::array()).ok());
  // Nothing was committed by the failed attempts.
  EXPECT_FALSE(fs()->FileExists(save.Join("latest")));
  EXPECT_TRUE(writer->Commit({{"iteration", 3}}).ok());
  EXPECT_FALSE(writer->Commit({}).ok());
  EXPECT_FALSE(writer->WriteShard("c", {}).ok());
}

TEST(CheckpointTest, ReadAndVerifyAllDetectFlippedByte) {
  ScopedTempDir save;
  const NamedTensors state = ToyState(1);
  ASSERT_TRUE(Save(fs(), save.path(), 20, state).ok());
  const std::string shard = save.Join("iter_0000020/model.safetensors");
  // The last tensor in the file (optimizer.step is the only 8-byte tensor, so it is first;
  // the last is a 2-byte one): flip its final byte.
  FlipByte(shard, -1);

  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();  // Sizes and headers are still fine.
  std::string corrupted;
  for (const auto& [name, tensor] : state) {
    const absl::StatusOr<at::Tensor> read = reader->Read(name);
    if (read.ok()) continue;
    EXPECT_TRUE(corrupted.empty()) << "only one tensor was damaged";
    corrupted = name;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(read.status().message()),
                AllOf(HasSubstr("checksum mismatch for tensor '" + name + "'"), HasSubstr(shard)));
  }
  EXPECT_EQ(corrupted, "layers.1.mlp.fc1.weight");  // F16 sorts after BF16 by name.
  const absl::Status verify = reader->VerifyAll();
  EXPECT_EQ(verify.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(verify.message()),
              AllOf(HasSubstr("1 of 5 tensors"), HasSubstr(corrupted)));
}

TEST(CheckpointTest, OpenRejectsTruncatedShardAndCorruptManifest) {
  ScopedTempDir save;
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(1)).ok());
  const std::string dir = save.Join("iter_0000020");
  const std::string shard = JoinPath(dir, "model.safetensors");
  const std::string original = ReadBytes(shard);
  TruncateTo(shard, original.size() / 2);
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(shard), HasSubstr("truncated")));

  ASSERT_TRUE(fs()->DeleteRecursively(shard).ok());
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(shard), HasSubstr("is missing")));
  WriteBytes(shard, original);
  ASSERT_TRUE(CheckpointReader::Open(save.path()).ok());

  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  const std::string manifest = ReadBytes(manifest_path);
  WriteBytes(manifest_path, manifest.substr(0, manifest.size() / 2));
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(manifest_path), HasSubstr("not valid JSON")));

  // Any edit of a field is caught by the manifest's own checksum (NOTE [manifest checksum]);
  // re-indenting is not an edit.
  nlohmann::json edited = nlohmann::json::parse(manifest);
  WriteBytes(manifest_path, edited.dump(4));
  EXPECT_TRUE(CheckpointReader::Open(save.path()).ok());
  edited["consumed_samples"] = 12345;
  WriteBytes(manifest_path, edited.dump(1));
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(manifest_path), HasSubstr("the manifest was changed after it was written")));
  edited.erase(kManifestChecksumKey);
  WriteBytes(manifest_path, edited.dump(1));
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              HasSubstr("missing string field 'manifest_xxh3'"));

  // Claiming the format before checksums does not get around it: format 1 is read only
  // when the caller allows it, and then the reader says its fields were not verified.
  edited["format_version"] = 1;
  WriteBytes(manifest_path, edited.dump(1));
  absl::StatusOr<CheckpointReader> unchecked = CheckpointReader::Open(save.path());
  EXPECT_EQ(unchecked.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(unchecked.status().message()),
              AllOf(HasSubstr(manifest_path), HasSubstr("format_version 1 predates manifest checksums"),
                    HasSubstr("--allow_unchecksummed_manifest")));
  CheckpointReadOptions allow;
  allow.allow_unchecksummed_manifest = true;
  unchecked = CheckpointReader::Open(save.path(), allow);
  ASSERT_TRUE(unchecked.ok()) << unchecked.status();
  EXPECT_FALSE(unchecked->manifest_checksummed());
  EXPECT_EQ(unchecked->manifest()["consumed_samples"], 12345);
  EXPECT_TRUE(CheckpointReader::Open(save.path(), allow).ok());
  edited["format_version"] = 0;
  WriteBytes(manifest_path, edited.dump(1));
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path(), allow).status().message()),
              HasSubstr("format_version 0 is not a format version (1 or more)"));
  WriteBytes(manifest_path, manifest);
  absl::StatusOr<CheckpointReader> checked = CheckpointReader::Open(save.path());
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_TRUE(checked->manifest_checksummed());

  // Nested a million levels deep, a manifest overflowed the stack when it was copied for
  // its checksum (NOTE [JSON nesting limit]); now it is refused before it is parsed.
  std::string deep = manifest;
  deep.insert(deep.find('{') + 1,
              "\"deep\":" + std::string(1'000'000, '[') + std::string(1'000'000, ']') + ",");
  WriteBytes(manifest_path, deep);
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(manifest_path), HasSubstr("JSON nests more than 64 levels deep")));

  // A format_version past int64 wrapped around to -1, an old format read without its
  // checksum (seen while making the parser a function for tests/fuzz).
  edited = nlohmann::json::parse(manifest);
  edited["format_version"] = std::numeric_limits<uint64_t>::max();
  WriteBytes(manifest_path, edited.dump());
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              HasSubstr("format_version 18446744073709551615 is newer than this build"));
  edited["format_version"] = 0;
  WriteBytes(manifest_path, edited.dump());
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              HasSubstr("format_version 0 is not a format version (1 or more)"));
  WriteBytes(manifest_path, manifest);

  // A manifest row that disagrees with the shard header (checksummed anew, as a tool that
  // rewrites manifests would): the header check still catches it.
  edited = nlohmann::json::parse(manifest);
  edited["tensors"]["embedding.weight"]["shape"] = {8, 16};
  edited[kManifestChecksumKey] = ManifestChecksum(edited);
  WriteBytes(manifest_path, edited.dump());
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              AllOf(HasSubstr(shard), HasSubstr("'embedding.weight'"), HasSubstr("[8, 16]")));
}

TEST(CheckpointTest, OpenExplainsMissingCheckpoints) {
  ScopedTempDir save;
  EXPECT_EQ(CheckpointReader::Open(save.path()).status().message(),
            "no checkpoint in " + save.path() + ": " + save.Join("latest") +
                " is missing and there is no iter_* directory");
  EXPECT_EQ(CheckpointReader::Open(save.Join("nope")).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(fs()->CreateDir(save.Join("iter_0000005")).ok());
  EXPECT_THAT(std::string(CheckpointReader::Open(save.Join("iter_0000005")).status().message()),
              HasSubstr("manifest.json is missing"));
  WriteBytes(save.Join("latest"), "iter_0000009\n");
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              HasSubstr("names iter_0000009 but"));
  WriteBytes(save.Join("latest"), "../../etc\n");
  EXPECT_THAT(std::string(CheckpointReader::Open(save.path()).status().message()),
              HasSubstr("expected a directory name like iter_0000020"));
}

TEST(CheckpointTest, MissingLatestFallsBackToNewestCompleteCheckpoint) {
  ScopedTempDir save;
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(1)).ok());
  ASSERT_TRUE(Save(fs(), save.path(), 40, ToyState(2)).ok());
  ASSERT_TRUE(fs()->CreateDir(save.Join("iter_0000060")).ok());  // Incomplete: ignored.
  ASSERT_TRUE(fs()->DeleteRecursively(save.Join("latest")).ok());
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->iteration(), 40);
}

// The state a crash leaves between the two renames of a re-save: `latest` names iter_N,
// which is missing; the complete old copy sits at .old_iter_N.
TEST(CheckpointTest, InterruptedResaveIsReadableAndRepairedByNextBegin) {
  ScopedTempDir save;
  ASSERT_TRUE(Save(fs(), save.path(), 20, ToyState(1)).ok());
  ASSERT_TRUE(fs()->RenameFile(save.Join("iter_0000020"), save.Join(".old_iter_0000020")).ok());
  ASSERT_TRUE(fs()->CreateDir(save.Join(".tmp_iter_0000020")).ok());

  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  ExpectHolds(*reader, ToyState(1));

  ASSERT_TRUE(CheckpointWriter::Begin(fs(), save.path(), 30).ok());
  EXPECT_THAT(*fs()->ListDir(save.path()),
              ElementsAre(".tmp_iter_0000030", "iter_0000020", "latest"));
  reader = CheckpointReader::Open(save.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->dir(), save.Join("iter_0000020"));
}

}  // namespace
}  // namespace fulcrum::ckpt
