// core/threads.h: setting the thread count reaches LibTorch's intra-op pool, and the
// default is $OMP_NUM_THREADS or every core.
#include "core/threads.h"

#include <sched.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace fulcrum {
namespace {

TEST(ThreadsTest, SettingTheCountReachesLibTorch) {
  const int before = at::get_num_threads();
  SetComputeThreads(2);
  EXPECT_EQ(at::get_num_threads(), 2);
  SetComputeThreads(1);
  EXPECT_EQ(at::get_num_threads(), 1);
  SetComputeThreads(before);
}

// Restores $OMP_NUM_THREADS (ctest sets it) when a test leaves.
class OmpEnvGuard {
 public:
  OmpEnvGuard() {
    const char* v = std::getenv("OMP_NUM_THREADS");
    had_ = v != nullptr;
    if (had_) value_ = v;
  }
  ~OmpEnvGuard() {
    if (had_) {
      setenv("OMP_NUM_THREADS", value_.c_str(), 1);
    } else {
      unsetenv("OMP_NUM_THREADS");
    }
  }

 private:
  bool had_ = false;
  std::string value_;
};

TEST(ThreadsTest, DefaultIsOmpNumThreadsWhenSet) {
  OmpEnvGuard guard;
  setenv("OMP_NUM_THREADS", "3", 1);
  const ThreadChoice choice = DefaultComputeThreads();
  EXPECT_EQ(choice.threads, 3);
  EXPECT_EQ(choice.source, "$OMP_NUM_THREADS");
}

TEST(ThreadsTest, DefaultIsEveryAllowedCoreOtherwise) {
  OmpEnvGuard guard;
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  for (const char* ignored : {"", "0", "-2", "four"}) {
    setenv("OMP_NUM_THREADS", ignored, 1);
    const ThreadChoice choice = DefaultComputeThreads();
    EXPECT_EQ(choice.threads, cores) << "OMP_NUM_THREADS='" << ignored << "'";
    EXPECT_EQ(choice.source, "all " + std::to_string(cores) + " cores this process may use");
  }
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(DefaultComputeThreads().threads, cores);
}

}  // namespace
}  // namespace fulcrum
