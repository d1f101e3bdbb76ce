// Content checksums for checkpoint tensors: XXH3-64 of a tensor's stored bytes, written as
// 16 lowercase hex digits in manifests (JSON numbers cannot hold 64-bit values exactly in
// every reader, Python's json module aside). XXH3 is not cryptographic: it catches bit
// rot, truncation and torn writes, not tampering.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace fulcrum::ckpt {

/// XXH3-64 (seed 0) of `bytes`; the same value as Python's xxhash.xxh3_64_intdigest.
uint64_t Xxh3Checksum(std::string_view bytes);

/// `checksum` as exactly 16 lowercase hex digits, e.g. "00ff00ff00ff00ff".
std::string ChecksumToHex(uint64_t checksum);

/// Parses the output of ChecksumToHex (exactly 16 hex digits, either case).
std::optional<uint64_t> ChecksumFromHex(std::string_view hex);

}  // namespace fulcrum::ckpt
