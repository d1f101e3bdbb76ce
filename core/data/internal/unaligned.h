// Reading a value from a byte buffer at any alignment (the .idx and .bin files pack their
// fields and tokens without padding).
#pragma once

#include <cstdint>
#include <cstring>

namespace fulcrum::data::internal {

/// The T stored at `p`, which need not be aligned for T (a memcpy the compiler turns into a
/// plain load where the CPU allows it).
template <typename T>
T LoadUnaligned(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

}  // namespace fulcrum::data::internal
