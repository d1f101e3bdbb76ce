// core/platform.h: what a run says it runs on; and NOTE [libstdc++ first] (CMakeLists.txt):
// std::filesystem calls of a binary linked with LibTorch bind to the libstdc++ our code was
// compiled for (libtorch.so's exported copy of remove_all crashed).
#include "core/platform.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace fulcrum {
namespace {

TEST(PlatformTest, NamesTheLibTorchItsCudaBuildAndTheDevice) {
  const Platform p = CurrentPlatform();
  EXPECT_EQ(p.libtorch_version.rfind("2.", 0), 0u) << p.libtorch_version;
  const std::string line = DescribePlatform(p);
  EXPECT_NE(line.find("LibTorch " + p.libtorch_version), std::string::npos) << line;
  EXPECT_NE(line.find("device: cpu"), std::string::npos) << line;
  if (p.cuda_build) {
    EXPECT_FALSE(p.cuda_version.empty());
    EXPECT_NE(line.find("CUDA " + p.cuda_version + " build"), std::string::npos) << line;
  } else {
    EXPECT_NE(line.find("CPU build"), std::string::npos) << line;
  }
  if (p.visible_gpus == 0) {
    EXPECT_NE(line.find("no GPU visible"), std::string::npos) << line;
  } else {
    EXPECT_NE(line.find("visible; the model does not use them yet"), std::string::npos) << line;
  }
}

TEST(PlatformTest, StdFilesystemRemovesATree) {
  std::string pattern = ::testing::TempDir() + "fulcrum_platform_test.XXXXXX";
  ASSERT_NE(mkdtemp(pattern.data()), nullptr);
  const std::filesystem::path root = pattern;
  std::filesystem::create_directories(root / "a" / "b");
  std::ofstream(root / "a" / "b" / "file") << "x";
  EXPECT_EQ(std::filesystem::remove_all(root), 4u);  // root, a, b, file
  EXPECT_FALSE(std::filesystem::exists(root));
}

}  // namespace
}  // namespace fulcrum
