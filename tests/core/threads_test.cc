// core/threads.h: the thread count a process picks, and that setting it reaches LibTorch
// and OpenBLAS alike.
#include "core/threads.h"

#include <torch/torch.h>

#include "gtest/gtest.h"

namespace fulcrum {
namespace {

TEST(ThreadsTest, AnExplicitCountWinsThenOmpNumThreadsThenTheCoresSharedOut) {
  EXPECT_EQ(ResolveThreadCount(3, 5, 8, 2), 3);
  EXPECT_EQ(ResolveThreadCount(0, 5, 8, 2), 5);
  EXPECT_EQ(ResolveThreadCount(0, std::nullopt, 8, 2), 4);
  EXPECT_EQ(ResolveThreadCount(0, std::nullopt, 2, 1), 2);
  EXPECT_EQ(ResolveThreadCount(0, std::nullopt, 2, 4), 1) << "never below one";
  EXPECT_EQ(ResolveThreadCount(0, 0, 6, 3), 2) << "OMP_NUM_THREADS=0 means unset";
}

TEST(ThreadsTest, SettingTheCountReachesLibTorchAndOpenBlas) {
  const int before = at::get_num_threads();
  const int blas = SetComputeThreads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  if (blas != -1) {
    EXPECT_EQ(blas, 2);
  }
  EXPECT_EQ(SetComputeThreads(1) == -1 ? 1 : at::get_num_threads(), 1);
  SetComputeThreads(before);
  EXPECT_GE(UsableCores(), 1);
}

}  // namespace
}  // namespace fulcrum
