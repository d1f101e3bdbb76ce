// Tests of the balancer registry (dynamic/balancers.h): the names --rebalancer accepts,
// their help, the error for an unknown one, and that each builds the rebalancer it names.
// These run against the static library, so they also prove that the registrations in
// balancers.cc survive static linking.
#include "dynamic/balancers.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/dynamic/load_test_util.h"

namespace fulcrum::dynamic {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::StartsWith;

TEST(BalancersTest, NamesAndHelp) {
  EXPECT_EQ(BalancerNames(), "diffusion, none, partition");
  const std::vector<std::string> lines = absl::StrSplit(BalancerHelp(), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_THAT(lines[0], StartsWith("  diffusion  neighbouring stages"));
  EXPECT_THAT(lines[1], StartsWith("  none       never move"));
  EXPECT_THAT(lines[2], StartsWith("  partition  exact contiguous partition"));
}

TEST(BalancersTest, EachNameBuildsItsRebalancer) {
  for (const char* name : {"none", "partition", "diffusion"}) {
    absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> made = MakeRebalancer(name, {});
    ASSERT_TRUE(made.ok()) << name << ": " << made.status();
    EXPECT_STREQ((*made)->name(), name);
  }
  // The name wins over the options' algorithm.
  BalancerOptions options;
  options.algorithm = "partition";
  absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> diffusion =
      MakeRebalancer("diffusion", options);
  ASSERT_TRUE(diffusion.ok());
  EXPECT_STREQ((*diffusion)->name(), "diffusion");
}

TEST(BalancersTest, NoneNeverMoves) {
  absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> none = MakeRebalancer("none", {});
  ASSERT_TRUE(none.ok());
  const Placement even = UniformPlacement(8, 2);
  const balance_testing::SyntheticTimes skewed{{30, 30, 30, 30, 10, 10, 10, 10}};
  for (int64_t i = 1; i <= 5; ++i) {
    EXPECT_THAT((*none)->Plan(i, balance_testing::MakeLoads(even, skewed)).target, IsEmpty());
  }
}

TEST(BalancersTest, UnknownNameAndBadOptionsAreErrors) {
  absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> unknown = MakeRebalancer("greedy", {});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("--rebalancer=greedy"));
  EXPECT_THAT(unknown.status().message(), HasSubstr("diffusion, none, partition"));

  BalancerOptions bad;
  bad.interval = 0;
  absl::StatusOr<std::unique_ptr<pipeline::Rebalancer>> made = MakeRebalancer("partition", bad);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(made.status().message(), HasSubstr("--rebalance_interval"));
}

}  // namespace
}  // namespace fulcrum::dynamic
