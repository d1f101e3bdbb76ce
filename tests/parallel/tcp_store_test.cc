// Tests of the rendezvous store (parallel/internal/tcp_store.h) in one process: a server and
// clients in threads. c10d's semantics, the deadlines of blocking calls, and where the
// server listens.
#include "parallel/internal/tcp_store.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/csrc/distributed/c10d/exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/rendezvous.h"
#include "parallel/world.h"
#include "tests/run_command.h"

namespace fulcrum::parallel::internal {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::vector<uint8_t> Bytes(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string Text(const std::vector<uint8_t>& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

// The limits of the tests' servers and clients: those of an 8-rank job.
const store_protocol::Limits kLimits = store_protocol::Limits::ForWorld(8);

std::unique_ptr<StoreServer> StartLoopbackServer(
    const store_protocol::Limits& limits = kLimits) {
  auto server = StoreServer::Start("127.0.0.1", 0, limits);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(server).value() : nullptr;
}

c10::intrusive_ptr<TcpStore> Client(const StoreServer& server,
                                    milliseconds timeout = milliseconds(5000),
                                    const store_protocol::Limits& limits = kLimits) {
  return TcpStore::Connect("127.0.0.1", server.port(), timeout, limits);
}

// Runs `call`, expecting c10d::TimeoutError; returns how long it took and (in *message) why.
template <typename F>
Clock::duration TimeOut(F&& call, std::string* message = nullptr) {
  const auto start = Clock::now();
  try {
    call();
    ADD_FAILURE() << "did not time out";
  } catch (const c10d::TimeoutError& e) {
    if (message != nullptr) *message = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than c10d::TimeoutError: " << e.what();
  }
  return Clock::now() - start;
}

// A loopback listener that never accepts or answers: what a client of a stopped (SIGSTOP)
// server sees, since the kernel completes connections into the backlog by itself.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      ADD_FAILURE() << "cannot listen on loopback";
    }
    port_ = ntohs(address.sin_port);
  }
  ~SilentListener() { close(fd_); }
  uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

// This host's IPv4 addresses, loopback included.
std::vector<std::string> LocalIpv4Addresses() {
  std::vector<std::string> addresses;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) {
    ADD_FAILURE() << "getifaddrs failed";
    return addresses;
  }
  for (ifaddrs* it = interfaces; it != nullptr; it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(it->ifa_addr)->sin_addr, text, sizeof(text));
    addresses.push_back(text);
  }
  freeifaddrs(interfaces);
  return addresses;
}

// This host's IPv4 addresses outside 127.0.0.0/8.
std::vector<std::string> NonLoopbackIpv4Addresses() {
  std::vector<std::string> others;
  for (const std::string& address : LocalIpv4Addresses()) {
    if (address.rfind("127.", 0) != 0) others.push_back(address);
  }
  return others;
}

// The address RerunInANamespace gives the namespace's loopback interface (TEST-NET-2).
constexpr char kNamespaceAddress[] = "198.51.100.7";

// For a test whose addresses this host lacks (a CI container with only `lo`, or with IPv6
// turned off, as Docker does): runs the current test again in a network namespace of its
// own (util-linux's unshare), where `lo` is up with ::1 (when the kernel has IPv6) and also
// holds kNamespaceAddress (iproute2's ip; a dummy interface would do too, but not every
// kernel has the module). That takes root, which CI has: as root a failure to set it up
// fails the test; otherwise it is skipped, saying why (`lacking`).
void RerunInANamespace(const std::string& lacking) {
  if (std::getenv("FULCRUM_TEST_NETNS") != nullptr) {
    ADD_FAILURE() << "the network namespace made for this test has no " << lacking;
    return;
  }
  if (geteuid() != 0) {
    GTEST_SKIP() << "this host has no " << lacking
                 << ", and only root can make a network namespace with one (CI runs as root "
                    "and does)";
  }
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const std::string command =
      std::string("unshare --net sh -ec 'ip link set lo up; ip addr add ") + kNamespaceAddress +
      "/32 dev lo; FULCRUM_TEST_NETNS=1 exec " + self + " --gtest_filter=" +
      test->test_suite_name() + "." + test->name() + "'";
  std::string output;
  EXPECT_EQ(fulcrum::testing::RunCommand(command, &output), 0) << command << "\n" << output;
  EXPECT_THAT(output, HasSubstr("[==========] 1 test from 1 test suite ran.")) << output;
  EXPECT_THAT(output, HasSubstr("[  PASSED  ] 1 test.")) << output;
  EXPECT_THAT(output, ::testing::Not(HasSubstr("[  SKIPPED ]"))) << output;
}

// A loopback port that nothing listens on (bound, read, released).
uint16_t UnusedStorePort() {
  SilentListener listener;
  return listener.port();
}

// Whether a TCP connection to address:port succeeds.
bool CanConnect(const std::string& address, uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(port);
  inet_pton(AF_INET, address.c_str(), &target.sin_addr);
  const bool connected = connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)) == 0;
  close(fd);
  return connected;
}

// The local addresses (hex, as /proc/net/tcp{,6} spell them) of the sockets listening on
// `port`: what `ss -ltn` shows.
std::vector<std::string> ListeningAddresses(uint16_t port) {
  std::vector<std::string> addresses;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // Header.
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.find(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN.
      if (std::stoul(local.substr(colon + 1), nullptr, 16) == port) {
        addresses.push_back(local.substr(0, colon));
      }
    }
  }
  return addresses;
}

TEST(TcpStoreTest, SetGetAddCheckDeleteAndCount) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  auto store = Client(*server);
  EXPECT_EQ(store->getNumKeys(), 0);
  store->set("a", Bytes("alpha"));
  EXPECT_EQ(Text(store->get("a")), "alpha");
  store->set("a", Bytes(""));  // Overwrites; an empty value is a value.
  EXPECT_EQ(Text(store->get("a")), "");
  EXPECT_TRUE(store->check({"a"}));
  EXPECT_FALSE(store->check({"a", "b"}));

  EXPECT_EQ(store->add("n", 5), 5);  // Creates the key at 0.
  EXPECT_EQ(store->add("n", -2), 3);
  EXPECT_EQ(store->add("n", 0), 3);
  EXPECT_EQ(Text(store->get("n")), "3");  // Decimal text, as c10d keeps it.
  EXPECT_TRUE(store->check({"a", "n"}));
  EXPECT_EQ(store->getNumKeys(), 2);

  EXPECT_TRUE(store->deleteKey("a"));
  EXPECT_FALSE(store->deleteKey("a"));
  EXPECT_FALSE(store->check({"a"}));
  EXPECT_EQ(store->getNumKeys(), 1);

  // Another client sees the same map; binary values survive.
  const std::vector<uint8_t> binary = {0, 255, 10, 0, 7};
  store->set("bin", binary);
  EXPECT_EQ(Client(*server)->get("bin"), binary);

  store->set("text", Bytes("x"));
  try {
    store->add("text", 1);
    ADD_FAILURE() << "add to a non-number did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("add to 'text': its value is not an integer"));
  }
  EXPECT_EQ(store->add("n", 1), 4);  // The connection is still fine.
}

TEST(TcpStoreTest, CompareSetFollowsC10d) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  auto store = Client(*server);
  // Missing key, empty expected value: created.
  EXPECT_EQ(Text(store->compareSet("k", {}, Bytes("one"))), "one");
  // Matching value: replaced; the new value comes back.
  EXPECT_EQ(Text(store->compareSet("k", Bytes("one"), Bytes("two"))), "two");
  // Stale expected value: unchanged; the current value comes back.
  EXPECT_EQ(Text(store->compareSet("k", Bytes("one"), Bytes("three"))), "two");
  EXPECT_EQ(Text(store->get("k")), "two");
  // Missing key, non-empty expected value: c10d returns the expected value, sets nothing.
  EXPECT_EQ(Text(store->compareSet("m", Bytes("x"), Bytes("y"))), "x");
  EXPECT_FALSE(store->check({"m"}));
}

TEST(TcpStoreTest, GetAndWaitBlockUntilAnotherClientSetsTheKeys) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  auto waiter = Client(*server);
  auto setter = Client(*server);
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(200));
    setter->set("first", Bytes("1"));
    std::this_thread::sleep_for(milliseconds(200));
    setter->add("second", 2);
  });
  const auto start = Clock::now();
  EXPECT_EQ(Text(waiter->get("first")), "1");
  waiter->wait({"first", "second"});
  EXPECT_GE(Clock::now() - start, milliseconds(350));
  later.join();
  EXPECT_EQ(Text(waiter->get("second")), "2");
  waiter->wait({});  // Nothing to wait for.
}

TEST(TcpStoreTest, GetAndWaitTimeOutWithinTheirBound) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  auto store = Client(*server, milliseconds(300));
  std::string message;
  Clock::duration took = TimeOut([&] { store->get("never"); }, &message);
  EXPECT_GE(took, milliseconds(300));
  EXPECT_LT(took, milliseconds(800));
  EXPECT_THAT(message, HasSubstr("store at 127.0.0.1:" + std::to_string(server->port()) +
                                 ": get 'never' timed out after 300 ms"));

  took = TimeOut([&] { store->wait({"never", "nor"}); });
  EXPECT_GE(took, milliseconds(300));
  EXPECT_LT(took, milliseconds(800));
  took = TimeOut([&] { store->wait({"never"}, milliseconds(100)); });  // An explicit bound.
  EXPECT_GE(took, milliseconds(100));
  EXPECT_LT(took, milliseconds(600));

  // The timed-out calls left nothing behind: a key set now answers only the next call.
  Client(*server)->set("never", Bytes("late"));
  store->set("after", Bytes("ok"));
  EXPECT_EQ(Text(store->get("after")), "ok");
  EXPECT_EQ(Text(store->get("never")), "late");
}

TEST(TcpStoreTest, ConcurrentAddsSumExactly) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  constexpr int kThreads = 8;
  constexpr int kAddsPerThread = 300;
  auto shared = Client(*server);  // Half the threads share one client, half have their own.
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        auto own = t % 2 == 0 ? shared : Client(*server);
        for (int i = 0; i < kAddsPerThread; ++i) own->add("sum", t + 1);
      } catch (const std::exception& e) {
        ++failures;
        ADD_FAILURE() << "thread " << t << ": " << e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(shared->add("sum", 0), int64_t{kAddsPerThread} * kThreads * (kThreads + 1) / 2);
}

TEST(TcpStoreTest, WithinBoundsTheCallsOfAStoppedServer) {
  SilentListener stopped;
  auto store = TcpStore::Connect("127.0.0.1", stopped.port(), milliseconds(30000), kLimits);
  c10d::Store& as_c10d = *store;
  std::string message;
  Clock::duration took =
      TimeOut([&] { SetWithin(as_c10d, "fulcrum/probe", {1}, milliseconds(300)); }, &message);
  EXPECT_GE(took, milliseconds(300));
  EXPECT_LT(took, milliseconds(800));
  EXPECT_THAT(message, HasSubstr("set 'fulcrum/probe' timed out after 300 ms"));
  took = TimeOut([&] { CheckWithin(as_c10d, {"a", "b"}, milliseconds(300)); });
  EXPECT_LT(took, milliseconds(800));
}

TEST(TcpStoreTest, ConnectRetriesARefusedConnectionUntilItsTimeout) {
  const uint16_t port = UnusedStorePort();
  std::string message;
  const Clock::duration took =
      TimeOut([&] { TcpStore::Connect("127.0.0.1", port, milliseconds(500), kLimits); }, &message);
  EXPECT_GE(took, milliseconds(450));
  EXPECT_LT(took, milliseconds(1500));
  EXPECT_THAT(message, HasSubstr("store at 127.0.0.1:" + std::to_string(port) +
                                 ": could not connect within 500 ms"));

  // A server that starts while the client retries is found.
  std::unique_ptr<StoreServer> server;
  std::thread late([&] {
    std::this_thread::sleep_for(milliseconds(300));
    auto started = StoreServer::Start("127.0.0.1", port, kLimits);
    ASSERT_TRUE(started.ok()) << started.status();
    server = std::move(started).value();
  });
  auto store = TcpStore::Connect("127.0.0.1", port, milliseconds(5000), kLimits);
  late.join();
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(store->add("n", 1), 1);
}

TEST(TcpStoreTest, ACallToAServerThatExitedFailsAtOnceNamingTheStore) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  auto store = Client(*server, milliseconds(10000));
  store->set("k", Bytes("v"));
  server.reset();
  const auto start = Clock::now();
  try {
    store->set("k", Bytes("w"));
    ADD_FAILURE() << "set on a closed server did not throw";
  } catch (const c10d::TimeoutError& e) {
    ADD_FAILURE() << "a closed connection was reported as a timeout: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("store at 127.0.0.1:"));
    EXPECT_THAT(e.what(), HasSubstr("has its host, rank 0, exited?"));
  }
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
  EXPECT_THROW(store->get("k"), std::runtime_error);  // Reconnecting fails at once too.
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
}

TEST(StoreServerTest, RefusesAnAddressThatIsNotThisHosts) {
  // Addresses reserved for documentation (TEST-NET-3, -2, -1): the first this host lacks.
  const std::vector<std::string> local = LocalIpv4Addresses();
  std::string foreign;
  for (const char* candidate : {"203.0.113.1", "198.51.100.1", "192.0.2.1"}) {
    if (std::find(local.begin(), local.end(), candidate) == local.end()) {
      foreign = candidate;
      break;
    }
  }
  ASSERT_FALSE(foreign.empty()) << "this host has all three documentation addresses";
  auto server = StoreServer::Start(foreign, 0, kLimits);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("MASTER_ADDR=" + foreign + " is not an address of rank 0's host"));

  // The same through the rendezvous, as rank 0 of a job sees it.
  WorldInfo world;
  world.rank = 0;
  world.world_size = 2;
  world.master_addr = foreign;
  world.master_port = 29999;
  auto store = ConnectStore(world, milliseconds(1000));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(store.status().message()),
              HasSubstr("rendezvous: rank 0 could not host the master at " + foreign +
                        ":29999: MASTER_ADDR=" + foreign + " is not an address of rank 0's host"));
}

TEST(StoreServerTest, PortInUseIsAClearError) {
  SilentListener other;
  auto server = StoreServer::Start("127.0.0.1", other.port(), kLimits);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("is MASTER_PORT already in use?"));
}

TEST(StoreServerTest, ListensOnTheLoopbackAddressOnly) {
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(CanConnect("127.0.0.1", server->port()));
  // One listening socket, on 127.0.0.1 (0100007F in /proc/net/tcp), none on *.
  EXPECT_THAT(ListeningAddresses(server->port()), ::testing::ElementsAre("0100007F"));
}

TEST(StoreServerTest, IsNotReachableOnTheHostsOtherAddresses) {
  const std::vector<std::string> others = NonLoopbackIpv4Addresses();
  if (others.empty()) {
    RerunInANamespace("IPv4 address besides loopback");
    return;
  }
  auto server = StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  for (const std::string& address : others) {
    EXPECT_FALSE(CanConnect(address, server->port()))
        << "the store on 127.0.0.1 is reachable on " << address;
  }
  EXPECT_TRUE(CanConnect("127.0.0.1", server->port()));
}

TEST(StoreServerTest, OnANonLoopbackAddressListensThereOnly) {
  const std::vector<std::string> others = NonLoopbackIpv4Addresses();
  if (others.empty()) {
    RerunInANamespace("IPv4 address besides loopback");
    return;
  }
  const std::string address = others.back();
  auto server = StoreServer::Start(address, 0, kLimits);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(CanConnect(address, (*server)->port()));
  EXPECT_FALSE(CanConnect("127.0.0.1", (*server)->port()));
  EXPECT_EQ(ListeningAddresses((*server)->port()).size(), 1u);
  auto store = TcpStore::Connect(address, (*server)->port(), milliseconds(2000), kLimits);
  EXPECT_EQ(store->add("n", 2), 2);
}

TEST(StoreServerTest, ServesTheIpv6Loopback) {
  auto server = StoreServer::Start("::1", 0, kLimits);
  if (!server.ok()) {
    if (access("/proc/net/if_inet6", F_OK) != 0) {
      GTEST_SKIP() << "this kernel has no IPv6 (no /proc/net/if_inet6): " << server.status();
    }
    RerunInANamespace("IPv6 loopback address (" + server.status().ToString() + ")");
    return;
  }
  auto store = TcpStore::Connect("::1", (*server)->port(), milliseconds(2000), kLimits);
  EXPECT_EQ(store->address(), "[::1]:" + std::to_string((*server)->port()));
  EXPECT_EQ(store->add("n", 7), 7);
  EXPECT_FALSE(CanConnect("127.0.0.1", (*server)->port()));
}

TEST(RendezvousStoreTest, TwoRanksInThreadsShareTheStoreOnMasterAddr) {
  WorldInfo world;
  world.world_size = 2;
  world.master_addr = "127.0.0.1";
  world.master_port = UnusedStorePort();
  absl::StatusOr<c10::intrusive_ptr<c10d::Store>> stores[2];
  std::thread rank1([&] {
    WorldInfo mine = world;
    mine.rank = 1;
    stores[1] = ConnectStore(mine, milliseconds(5000));
  });
  stores[0] = ConnectStore(world, milliseconds(5000));
  rank1.join();
  ASSERT_TRUE(stores[0].ok()) << stores[0].status();
  ASSERT_TRUE(stores[1].ok()) << stores[1].status();
  EXPECT_THAT(ListeningAddresses(static_cast<uint16_t>(world.master_port)),
              ::testing::ElementsAre("0100007F"));
  (*stores[1])->set("from rank 1", Bytes("hello"));
  EXPECT_EQ(Text((*stores[0])->get("from rank 1")), "hello");
  EXPECT_NE(dynamic_cast<TcpStore*>(stores[0]->get()), nullptr);
}

}  // namespace
}  // namespace fulcrum::parallel::internal
