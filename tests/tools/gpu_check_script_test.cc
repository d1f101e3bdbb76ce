// tools/gpu_bundle.sh (--dry-run: CI should not download packages on every run) and
// tools/gpu_check.sh --quick --no-build against this build: on a machine without a GPU the
// report lists every check and says the GPU ones were not run, and why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum {
namespace {

using ::testing::HasSubstr;

const std::string kSource = FULCRUM_SOURCE_DIR;
const std::string kGpuCheckBin = FULCRUM_BIN_DIR;

std::string TempDir(const std::string& name) { return testing::MakeTempDir(name); }

bool GpuVisible() {
  std::string out;
  return testing::RunCommand("nvidia-smi -L 2>/dev/null | grep -q '^GPU '", &out) == 0;
}

TEST(BundleScriptTest, DryRunListsThePackagesWithinBudget) {
  std::string out;
  if (testing::RunCommand("command -v apt-cache >/dev/null", &out) != 0) {
    GTEST_SKIP() << "no apt-cache here: gpu_bundle.sh needs Debian's apt";
  }
  const std::string dir = TempDir("bundle");
  const int code = testing::RunCommand(kSource + "/tools/gpu_bundle.sh --dry-run " + dir, &out);
  if (code != 0 && out.find("apt knows none of") != std::string::npos) {
    GTEST_SKIP() << "apt's package lists lack the bundle's packages (apt-get update?): " << out;
  }
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("dry run: nothing downloaded"));
  std::ifstream manifest(dir + "/MANIFEST");
  ASSERT_TRUE(manifest) << "no MANIFEST in " << dir;
  std::stringstream text;
  text << manifest.rdbuf();
  for (const char* package : {"libgoogle-glog-dev", "libgflags-dev", "libabsl-dev", "libgtest-dev",
                              "libsentencepiece-dev", "nlohmann-json3-dev", "libxxhash-dev",
                              "libgloo-dev"}) {
    EXPECT_THAT(text.str(), HasSubstr(std::string(package) + "\t")) << text.str();
  }
}

TEST(BundleScriptTest, RefusesBadArguments) {
  std::string out;
  EXPECT_EQ(testing::RunCommand(kSource + "/tools/gpu_bundle.sh --fast /tmp/x", &out), 2);
  EXPECT_THAT(out, HasSubstr("unknown option '--fast'"));
  EXPECT_EQ(testing::RunCommand(kSource + "/tools/gpu_bundle.sh", &out), 2);
  EXPECT_THAT(out, HasSubstr("usage:"));
}

TEST(DeviceCheckScriptTest, QuickRunReportsEveryCheckAndMarksDeviceOnesNotRun) {
  if (GpuVisible()) GTEST_SKIP() << "a GPU is visible: this test is about a machine without one";
  const std::string dir = TempDir("gpu_check");
  std::string out;
  ASSERT_EQ(testing::RunCommand(kSource + "/tools/gpu_check.sh --quick --no-build --build-dir " +
                                    kGpuCheckBin + "/.. " + dir,
                                &out),
            0)
      << out;
  std::ifstream file(dir + "/report.json");
  ASSERT_TRUE(file) << "no report.json\n" << out;
  const nlohmann::json report = nlohmann::json::parse(file);
  EXPECT_TRUE(report["quick"].get<bool>());
  std::set<std::string> names;
  for (const nlohmann::json& check : report["checks"]) {
    const std::string name = check["name"], status = check["status"];
    names.insert(name);
    SCOPED_TRACE(name);
    EXPECT_NE(status, "fail");
    if (name == "gpu_tests" || name == "bench_train" || name.rfind("train_", 0) == 0) {
      EXPECT_EQ(status, "not run (no GPU visible)");
      EXPECT_FALSE(check["command"].get<std::string>().empty());
    }
  }
  for (const char* expected :
       {"environment", "bundle", "build", "gpu_tests", "bench_train", "train_dense", "train_bf16",
        "train_moe", "train_plugin_early_exit", "train_plugin_freeze", "train_plugin_mod",
        "train_plugin_prune", "train_plugin_sparse_attention", "train_resume", "train_async_save",
        "train_pp",
        "train_tp", "train_dp", "train_ep", "train_migration", "train_moe8", "train_zbv_moves",
        "train_freeze_scheduled", "train_pp_frozen", "train_dp_zero", "train_zero_moves",
        "train_recompute", "train_pp_moe_recompute", "train_tp_sp", "train_dp_overlap",
        "train_zero_overlap", "two_ranks"}) {
    EXPECT_EQ(names.count(expected), 1u) << expected;
  }
  EXPECT_EQ(report["summary"]["fail"].get<int>(), 0);
  std::ifstream md(dir + "/report.md");
  std::stringstream text;
  text << md.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr("| train_pp | not run (no GPU visible) |"));
  EXPECT_THAT(text.str(), HasSubstr("| environment | pass |"));
}

TEST(DeviceCheckScriptTest, RefusesBadArguments) {
  std::string out;
  EXPECT_EQ(testing::RunCommand(kSource + "/tools/gpu_check.sh --fast /tmp/x", &out), 2);
  EXPECT_THAT(out, HasSubstr("unknown option '--fast'"));
}

}  // namespace
}  // namespace fulcrum
