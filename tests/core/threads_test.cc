// core/threads.h: setting the thread count reaches LibTorch and OpenBLAS alike.
#include "core/threads.h"

#include <torch/torch.h>

#include "gtest/gtest.h"

namespace fulcrum {
namespace {

TEST(ThreadsTest, SettingTheCountReachesLibTorchAndOpenBlas) {
  const int before = at::get_num_threads();
  const int blas = SetComputeThreads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(BlasThreads(), blas);
  if (blas != -1) {
    EXPECT_EQ(blas, 2);
  }
  EXPECT_EQ(SetComputeThreads(1) == -1 ? 1 : at::get_num_threads(), 1);
  SetComputeThreads(before);
}

}  // namespace
}  // namespace fulcrum
