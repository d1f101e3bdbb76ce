// The wire format shared by StoreServer and TcpStore (tcp_store.h describes it). Internal
// to parallel/internal/.
//
// Thread-safety: stateless functions; an Encoder or Decoder belongs to one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fulcrum::parallel::internal::store_protocol {

enum class Op : uint8_t {
  kSet = 1,         // key, value -> ()
  kCompareSet = 2,  // key, expected, desired -> value afterwards
  kGet = 3,         // key -> value; parked until the key exists
  kAdd = 4,         // key, delta -> sum
  kDeleteKey = 5,   // key -> deleted (u8)
  kCheck = 6,       // count, keys -> all exist (u8)
  kNumKeys = 7,     // () -> count
  kWait = 8,        // count, keys -> (); parked until all exist
};

enum class Status : uint8_t { kOk = 0, kError = 1 };  // Then the fields, or a message.

// NOTE [store bounds]: the server is reachable, unauthenticated, by anything that can
// connect to MASTER_ADDR:MASTER_PORT, so what one connection may make it hold is bounded by
// what the job's own requests need, and so is the number of connections.
//  - Fields. The largest key or value of a job's requests grows with its world size: Gloo's
//    TCP rendezvous value (gloo/transport/tcp/context.cc, Rank::bytes) is the hostname, the
//    device address and 8 bytes per rank of the group; a split's key (SplitKey) lists its
//    members' world ranks, up to 8 characters each, once per level of splitting. NCCL's
//    unique id is 128 bytes; the rest are counters and flags. So a field may have
//    kBaseFieldBytes plus kFieldBytesPerRank per world rank; the largest request
//    (compareSet: a key and two values) bounds a frame.
//  - Connections. Each rank holds one connection (rendezvous.cc; ProcessGroupGloo does not
//    clone the store); a client that timed out reconnects after closing, and a rank whose
//    host died leaves a connection the kernel has not yet dropped: world size plus
//    kConnectionMargin.
//  - Per connection the server holds at most one request being received, one reply being
//    sent and one parked request (a client waits for each reply before its next request),
//    so its buffers stay under three frames; a client that sends more is not one of ours
//    and is closed.
// What the map holds is not bounded: a client that speaks the protocol may store what a
// rank may store.

/// The bytes of a key or value that any job may use, whatever its size (see above).
constexpr uint32_t kBaseFieldBytes = 64u << 10;
/// The bytes per world rank a key or value may add: 8 per rank in Gloo's rendezvous value,
/// up to 8 per rank and level in a split's key, with room to spare.
constexpr uint32_t kFieldBytesPerRank = 64;
/// Connections beyond one per rank (see above).
constexpr int kConnectionMargin = 16;

/// What a server admits and a client may send (NOTE [store bounds]).
struct Limits {
  /// The largest key or value of a request or reply.
  uint32_t max_field_bytes = kBaseFieldBytes;
  /// Connections open at once; the server closes any more as soon as it accepts them.
  int max_connections = 1 + kConnectionMargin;

  /// The limits of a job of `world_size` ranks (at least 1).
  static constexpr Limits ForWorld(int world_size) {
    const uint64_t ranks = world_size < 1 ? 1 : static_cast<uint64_t>(world_size);
    const uint64_t field = kBaseFieldBytes + kFieldBytesPerRank * ranks;
    Limits limits;
    limits.max_field_bytes = static_cast<uint32_t>(field < (256u << 20) ? field : (256u << 20));
    limits.max_connections = ranks < (1u << 30) ? static_cast<int>(ranks) + kConnectionMargin
                                                : (1 << 30) + kConnectionMargin;
    return limits;
  }

  /// The largest frame payload: an opcode and three fields (compareSet), each with its length.
  constexpr uint32_t max_frame_bytes() const { return 1 + 3 * (4 + max_field_bytes); }
};

/// Builds one frame's payload.
class Encoder {
 public:
  Encoder& U8(uint8_t value) {
    payload_.push_back(static_cast<char>(value));
    return *this;
  }
  Encoder& I64(int64_t value) {
    const auto bits = static_cast<uint64_t>(value);
    for (int shift = 56; shift >= 0; shift -= 8) U8(static_cast<uint8_t>(bits >> shift));
    return *this;
  }
  Encoder& Bytes(std::string_view bytes) {
    U32(static_cast<uint32_t>(bytes.size()));
    payload_.append(bytes);
    return *this;
  }
  Encoder& Bytes(const std::vector<uint8_t>& bytes) {
    return Bytes(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  }
  Encoder& Keys(const std::vector<std::string>& keys) {
    U32(static_cast<uint32_t>(keys.size()));
    for (const std::string& key : keys) Bytes(key);
    return *this;
  }
  /// The payload with its length in front: what goes on the wire.
  std::string Frame() const {
    std::string frame;
    const auto size = static_cast<uint32_t>(payload_.size());
    for (int shift = 24; shift >= 0; shift -= 8) frame.push_back(static_cast<char>(size >> shift));
    return frame + payload_;
  }

 private:
  void U32(uint32_t value) {
    for (int shift = 24; shift >= 0; shift -= 8) U8(static_cast<uint8_t>(value >> shift));
  }

  std::string payload_;
};

/// Reads one frame's payload. A read past the end sets !ok() and returns zeros, so a
/// malformed frame is detected once, after decoding.
class Decoder {
 public:
  explicit Decoder(std::string_view payload) : in_(payload) {}

  uint8_t U8() {
    if (!Need(1)) return 0;
    return static_cast<uint8_t>(in_[pos_++]);
  }
  int64_t I64() {
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits = (bits << 8) | U8();
    return static_cast<int64_t>(bits);
  }
  std::string Bytes() {
    const uint32_t size = U32();
    if (!Need(size)) return {};
    std::string bytes(in_.substr(pos_, size));
    pos_ += size;
    return bytes;
  }
  std::vector<std::string> Keys() {
    const uint32_t count = U32();
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < count && ok_; ++i) keys.push_back(Bytes());
    return keys;
  }
  /// Whether every read was in bounds and the payload was used up.
  bool Done() const { return ok_ && pos_ == in_.size(); }

 private:
  uint32_t U32() {
    uint32_t value = 0;
    for (int i = 0; i < 4; ++i) value = (value << 8) | U8();
    return value;
  }
  bool Need(size_t bytes) {
    if (in_.size() - pos_ < bytes) ok_ = false;
    return ok_;
  }

  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

/// The payload length a frame header announces (the first 4 bytes of `header`).
inline uint32_t FrameLength(std::string_view header) {
  uint32_t size = 0;
  for (int i = 0; i < 4; ++i) size = (size << 8) | static_cast<uint8_t>(header[i]);
  return size;
}

inline std::vector<uint8_t> ToVector(const std::string& bytes) {
  return std::vector<uint8_t>(bytes.begin(), bytes.end());
}

}  // namespace fulcrum::parallel::internal::store_protocol
