// Sharded tensors in checkpoints (NOTE [sharded checkpoints] in
// core/checkpoint/manifest_json.h): pieces written by several writers, tiled, checked at
// Commit and Open, assembled by Read, and read piece by piece by ReadSlice.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/checkpoint/checkpoint.h"
#include "tests/core/checkpoint/test_util.h"

namespace fulcrum::ckpt {
namespace {

using ::fulcrum::testing_util::FlipByte;
using ::fulcrum::testing_util::ScopedTempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The box of `whole` at `offsets` with `extent`, as a contiguous tensor.
at::Tensor BoxOf(const at::Tensor& whole, const std::vector<int64_t>& offsets,
                 const std::vector<int64_t>& extent) {
  at::Tensor box = whole;
  for (size_t d = 0; d < offsets.size(); ++d) box = box.narrow(d, offsets[d], extent[d]);
  return box.contiguous();
}

TensorPiece BoxPiece(const std::string& name, const at::Tensor& whole,
                     std::vector<int64_t> offsets, std::vector<int64_t> extent) {
  TensorPiece piece;
  piece.name = name;
  piece.shape = whole.sizes().vec();
  piece.offsets = offsets;
  piece.tensor = BoxOf(whole, offsets, extent);
  return piece;
}

// Elements [begin, end) of the box, row-major, as a flat piece.
TensorPiece FlatPiece(const std::string& name, const at::Tensor& whole,
                      std::vector<int64_t> offsets, std::vector<int64_t> extent, int64_t begin,
                      int64_t end) {
  TensorPiece piece = BoxPiece(name, whole, offsets, extent);
  piece.box = extent;
  piece.flat = true;
  piece.flat_begin = begin;
  piece.flat_end = end;
  piece.tensor = piece.tensor.reshape({-1}).narrow(0, begin, end - begin).clone();
  return piece;
}

// A tp = 2 × dp = 2 save of a [4, 6] weight split along dimension 1 (each tp rank's box
// written by its first dp rank) and of its [4, 6] moment, each tp box cut in two flat
// ranges, one per dp rank, as a distributed optimizer owns them. Four writers, one shard
// each; `skip` names a shard whose pieces are left out.
struct ToySave {
  at::Tensor weight = torch::arange(24, torch::kFloat).reshape({4, 6});
  at::Tensor moment = torch::arange(24, torch::kFloat).reshape({4, 6}) * -0.5;
  at::Tensor step = torch::tensor(7, torch::kLong).reshape({});

  absl::Status Write(const std::string& dir, int64_t iteration, const std::string& skip = "",
                     bool overlap = false) {
    auto writer = CheckpointWriter::Begin(DefaultFileSystem(), dir, iteration);
    if (!writer.ok()) return writer.status();
    for (int tp = 0; tp < 2; ++tp) {
      for (int dp = 0; dp < 2; ++dp) {
        const std::string shard = "tp" + std::to_string(tp) + "_dp" + std::to_string(dp);
        if (shard == skip) continue;
        std::vector<std::pair<std::string, at::Tensor>> whole;
        std::vector<TensorPiece> pieces;
        const std::vector<int64_t> offsets{0, 3 * tp}, extent{4, 3};
        if (dp == 0) pieces.push_back(BoxPiece("w", weight, offsets, extent));
        if (dp == 0 && tp == 0) whole.emplace_back("step", step);
        const int64_t begin = dp == 0 ? 0 : (overlap ? 5 : 6);
        const int64_t end = dp == 0 ? 6 : 12;
        pieces.push_back(FlatPiece("m", moment, offsets, extent, begin, end));
        if (absl::Status s = writer->WriteShard(shard, whole, pieces); !s.ok()) return s;
      }
    }
    return writer->Commit(nlohmann::json::object());
  }
};

TEST(ShardedCheckpointTest, PiecesFromFourWritersAssembleBitForBit) {
  ScopedTempDir dir;
  ToySave save;
  ASSERT_TRUE(save.Write(dir.path(), 10).ok());
  auto reader = CheckpointReader::Open(DefaultFileSystem(), dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  // The reader's names are the whole tensors, never the stored pieces.
  EXPECT_THAT(reader->names(), ElementsAre("m", "step", "w"));
  EXPECT_TRUE(reader->Has("w"));
  EXPECT_FALSE(reader->Has(PieceStoredName("w", "tp0_dp0")));
  EXPECT_EQ(reader->entries().size(), 7u);  // 2 weight boxes + 4 moment ranges + step
  EXPECT_EQ(reader->manifest()["format_version"], kManifestFormatVersion);  // 3: has pieces
  auto w = reader->Read("w");
  auto m = reader->Read("m");
  ASSERT_TRUE(w.ok() && m.ok());
  EXPECT_TRUE(torch::equal(*w, save.weight));
  EXPECT_TRUE(torch::equal(*m, save.moment));
  auto described = reader->Describe("m");
  ASSERT_TRUE(described.ok());
  EXPECT_EQ(described->first, at::kFloat);
  EXPECT_THAT(described->second, ElementsAre(4, 6));
  // A slice across both boxes, and each rank's own.
  auto across = reader->ReadSlice("m", 1, 2, 3);
  ASSERT_TRUE(across.ok()) << across.status();
  EXPECT_TRUE(torch::equal(*across, save.moment.narrow(1, 2, 3)));
  auto rows = reader->ReadSlice("w", 0, 1, 2);  // along the other dimension
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_TRUE(torch::equal(*rows, save.weight.narrow(0, 1, 2)));
  auto whole_slice = reader->ReadSlice("step", 0, 0, 1);
  EXPECT_FALSE(whole_slice.ok());  // a scalar has no dimension 0
  EXPECT_TRUE(reader->VerifyAll().ok());
}

// ReadSlice reads only the pieces its slice overlaps: with tp rank 1's weight box damaged,
// tp rank 0's shard still reads, while rank 1's shard and the whole tensor are refused.
TEST(ShardedCheckpointTest, ASliceReadsOnlyThePiecesItOverlaps) {
  ScopedTempDir dir;
  ToySave save;
  ASSERT_TRUE(save.Write(dir.path(), 10).ok());
  // tp1_dp0.safetensors holds the weight box (48 bytes) and a moment range (24 bytes), in
  // either order: the 25th byte from the end is the box's.
  FlipByte(dir.Join("iter_0000010/tp1_dp0.safetensors"), -25);
  auto reader = CheckpointReader::Open(DefaultFileSystem(), dir.path());
  ASSERT_TRUE(reader.ok());
  auto own = reader->ReadSlice("w", 1, 0, 3);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_TRUE(torch::equal(*own, save.weight.narrow(1, 0, 3)));
  auto other = reader->ReadSlice("w", 1, 3, 3);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kDataLoss) << other.status();
  EXPECT_THAT(other.status().message(), HasSubstr("w@tp1_dp0"));
  EXPECT_EQ(reader->Read("w").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(reader->Read("m").ok());  // the other tensor in that file is intact
}

TEST(ShardedCheckpointTest, AMissingPieceFailsTheCommitAndLeavesNoCheckpoint) {
  ScopedTempDir dir;
  ToySave save;
  const absl::Status status = save.Write(dir.path(), 10, /*skip=*/"tp1_dp1");
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("sharded tensor 'm'"));
  EXPECT_THAT(status.message(), HasSubstr("no piece for its elements from 6"));
  EXPECT_FALSE(DefaultFileSystem()->FileExists(dir.Join("latest")));
  EXPECT_FALSE(CheckpointReader::Open(DefaultFileSystem(), dir.path()).ok());
}

TEST(ShardedCheckpointTest, OverlappingPiecesFailTheCommit) {
  ScopedTempDir dir;
  ToySave save;
  const absl::Status status = save.Write(dir.path(), 10, "", /*overlap=*/true);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("two pieces of its elements from 5"));
}

TEST(ShardedCheckpointTest, AMissingBoxIsNamedByTheCountOfElementsHeld) {
  ScopedTempDir dir;
  auto writer = CheckpointWriter::Begin(DefaultFileSystem(), dir.path(), 1);
  ASSERT_TRUE(writer.ok());
  const at::Tensor w = torch::ones({4, 6});
  ASSERT_TRUE(writer->WriteShard("tp0", {}, {BoxPiece("w", w, {0, 0}, {4, 3})}).ok());
  const absl::Status status = writer->Commit(nlohmann::json::object());
  EXPECT_THAT(status.message(), HasSubstr("its pieces hold 12 of its 24 elements"));
}

TEST(ShardedCheckpointTest, APieceOutsideItsWholeIsRefusedWhenWritten) {
  ScopedTempDir dir;
  auto writer = CheckpointWriter::Begin(DefaultFileSystem(), dir.path(), 1);
  ASSERT_TRUE(writer.ok());
  TensorPiece piece = BoxPiece("w", torch::ones({4, 6}), {0, 3}, {4, 3});
  piece.offsets = {0, 4};  // 4 + 3 > 6
  const absl::Status status = writer->WriteShard("tp1", {}, {piece});
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(status.message(), HasSubstr("leaves the shape [4,6] along dimension 1"));
}

// A 0-dim tensor whose optimizer state one rank owns: a flat piece [0, 1) of an empty box
// (a scalar parameter under the distributed optimizer, e.g. the cosine router's
// temperature).
TEST(ShardedCheckpointTest, AScalarIsOneFlatPieceOfAnEmptyBox) {
  ScopedTempDir dir;
  auto writer = CheckpointWriter::Begin(DefaultFileSystem(), dir.path(), 1);
  ASSERT_TRUE(writer.ok());
  TensorPiece piece;
  piece.name = "s";
  piece.flat = true;
  piece.flat_begin = 0;
  piece.flat_end = 1;
  piece.tensor = torch::full({1}, 2.5f);
  ASSERT_TRUE(writer->WriteShard("dp1", {}, {piece}).ok());
  ASSERT_TRUE(writer->Commit(nlohmann::json::object()).ok());
  auto reader = CheckpointReader::Open(DefaultFileSystem(), dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto s = reader->Read("s");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dim(), 0);
  EXPECT_EQ(s->item<float>(), 2.5f);
}

// A manifest whose pieces were edited after the save is refused at Open (its checksum
// catches any edit; with the checksum recomputed, the tiling check still does).
TEST(ShardedCheckpointTest, OpenChecksTheTilingOfAManifestItReads) {
  ScopedTempDir dir;
  ToySave save;
  ASSERT_TRUE(save.Write(dir.path(), 10).ok());
  const std::string path = dir.Join("iter_0000010/manifest.json");
  nlohmann::json manifest = nlohmann::json::parse(testing_util::ReadBytes(path));
  manifest["pieces"][PieceStoredName("m", "tp0_dp1")]["flat"] = {7, 12};
  manifest[kManifestChecksumKey] = ManifestChecksum(manifest);
  testing_util::WriteBytes(path, manifest.dump());
  auto reader = CheckpointReader::Open(DefaultFileSystem(), dir.path());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(reader.status().message(), HasSubstr("stored as shape [6] but the piece is [5]"));
}

}  // namespace
}  // namespace fulcrum::ckpt
