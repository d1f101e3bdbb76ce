// fulcrum_sim through its binary: --case=all prints the six-case table (early exit and MoE
// from the measured behaviour built in), every figure labelled simulated; bad flags exit 2
// naming the value.
#include <string>

#include "gtest/gtest.h"
#include "tests/run_command.h"

namespace fulcrum {
namespace {

const std::string kSim = std::string(FULCRUM_BIN_DIR) + "/fulcrum_sim";

TEST(SimCliTest, CaseAllPrintsTheSixCaseTable) {
  std::string output;
  ASSERT_EQ(testing::RunCommand(kSim + " --case=all --iterations=10 --repack", &output), 0) << output;
  EXPECT_NE(output.find("SIMULATED"), std::string::npos) << output;
  const size_t table = output.find("DynMo table");
  ASSERT_NE(table, std::string::npos) << output;
  for (const char* name : {"moe", "pruning", "freezing", "sparse_attention", "early_exit", "mod"}) {
    const size_t row = output.find(std::string("\n  ") + name + " ", table);
    ASSERT_NE(row, std::string::npos) << name << "\n" << output;
    const std::string line = output.substr(row + 3, output.find('\n', row + 3) - row - 3);
    EXPECT_NE(line.find("bubble"), std::string::npos) << line;
    EXPECT_NE(line.find("DynMo:"), std::string::npos) << line;
    EXPECT_NE(line.find("GPUs"), std::string::npos) << line;
  }
}

TEST(SimCliTest, BadFlagsExitTwoNamingTheValue) {
  std::string output;
  EXPECT_EQ(testing::RunCommand(kSim + " --case=bogus", &output), 2);
  EXPECT_NE(output.find("--case=bogus"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(kSim, &output), 2);
  EXPECT_EQ(testing::RunCommand(kSim + " --trace=/nonexistent/trace.jsonl", &output), 2);
  EXPECT_NE(output.find("/nonexistent/trace.jsonl"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(kSim + " --case=moe --strategies=fastest", &output), 2);
  EXPECT_NE(output.find("fastest"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum
