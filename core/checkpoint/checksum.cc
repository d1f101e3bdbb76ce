#include "core/checkpoint/checksum.h"

#include <xxhash.h>

#include "absl/strings/str_format.h"

namespace fulcrum::ckpt {

uint64_t Xxh3Checksum(std::string_view bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string ChecksumToHex(uint64_t checksum) { return absl::StrFormat("%016x", checksum); }

std::optional<uint64_t> ChecksumFromHex(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  uint64_t value = 0;
  for (const char c : hex) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    value = (value << 4) | static_cast<uint64_t>(digit);
  }
  return value;
}

}  // namespace fulcrum::ckpt
