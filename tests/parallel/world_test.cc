// Tests of WorldInfoFromEnvironment: each launcher's variables (torchrun, SLURM, Open MPI),
// their precedence and every validation error, with the environment set per test.
#include "parallel/world.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

namespace fulcrum::parallel {
namespace {

using ::testing::HasSubstr;

// Every variable WorldInfoFromEnvironment may read. The fixture clears them all (the test
// may itself run under a launcher) and restores the original values afterwards.
constexpr const char* kWorldVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_LAUNCH_NODE_IPADDR", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE"};

class WorldTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : kWorldVariables) {
      if (const char* value = std::getenv(name)) saved_[name] = value;
      unsetenv(name);
    }
  }
  void TearDown() override {
    for (const char* name : kWorldVariables) {
      auto it = saved_.find(name);
      if (it == saved_.end()) {
        unsetenv(name);
      } else {
        setenv(name, it->second.c_str(), 1);
      }
    }
  }

  static void Set(const std::map<std::string, std::string>& variables) {
    for (const auto& [name, value] : variables) setenv(name.c_str(), value.c_str(), 1);
  }

  // The error message for the current environment; fails the test when it is accepted.
  static std::string ErrorMessage() {
    absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
    EXPECT_FALSE(info.ok());
    if (info.ok()) return "";
    EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(info.status().message());
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(WorldTest, SingleProcessWithoutLauncher) {
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "single");
  EXPECT_EQ(info->rank, 0);
  EXPECT_EQ(info->world_size, 1);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_world_size, 1);
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 29500);
}

TEST_F(WorldTest, SingleProcessHonoursMasterPort) {
  Set({{"MASTER_PORT", "31000"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_port, 31000);
}

TEST_F(WorldTest, Torchrun) {
  Set({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
       {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "torchrun");
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "node0");
  EXPECT_EQ(info->master_port, 1234);
}

TEST_F(WorldTest, TorchrunWithoutLocalVariablesAssumesOneNode) {
  Set({{"RANK", "2"}, {"WORLD_SIZE", "4"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 29500);
}

TEST_F(WorldTest, EmptyVariableCountsAsUnset) {
  Set({{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_ADDR", ""}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "single");
  EXPECT_EQ(info->master_addr, "127.0.0.1");
}

TEST_F(WorldTest, TorchrunTakesPrecedenceOverSlurmAndMpi) {
  // fulcrum_launch inside an srun/mpirun allocation: its variables describe this process.
  Set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"},
       {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "torchrun");
  EXPECT_EQ(info->rank, 1);
}

TEST_F(WorldTest, TorchrunErrorsNameTheVariable) {
  Set({{"RANK", "3"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("RANK is set but WORLD_SIZE is not"));
  Set({{"WORLD_SIZE", "four"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("WORLD_SIZE=\"four\" is not an integer"));
  Set({{"WORLD_SIZE", "3"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("RANK=3 must be less than WORLD_SIZE=3"));
  Set({{"RANK", "-1"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("RANK=-1 must be at least 0"));
  Set({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("WORLD_SIZE=0 must be at least 1"));
  Set({{"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"},
       {"MASTER_ADDR", "node0"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2"));
  Set({{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "8"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("LOCAL_WORLD_SIZE=8 must not exceed WORLD_SIZE=4"));
}

TEST_F(WorldTest, MultiNodeWithoutMasterAddrIsAnError) {
  // 127.0.0.1 would make every node wait on itself until the rendezvous timeout.
  Set({{"RANK", "4"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("MASTER_ADDR is not set"));
}

TEST_F(WorldTest, MasterPortMustBeAPort) {
  for (const char* port : {"http", "0", "65536", "-5"}) {
    Set({{"MASTER_PORT", port}});
    EXPECT_THAT(ErrorMessage(), HasSubstr("MASTER_PORT")) << port;
    EXPECT_THAT(ErrorMessage(), HasSubstr(port)) << port;
  }
}

TEST_F(WorldTest, Slurm) {
  Set({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
       {"SLURM_NODEID", "1"}, {"SLURM_NTASKS_PER_NODE", "4"},
       {"SLURM_NODELIST", "gpu[03-05,7]"}, {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.9"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "slurm");
  EXPECT_EQ(info->rank, 6);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "gpu03");  // Rank 0's node, not the launch node.
  EXPECT_EQ(info->master_port, 29500);
}

TEST_F(WorldTest, SlurmTaskCountsPerNode) {
  Set({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "11"}, {"SLURM_LOCALID", "1"},
       {"SLURM_NODELIST", "n1"}});
  struct Case {
    const char* name;
    const char* value;
    const char* node;
    int expected;
  };
  for (const Case& c : {Case{"SLURM_STEP_TASKS_PER_NODE", "4(x2),3", "2", 3},
                        Case{"SLURM_STEP_TASKS_PER_NODE", "4(x2),3", "1", 4},
                        Case{"SLURM_NTASKS_PER_NODE", "4", "2", 4},
                        Case{"SLURM_TASKS_PER_NODE", "2,4(x2),3", "3", 3}}) {
    for (const char* name : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                             "SLURM_TASKS_PER_NODE"}) {
      unsetenv(name);
    }
    Set({{c.name, c.value}, {"SLURM_NODEID", c.node}});
    absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
    ASSERT_TRUE(info.ok()) << c.name << "=" << c.value << ": " << info.status();
    EXPECT_EQ(info->local_world_size, c.expected) << c.name << "=" << c.value;
  }
}

TEST_F(WorldTest, SlurmStepCountsWinOverAllocationCounts) {
  // --ntasks-per-node is an upper bound; the step may run fewer tasks per node.
  Set({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
       {"SLURM_NTASKS_PER_NODE", "8"}, {"SLURM_STEP_TASKS_PER_NODE", "2"},
       {"SLURM_STEP_NODELIST", "a1"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->local_world_size, 2);
}

TEST_F(WorldTest, SlurmMasterAddress) {
  Set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "0"},
       {"SLURM_NTASKS_PER_NODE", "4"}});
  struct Case {
    std::map<std::string, std::string> variables;
    const char* expected;
  };
  for (const Case& c : {
           Case{{{"SLURM_NODELIST", "node[03-05,7]"}}, "node03"},
           Case{{{"SLURM_NODELIST", "node[7,03-05]"}}, "node7"},
           Case{{{"SLURM_NODELIST", "login1,node[1-2]"}}, "login1"},
           Case{{{"SLURM_NODELIST", "rack[2-3]-n[08-09]"}}, "rack2-n08"},
           Case{{{"SLURM_NODELIST", "alloc[1-8]"}, {"SLURM_STEP_NODELIST", "alloc[5-6]"}},
                "alloc5"},
           Case{{{"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}}, "10.1.2.3"},
           Case{{{"SLURM_NODELIST", "node[1-2]"}, {"MASTER_ADDR", "10.9.9.9"}}, "10.9.9.9"},
           // MASTER_ADDR wins even over a node list the parser would reject.
           Case{{{"SLURM_NODELIST", "node[1-2"}, {"MASTER_ADDR", "10.9.9.9"}}, "10.9.9.9"},
       }) {
    for (const char* name : {"SLURM_NODELIST", "SLURM_STEP_NODELIST",
                             "SLURM_LAUNCH_NODE_IPADDR", "MASTER_ADDR"}) {
      unsetenv(name);
    }
    Set(c.variables);
    absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
    ASSERT_TRUE(info.ok()) << c.expected << ": " << info.status();
    EXPECT_EQ(info->master_addr, c.expected);
  }
}

TEST_F(WorldTest, SlurmSingleNodeDefaults) {
  // Only the three per-task variables: one node, master on loopback.
  Set({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
       {"MASTER_PORT", "40000"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 40000);
}

TEST_F(WorldTest, SlurmErrorsNameTheVariable) {
  Set({{"SLURM_PROCID", "0"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NTASKS is not set"));
  Set({{"SLURM_NTASKS", "4"}, {"SLURM_PROCID", "4"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_PROCID=4 must be less than SLURM_NTASKS=4"));
  Set({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "x"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_LOCALID=\"x\" is not an integer"));
  Set({{"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "4(x"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NTASKS_PER_NODE=\"4(x\""));
  Set({{"SLURM_NTASKS_PER_NODE", "2(x2)"}, {"SLURM_LOCALID", "2"}});
  EXPECT_THAT(ErrorMessage(),
              HasSubstr("SLURM_LOCALID=2 must be less than SLURM_NTASKS_PER_NODE=2"));
  Set({{"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NODEID=2 has no entry in SLURM_NTASKS_PER_NODE"));
  Set({{"SLURM_NODEID", "0"}, {"SLURM_NODELIST", "node[1-2"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NODELIST=\"node[1-2\""));
  Set({{"SLURM_NODELIST", "[1-2]"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NODELIST=\"[1-2]\""));
  unsetenv("SLURM_NODELIST");
  EXPECT_THAT(ErrorMessage(), HasSubstr("names rank 0's host"));
  unsetenv("SLURM_NTASKS_PER_NODE");
  Set({{"SLURM_NNODES", "2"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("SLURM_NNODES=2"));
}

TEST_F(WorldTest, OpenMpi) {
  Set({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source, "openmpi");
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 3);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "127.0.0.1");  // One node: loopback.
}

TEST_F(WorldTest, OpenMpiAcrossNodesNeedsMasterAddr) {
  Set({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("MASTER_ADDR is not set"));
  Set({{"MASTER_ADDR", "head"}, {"MASTER_PORT", "2222"}});
  absl::StatusOr<WorldInfo> info = WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->master_addr, "head");
  EXPECT_EQ(info->master_port, 2222);
}

TEST_F(WorldTest, OpenMpiErrorsNameTheVariable) {
  Set({{"OMPI_COMM_WORLD_RANK", "0"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("OMPI_COMM_WORLD_SIZE is not set"));
  Set({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "2"}});
  EXPECT_THAT(ErrorMessage(),
              HasSubstr("OMPI_COMM_WORLD_RANK=2 must be less than OMPI_COMM_WORLD_SIZE=2"));
  Set({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}});
  EXPECT_THAT(ErrorMessage(), HasSubstr("OMPI_COMM_WORLD_LOCAL_RANK=1 must be less than "
                                        "OMPI_COMM_WORLD_LOCAL_SIZE=1"));
}

}  // namespace
}  // namespace fulcrum::parallel
