#include "core/malloc_tuning.h"

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace fulcrum {
namespace {

TEST(MallocTuningTest, GlibcAcceptsTheSettingsAndMallocStillWorks) {
#if defined(__GLIBC__)
  EXPECT_TRUE(KeepStepMemoryInHeap());
  EXPECT_TRUE(KeepStepMemoryInHeap(size_t{1} << 40)) << "an over-large threshold is clamped";
#endif
  // A block of the logits' size, freed and asked for again, works as before.
  for (int i = 0; i < 2; ++i) {
    void* block = std::malloc(size_t{31} << 20);
    ASSERT_NE(block, nullptr);
    std::memset(block, 1, size_t{31} << 20);
    std::free(block);
  }
}

}  // namespace
}  // namespace fulcrum
