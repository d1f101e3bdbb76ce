// --distributed_backend against the device, through fulcrum_train: a backend that cannot
// carry the job's tensors is refused before any work, with exit 2 and a message naming
// both flags (parallel::ResolveBackend; its cases are in tests/parallel/split_plane_test.cc).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "parallel/world_communicator.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

const std::string kTrain = std::string(FULCRUM_BIN_DIR) + "/fulcrum_train";

TEST(BackendFlagTest, NcclOnTheCpuIsRefusedBeforeAnyWork) {
  std::string out;
  const int code = testing::RunCommand(
      kTrain + " --recipe=tiny --train_iters=1 --distributed_backend=nccl", &out);
  if (parallel::HaveNccl()) {
    EXPECT_EQ(code, 2) << out;
    EXPECT_THAT(out, HasSubstr("--distributed_backend=nccl needs a CUDA device, but the device "
                               "is cpu (--device): NCCL moves CUDA memory only"));
  } else {
    EXPECT_EQ(code, 1) << out;
    EXPECT_THAT(out, HasSubstr("the nccl backend is not in this build"));
  }
  EXPECT_THAT(out, ::testing::Not(HasSubstr("iteration "))) << "no training may start";
}

TEST(BackendFlagTest, UnknownBackendNamesTheChoices) {
  std::string out;
  EXPECT_EQ(testing::RunCommand(kTrain + " --recipe=tiny --train_iters=1 --distributed_backend=mpi",
                                &out),
            2)
      << out;
  EXPECT_THAT(out, HasSubstr("unknown --distributed_backend 'mpi'; expected auto, gloo or nccl"));
}

}  // namespace
}  // namespace fulcrum
