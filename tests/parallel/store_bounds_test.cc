// Tests of what the rendezvous store admits (NOTE [store bounds] in
// parallel/internal/store_protocol.h): a real server on loopback, the job's clients, and raw
// sockets playing a stray client (a port scanner, a misdirected job). The server must close
// what no rank would send, keep what it buffers bounded, and go on serving the ranks.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/internal/c10d_util.h"
#include "parallel/internal/store_protocol.h"
#include "parallel/internal/tcp_store.h"

namespace fulcrum::parallel::internal {
namespace {

using ::testing::HasSubstr;
using std::chrono::milliseconds;
using store_protocol::Limits;

std::unique_ptr<StoreServer> StartServer(const Limits& limits) {
  auto server = StoreServer::Start("127.0.0.1", 0, limits);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(server).value() : nullptr;
}

c10::intrusive_ptr<TcpStore> Rank(const StoreServer& server, const Limits& limits) {
  return TcpStore::Connect("127.0.0.1", server.port(), milliseconds(5000), limits);
}

// A 4-byte big-endian frame header announcing `length` bytes.
std::string Header(uint32_t length) {
  std::string header;
  for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<char>(length >> shift));
  return header;
}

// A client that speaks raw bytes to the server.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval two_seconds{2, 0};  // A send the server never reads must not hang the test.
    setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &two_seconds, sizeof(two_seconds));
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~RawClient() { close(fd_); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  // Sends `bytes`; the number sent before the server closed the connection (or the send
  // timed out).
  size_t Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    return sent;
  }

  // Whether the server closed the connection within `wait` (reading and dropping whatever
  // it sent).
  bool ClosedByServer(milliseconds wait) {
    const auto deadline = std::chrono::steady_clock::now() + wait;
    char buffer[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd polled{fd_, POLLIN, 0};
      if (poll(&polled, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) <= 0) {
        return false;
      }
      const ssize_t n = recv(fd_, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// This process's resident set: the server runs in it, on its own thread.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

TEST(StoreBoundsTest, LimitsGrowWithTheWorldSize) {
  const Limits small = Limits::ForWorld(8);
  EXPECT_EQ(small.max_connections, 8 + store_protocol::kConnectionMargin);
  EXPECT_EQ(small.max_field_bytes,
            store_protocol::kBaseFieldBytes + 8 * store_protocol::kFieldBytesPerRank);
  EXPECT_EQ(small.max_frame_bytes(), 1 + 3 * (4 + small.max_field_bytes));
  const Limits large = Limits::ForWorld(100000);
  EXPECT_EQ(large.max_connections, 100000 + store_protocol::kConnectionMargin);
  EXPECT_EQ(large.max_field_bytes, store_protocol::kBaseFieldBytes + 6400000u);
}

TEST(StoreBoundsTest, AClientRefusesAnOverLimitKeyOrValueBeforeSendingIt) {
  const Limits limits = Limits::ForWorld(8);
  auto server = StartServer(limits);
  ASSERT_NE(server, nullptr);
  auto rank = Rank(*server, limits);

  // The largest value goes there and back.
  const std::vector<uint8_t> largest(limits.max_field_bytes, 7);
  rank->set("largest", largest);
  EXPECT_EQ(rank->get("largest"), largest);

  const std::vector<uint8_t> too_large(limits.max_field_bytes + 1, 7);
  const std::string bound = std::to_string(limits.max_field_bytes);
  const std::string size = std::to_string(limits.max_field_bytes + 1);
  try {
    rank->set("big", too_large);
    ADD_FAILURE() << "an over-limit value was sent";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("set 'big': the value has " + size +
                                    " bytes, more than the store's limit of " + bound + " bytes"));
  }
  EXPECT_THROW(rank->compareSet("big", {}, too_large), std::invalid_argument);
  const std::string long_key(limits.max_field_bytes + 1, 'k');
  try {
    rank->get(long_key);
    ADD_FAILURE() << "an over-limit key was sent";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("get 'kkkk"));
    EXPECT_THAT(e.what(), HasSubstr("...' (" + size + " bytes): the key has " + size + " bytes"));
  }
  // Keys of a list are each in bounds, the request is not.
  const std::vector<std::string> keys(4, std::string(limits.max_field_bytes, 'k'));
  try {
    rank->wait(keys);
    ADD_FAILURE() << "an over-limit key list was sent";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("more than the store's limit of " +
                                    std::to_string(limits.max_frame_bytes()) + " bytes"));
  }
  // Nothing reached the server; the connection is as good as before.
  EXPECT_FALSE(rank->check({"big"}));
  EXPECT_EQ(rank->add("n", 1), 1);
}

TEST(StoreBoundsTest, ClosesFramesLongerThanTheProtocolNeedsAndServesTheRanks) {
  const Limits limits = Limits::ForWorld(2);
  auto server = StartServer(limits);
  ASSERT_NE(server, nullptr);
  auto rank0 = Rank(*server, limits);
  auto rank1 = Rank(*server, limits);
  rank0->set("before", {1});

  // One byte over the largest request, and the 64 MiB the server used to accept.
  for (const uint32_t length : {limits.max_frame_bytes() + 1, 64u << 20}) {
    RawClient stray(server->port());
    ASSERT_TRUE(stray.connected());
    stray.Send(Header(length) + std::string(1024, 'x'));
    EXPECT_TRUE(stray.ClosedByServer(milliseconds(2000))) << "a frame of " << length << " bytes";
  }
  // A request of ours, then more than a frame behind it before its reply was read.
  {
    RawClient stray(server->port());
    ASSERT_TRUE(stray.connected());
    const std::string get = store_protocol::Encoder()
                                .U8(static_cast<uint8_t>(store_protocol::Op::kGet))
                                .Bytes("never set")
                                .Frame();
    stray.Send(get + std::string(limits.max_frame_bytes() + 8, 'x'));
    EXPECT_TRUE(stray.ClosedByServer(milliseconds(2000)));
  }
  // A frame within bounds is not closed for its size.
  {
    RawClient partial(server->port());
    ASSERT_TRUE(partial.connected());
    partial.Send(Header(limits.max_frame_bytes()) + std::string(1024, 'x'));
    EXPECT_FALSE(partial.ClosedByServer(milliseconds(200)));
  }

  EXPECT_EQ(rank1->get("before"), std::vector<uint8_t>{1});
  rank1->set("after", {2});
  EXPECT_EQ(rank0->get("after"), std::vector<uint8_t>{2});
}

TEST(StoreBoundsTest, ClosesConnectionsBeyondTheWorldSizeAndAMargin) {
  const Limits limits = Limits::ForWorld(2);
  auto server = StartServer(limits);
  ASSERT_NE(server, nullptr);
  auto rank0 = Rank(*server, limits);
  auto rank1 = Rank(*server, limits);
  EXPECT_EQ(rank0->add("n", 1), 1);  // Both ranks are connected before the strays come.
  EXPECT_EQ(rank1->add("n", 1), 2);

  std::vector<std::unique_ptr<RawClient>> strays;
  for (int i = 2; i < limits.max_connections; ++i) {
    strays.push_back(std::make_unique<RawClient>(server->port()));
    ASSERT_TRUE(strays.back()->connected());
  }
  RawClient one_too_many(server->port());
  ASSERT_TRUE(one_too_many.connected());  // The kernel accepts; the server closes it.
  EXPECT_TRUE(one_too_many.ClosedByServer(milliseconds(2000)));
  for (auto& stray : strays) EXPECT_FALSE(stray->ClosedByServer(milliseconds(10)));

  // The ranks are served all along.
  EXPECT_EQ(rank0->add("n", 1), 3);
  EXPECT_EQ(rank1->add("n", 1), 4);

  // A freed slot takes a new client, once the server has seen the close (until then it
  // closes the newcomer at accept, before any request).
  strays.pop_back();
  int64_t sum = 0;
  for (int attempt = 0; attempt < 100 && sum == 0; ++attempt) {
    try {
      sum = Rank(*server, limits)->add("n", 1);
    } catch (const std::runtime_error&) {
      std::this_thread::sleep_for(milliseconds(50));
    }
  }
  EXPECT_EQ(sum, 5);
}

TEST(StoreBoundsTest, WhatStrayClientsSendStaysBounded) {
  const Limits limits = Limits::ForWorld(4);
  auto server = StartServer(limits);
  ASSERT_NE(server, nullptr);
  auto rank = Rank(*server, limits);
  rank->set("k", {1});
  const int64_t before = ResidentBytes();

  // The attack: frames of 48 MiB, 8 MiB of each sent. Then as many connections as
  // the server takes, each holding one frame of the largest size, all but its last byte.
  std::vector<std::unique_ptr<RawClient>> strays;
  size_t sent = 0;
  for (int i = 0; i < 8; ++i) {
    strays.push_back(std::make_unique<RawClient>(server->port()));
    sent += strays.back()->Send(Header(48u << 20) + std::string(8u << 20, 'x'));
  }
  const std::string almost_a_frame =
      Header(limits.max_frame_bytes()) + std::string(limits.max_frame_bytes() - 1, 'x');
  for (int i = 0; i < 2 * limits.max_connections; ++i) {
    strays.push_back(std::make_unique<RawClient>(server->port()));
    sent += strays.back()->Send(almost_a_frame);
  }
  EXPECT_EQ(rank->get("k"), std::vector<uint8_t>{1});
  std::this_thread::sleep_for(milliseconds(300));  // Whatever the server reads, it has read.
  const int64_t grown = ResidentBytes() - before;

  // At most 4 + kConnectionMargin connections of at most one frame of 4 ranks' fields and
  // one byte of input each (about 4 MB), where the server used to hold all that came: 64 MiB
  // and more. (From the constants, not from `limits`, which are what is tested.)
  const int64_t frame = 1 + 3 * (4 + store_protocol::kBaseFieldBytes +
                                 4 * store_protocol::kFieldBytesPerRank);
  const int64_t bound = (4 + store_protocol::kConnectionMargin) * (4 + frame + 1);
  EXPECT_LT(grown, bound + (8 << 20)) << "sent " << sent << " bytes; bound " << bound;
  EXPECT_EQ(rank->get("k"), std::vector<uint8_t>{1});
}

// A c10d client that records the largest key and value set through it.
class RecordingStore : public TcpStore {
 public:
  RecordingStore(uint16_t port, const Limits& limits, std::atomic<size_t>* largest_value)
      : TcpStore("127.0.0.1", port, milliseconds(20000), limits), largest_value_(largest_value) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    size_t seen = largest_value_->load();
    while (value.size() > seen && !largest_value_->compare_exchange_weak(seen, value.size())) {
    }
    TcpStore::set(key, value);
  }

 private:
  std::atomic<size_t>* largest_value_;
};

// Builds a Gloo process group of `size` ranks (threads) over a server whose limits admit
// exactly one connection per rank; returns the largest value any rank set.
size_t LargestGlooRendezvousValue(int size) {
  Limits limits = Limits::ForWorld(size);
  limits.max_connections = size;  // No margin: a second connection of a rank would fail.
  auto server = StartServer(limits);
  if (server == nullptr) return 0;
  std::atomic<size_t> largest{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto store = c10::make_intrusive<RecordingStore>(server->port(), limits, &largest);
        auto group = MakeGlooProcessGroup(MakePrefixStore("world", store), r, size,
                                          milliseconds(20000), MakeGlooDevice("", "127.0.0.1"), 1);
        std::vector<at::Tensor> tensors = {at::ones({1})};
        group->allreduce(tensors)->wait();
        if (tensors[0].item<float>() != static_cast<float>(size)) ++failures;
      } catch (const std::exception& e) {
        ++failures;
        ADD_FAILURE() << "rank " << r << " of " << size << ": " << e.what();
      }
    });
  }
  for (std::thread& rank : ranks) rank.join();
  EXPECT_EQ(failures.load(), 0);
  return largest.load();
}

// The bounds are sized by measuring what Gloo's rendezvous stores, at two world sizes.
TEST(StoreBoundsTest, GlooRendezvousFitsTheLimitsOfItsWorldSize) {
  const size_t at2 = LargestGlooRendezvousValue(2);
  const size_t at8 = LargestGlooRendezvousValue(8);
  ASSERT_GT(at2, 0u);
  ASSERT_GT(at8, at2);  // It grows with the world...
  const double per_rank = static_cast<double>(at8 - at2) / 6;
  // ...by 8 bytes (a pair id) per rank in LibTorch 2.11's Gloo, well within the budget.
  EXPECT_LE(per_rank, store_protocol::kFieldBytesPerRank / 4) << at2 << " -> " << at8;
  // So a million ranks fit too.
  const double at_million = static_cast<double>(at2) + per_rank * (1000000 - 2);
  EXPECT_LE(at_million, Limits::ForWorld(1000000).max_field_bytes);
}

}  // namespace
}  // namespace fulcrum::parallel::internal
