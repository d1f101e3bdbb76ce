// The command line of every tool but fulcrum_launch (which parses its own argv; see
// launch_test.cc) goes through the shared helper, recipes/cli.h, as fulcrum_train's does:
// --help prints the tool's usage and only its own flags, each in a group, and exits 0; an
// unknown flag or a bad value exits 2 with one line naming the flag, before any work.
//
// "Its own flags" is read from the tool's source: every DEFINE_<type>(name, ...) in
// tools/<source> must be in --help (so no flag is left out of the groups; the helper would
// list such a flag under "Other:", which must not appear either), and every flag --help
// shows must be defined there (or, for fulcrum_bench_dynamism, by a plugin it links), so no
// library's flag (glog's --v, gflags' --tryfromenv, LibTorch's) leaks in.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/run_command.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Tool {
  std::string program;      // Binary in FULCRUM_BIN_DIR.
  std::string source;       // Its main file under tools/.
  std::string usage;        // A line of the usage --help must print.
  std::string bad_value;    // An argument with a value its flag's type refuses.
  std::string bad_flag;     // The flag that message must name.
  bool plugin_flags = false;  // Links the plugins, whose flags it accepts too.
  // What it says to a stray argument ("stray"): the tools without positional arguments
  // refuse it in one line; fulcrum_plot and fulcrum_ckpt take arguments and say what they
  // need (fulcrum_ckpt with its usage after the line).
  std::string stray = "unexpected argument 'stray'";
};

std::ostream& operator<<(std::ostream& os, const Tool& tool) { return os << tool.program; }

const std::vector<Tool>& Tools() {
  static const auto* tools = new std::vector<Tool>{
      {"fulcrum_sim", "sim_main.cc", "fulcrum_sim --case=all", "--stages=abc", "--stages"},
      {"fulcrum_plot", "plot_main.cc", "fulcrum_plot INPUT.jsonl... -o OUT.svg", "--title",
       "--title", false, "fulcrum_plot: give one or more input files and -o OUT.svg"},
      {"fulcrum_ckpt", "ckpt_main.cc", "fulcrum_ckpt verify PATH", "--num_experts_per_tok=two",
       "--num_experts_per_tok", false, "fulcrum_ckpt: expected a command and a PATH"},
      {"fulcrum_bench_balance", "bench_balance_main.cc", "fulcrum_bench_balance [--configs=",
       "--rounds=abc", "--rounds"},
      {"fulcrum_bench_comm", "bench_comm_main.cc",
       "fulcrum_launch --nproc_per_node=4 -- fulcrum_bench_comm", "--iters=1.5", "--iters"},
      {"fulcrum_bench_dynamism", "bench_dynamism_main.cc", "fulcrum_bench_dynamism [--hidden=",
       "--reps=many", "--reps", /*plugin_flags=*/true},
      {"fulcrum_bench_moe", "bench_moe_main.cc", "fulcrum_bench_moe [--tables=layer,dispatch]",
       "--keep_heap=maybe", "--keep_heap"},
      {"fulcrum_bench_pipeline", "bench_pipeline_main.cc", "fulcrum_bench_pipeline [--pp=2,4]",
       "--train_iters=99999999999", "--train_iters"},
      {"fulcrum_bench_sparse", "bench_sparse_main.cc", "fulcrum_bench_sparse [--shapes=",
       "--reps=", "--reps"},
      {"fulcrum_bench_train", "bench_train_main.cc", "fulcrum_bench_train [--rounds=5]",
       "--rounds=abc", "--rounds"},
  };
  return *tools;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The flags DEFINE_<type>(name, ...) defines in `source`.
std::set<std::string> DefinedFlags(const std::string& path) {
  const std::string text = Slurp(path);
  std::set<std::string> names;
  const std::regex define(R"(\bDEFINE_(?:bool|int32|uint32|int64|uint64|double|string)\(\s*(\w+))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), define);
       it != std::sregex_iterator(); ++it) {
    names.insert((*it)[1]);
  }
  return names;
}

struct ToolRun {
  int code = -1;
  std::string output;
  double seconds = 0;
};

ToolRun RunTool(const Tool& tool, const std::string& args) {
  ToolRun run;
  const auto start = std::chrono::steady_clock::now();
  run.code = testing::RunCommand(std::string(FULCRUM_BIN_DIR) + "/" + tool.program + " " + args,
                                 &run.output);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return run;
}

// Loading the binary and parsing: seconds at most even on a loaded machine; any work the tool
// does (training runs, timed rounds, simulations) takes far longer.
constexpr double kNoWorkSeconds = 20;

class ToolCliTest : public ::testing::TestWithParam<Tool> {};

TEST_P(ToolCliTest, HelpPrintsUsageAndOnlyItsOwnFlagsAndExitsZero) {
  const Tool& tool = GetParam();
  const std::set<std::string> own =
      DefinedFlags(std::string(FULCRUM_SOURCE_DIR) + "/tools/" + tool.source);
  ASSERT_GE(own.size(), 2u) << "no flags found in tools/" << tool.source;
  std::set<std::string> allowed = own;
  if (tool.plugin_flags) {
    for (const auto& entry :
         std::filesystem::directory_iterator(std::string(FULCRUM_SOURCE_DIR) + "/plugins")) {
      if (entry.path().extension() != ".cc") continue;
      const std::set<std::string> flags = DefinedFlags(entry.path().string());
      allowed.insert(flags.begin(), flags.end());
    }
  }
  const ToolRun run = RunTool(tool, "--help");
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_LT(run.seconds, kNoWorkSeconds);
  EXPECT_THAT(run.output, HasSubstr(tool.usage));
  EXPECT_THAT(run.output, HasSubstr("Exit status:"));
  std::set<std::string> shown;
  const std::regex flag_line(R"((?:^|\n)  --(\w+)=)");
  for (auto it = std::sregex_iterator(run.output.begin(), run.output.end(), flag_line);
       it != std::sregex_iterator(); ++it) {
    shown.insert((*it)[1]);
  }
  for (const std::string& name : own) {
    EXPECT_EQ(shown.count(name), 1u) << "--" << name << " is not in --help\n" << run.output;
  }
  for (const std::string& name : shown) {
    EXPECT_EQ(allowed.count(name), 1u) << "--help shows --" << name << ", not a flag of "
                                       << tool.source << "\n" << run.output;
  }
  EXPECT_THAT(run.output, Not(HasSubstr("\nOther:\n"))) << "a flag in no --help group";
  // Libraries' flags: glog's, gflags' own, LibTorch's.
  for (const char* foreign : {"--v=", "--logtostderr", "tryfromenv", "--flagfile=",
                              "--torch_", "--caffe2_"}) {
    EXPECT_THAT(run.output, Not(HasSubstr(foreign))) << run.output;
  }
  if (tool.plugin_flags) {
    EXPECT_THAT(run.output, HasSubstr("\nPlugins: prune:\n"));
  }
}

// One line, exit 2: what a script or a user sees for a typo.
void ExpectRefusedInOneLine(const ToolRun& run, const std::string& expected) {
  EXPECT_EQ(run.code, 2) << run.output;
  EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 1) << run.output;
  EXPECT_THAT(run.output, HasSubstr(expected));
  EXPECT_LT(run.seconds, kNoWorkSeconds);
}

TEST_P(ToolCliTest, UnknownFlagExitsTwoInOneLineNamingIt) {
  const Tool& tool = GetParam();
  ExpectRefusedInOneLine(RunTool(tool, "--no_such_flag"), "unknown flag --no_such_flag");
  // The helper's suggestion comes from the tool's own flags.
  const std::string near = tool.bad_flag + "x";
  ExpectRefusedInOneLine(RunTool(tool, near + "=1"),
                         "did you mean " + tool.bad_flag + "?");
}

TEST_P(ToolCliTest, BadValueExitsTwoInOneLineNamingTheFlag) {
  const Tool& tool = GetParam();
  const ToolRun run = RunTool(tool, tool.bad_value);
  ExpectRefusedInOneLine(run, tool.bad_flag);
  EXPECT_THAT(run.output, HasSubstr(tool.program + ": ")) << "the message names the program";
}

TEST_P(ToolCliTest, StrayArgumentExitsTwo) {
  const Tool& tool = GetParam();
  const ToolRun run = RunTool(tool, "stray");
  if (tool.program == "fulcrum_ckpt") {
    EXPECT_EQ(run.code, 2) << run.output;
    EXPECT_THAT(run.output, HasSubstr(tool.stray));
    EXPECT_LT(run.seconds, kNoWorkSeconds);
  } else {
    ExpectRefusedInOneLine(run, tool.stray);
  }
}

INSTANTIATE_TEST_SUITE_P(Tools, ToolCliTest, ::testing::ValuesIn(Tools()),
                         [](const ::testing::TestParamInfo<Tool>& info) {
                           return info.param.program;
                         });

}  // namespace
}  // namespace fulcrum
