#include "core/checkpoint/checksum.h"

#include <gtest/gtest.h>

namespace fulcrum::ckpt {
namespace {

TEST(ChecksumTest, IsXxh3WithSeedZero) {
  // Published XXH3-64 value of the empty input (xxhsum -H3 /dev/null).
  EXPECT_EQ(Xxh3Checksum(""), 0x2D06800538D394C2ull);
  EXPECT_NE(Xxh3Checksum("a"), Xxh3Checksum("b"));
}

TEST(ChecksumTest, HexRoundTrip) {
  EXPECT_EQ(ChecksumToHex(0x2D06800538D394C2ull), "2d06800538d394c2");
  EXPECT_EQ(ChecksumToHex(1), "0000000000000001");
  EXPECT_EQ(ChecksumFromHex("2D06800538d394c2"), 0x2D06800538D394C2ull);
  EXPECT_EQ(ChecksumFromHex("2d06800538d394c"), std::nullopt);   // 15 digits.
  EXPECT_EQ(ChecksumFromHex("2d06800538d394cg"), std::nullopt);  // Not hex.
  EXPECT_EQ(ChecksumFromHex("0x06800538d394c2"), std::nullopt);
}

}  // namespace
}  // namespace fulcrum::ckpt
