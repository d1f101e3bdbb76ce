// The timeline's path after a live shrink (recipes/timeline_path.h).
#include "recipes/timeline_path.h"

#include <gtest/gtest.h>

namespace fulcrum {
namespace {

TEST(TimelinePathTest, StageCountGoesBeforeTheExtension) {
  EXPECT_EQ(TimelinePathAfterShrink("/tmp/run.json", 2), "/tmp/run.pp2.json");
  EXPECT_EQ(TimelinePathAfterShrink("run.trace.json", 3), "run.trace.pp3.json");
  EXPECT_EQ(TimelinePathAfterShrink("run.json", 1), "run.pp1.json");
}

TEST(TimelinePathTest, WithoutAnExtensionItGoesAtTheEnd) {
  EXPECT_EQ(TimelinePathAfterShrink("/tmp/run", 2), "/tmp/run.pp2");
  EXPECT_EQ(TimelinePathAfterShrink("run", 2), "run.pp2");
  // A dot in a directory's name is no extension.
  EXPECT_EQ(TimelinePathAfterShrink("/tmp/out.d/run", 2), "/tmp/out.d/run.pp2");
}

TEST(TimelinePathTest, NoTimelineStaysNone) { EXPECT_EQ(TimelinePathAfterShrink("", 2), ""); }

}  // namespace
}  // namespace fulcrum
