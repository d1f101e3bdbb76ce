#include "core/file_system.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/core/checkpoint/test_util.h"

namespace fulcrum {
namespace {

using ::fulcrum::testing_util::ReadBytes;
using ::fulcrum::testing_util::ScopedTempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PathTest, JoinDirNameBaseName) {
  EXPECT_EQ(JoinPath("a", "b"), "a/b");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  EXPECT_EQ(JoinPath("a", "/b"), "a/b");
  EXPECT_EQ(JoinPath("", "b"), "b");
  EXPECT_EQ(DirName("a/b/c"), "a/b");
  EXPECT_EQ(DirName("a/b/"), "a");
  EXPECT_EQ(DirName("c"), ".");
  EXPECT_EQ(DirName("/c"), "/");
  EXPECT_EQ(BaseName("a/b/"), "b");
  EXPECT_EQ(BaseName("c"), "c");
  EXPECT_EQ(BaseName("/"), "/");
}

TEST(PosixFileSystemTest, WritesReadsListsRenamesAndDeletes) {
  ScopedTempDir dir;
  FileSystem* fs = DefaultFileSystem();
  const std::string nested = dir.Join("x/y/z");
  ASSERT_TRUE(fs->CreateDir(nested).ok());
  ASSERT_TRUE(fs->CreateDir(nested).ok());  // Already there: fine.
  EXPECT_TRUE(fs->IsDirectory(nested));

  // Larger than the write buffer, in pieces of both kinds, so both paths of Append run.
  const std::string big(600 << 10, 'b');
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs->NewWritableFile(dir.Join("x/f"));
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE((*file)->Append("head:").ok());
  ASSERT_TRUE((*file)->Append(big).ok());
  ASSERT_TRUE((*file)->Append(":tail").ok());
  ASSERT_TRUE((*file)->Sync().ok());
  ASSERT_TRUE((*file)->Close().ok());
  EXPECT_FALSE((*file)->Append("late").ok());
  const std::string expected = "head:" + big + ":tail";
  EXPECT_EQ(*fs->FileSize(dir.Join("x/f")), expected.size());
  EXPECT_EQ(*fs->ReadFile(dir.Join("x/f")), expected);
  absl::StatusOr<std::unique_ptr<ReadOnlyMemoryRegion>> region =
      fs->NewReadOnlyMemoryRegion(dir.Join("x/f"));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->bytes(), expected);

  ASSERT_TRUE(WriteStringToFile(fs, dir.Join("x/empty"), "").ok());
  region = fs->NewReadOnlyMemoryRegion(dir.Join("x/empty"));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->size(), 0u);

  EXPECT_THAT(*fs->ListDir(dir.Join("x")), ElementsAre("empty", "f", "y"));
  // Directories rename too (what a checkpoint commit relies on).
  ASSERT_TRUE(fs->RenameFile(dir.Join("x/y"), dir.Join("x/w")).ok());
  EXPECT_TRUE(fs->IsDirectory(dir.Join("x/w/z")));
  ASSERT_TRUE(fs->SyncDir(dir.Join("x")).ok());

  ASSERT_TRUE(fs->DeleteRecursively(dir.Join("x")).ok());
  EXPECT_FALSE(fs->FileExists(dir.Join("x")));
  EXPECT_TRUE(fs->DeleteRecursively(dir.Join("x")).ok());  // Already gone: fine.
}

TEST(PosixFileSystemTest, WriteFileAtomicallyReplacesWholeFile) {
  ScopedTempDir dir;
  const std::string path = dir.Join("latest");
  ASSERT_TRUE(WriteFileAtomically(DefaultFileSystem(), path, "iter_0000010\n").ok());
  ASSERT_TRUE(WriteFileAtomically(DefaultFileSystem(), path, "iter_0000020\n").ok());
  EXPECT_EQ(ReadBytes(path), "iter_0000020\n");
  EXPECT_FALSE(DefaultFileSystem()->FileExists(path + ".tmp"));
}

TEST(PosixFileSystemTest, ErrorsNameThePath) {
  ScopedTempDir dir;
  FileSystem* fs = DefaultFileSystem();
  const std::string missing = dir.Join("missing/file");
  EXPECT_THAT(std::string(fs->ReadFile(missing).status().message()), HasSubstr(missing));
  EXPECT_EQ(fs->ReadFile(missing).status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(fs->NewWritableFile(missing).status().message()), HasSubstr(missing));
  EXPECT_THAT(std::string(fs->NewReadOnlyMemoryRegion(missing).status().message()),
              HasSubstr(missing));
  EXPECT_THAT(std::string(fs->ListDir(missing).status().message()), HasSubstr(missing));
  EXPECT_THAT(std::string(fs->RenameFile(missing, dir.Join("b")).message()), HasSubstr(missing));
  ASSERT_TRUE(WriteStringToFile(fs, dir.Join("plain"), "x").ok());
  EXPECT_THAT(std::string(fs->CreateDir(dir.Join("plain/sub")).message()),
              HasSubstr(dir.Join("plain")));
}

}  // namespace
}  // namespace fulcrum
