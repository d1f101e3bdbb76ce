#include "tests/pipeline/engine/engine_test_util.h"

#include <unistd.h>

#include <chrono>
#include <utility>

#include "gtest/gtest.h"
#include "parallel/world_communicator.h"

#include "tests/run_command.h"
#include "tests/worker_runs.h"

namespace fulcrum::pipeline::testing {

std::unique_ptr<parallel::Communicator> OneProcessWorld() {
  auto comm = parallel::CreateWorldCommunicator(parallel::WorldInfo{}, parallel::Backend::kGloo,
                                                std::chrono::seconds(30));
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

std::unique_ptr<parallel::Communicator> WorldFromEnvironment() {
  auto info = parallel::WorldInfoFromEnvironment();
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return nullptr;
  auto world = parallel::CreateWorldCommunicator(*info, parallel::Backend::kGloo,
                                                 std::chrono::seconds(120));
  EXPECT_TRUE(world.ok()) << world.status();
  return world.ok() ? std::move(world).value() : nullptr;
}

std::string SelfPath() {
  std::string self(4096, '\0');
  const ssize_t length = readlink("/proc/self/exe", self.data(), self.size());
  self.resize(length > 0 ? length : 0);
  return self;
}

int LaunchWorkers(int nproc, const std::string& worker_filter, std::string* output) {
  const std::string command = "FULCRUM_ENGINE_WORKER=1 timeout -k 5 300 " +
                              std::string(FULCRUM_BIN_DIR) + "/fulcrum_launch --nproc_per_node=" +
                              std::to_string(nproc) + " --master_port=0 -- " + SelfPath() +
                              " --gtest_filter='" + worker_filter + "'";
  const int code = fulcrum::testing::RunCommand(command, output);
  EXPECT_TRUE(fulcrum::testing::RanksRanAndPassed(
      *output, fulcrum::testing::FirstRanks(nproc),
      fulcrum::testing::CountSelectedTests(SelfPath(), worker_filter)))
      << *output;
  return code;
}

}  // namespace fulcrum::pipeline::testing
