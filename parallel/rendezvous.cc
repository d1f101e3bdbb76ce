#include "parallel/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "parallel/internal/c10d_util.h"
#include "parallel/internal/communicator_util.h"
#include "parallel/internal/tcp_store.h"

namespace fulcrum::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Counts the ranks that reached the store (see ConnectStore).
constexpr char kJoinedKey[] = "fulcrum/rendezvous/joined";

// The store reports a connect timeout as c10d::TimeoutError; the elapsed time is a second
// opinion, should another error come at the deadline.
bool LooksLikeTimeout(const std::exception& e, Clock::duration elapsed,
                      std::chrono::milliseconds timeout) {
  if (internal::IsC10dTimeout(e)) return true;
  return elapsed >= timeout * 9 / 10;
}

// Every rank counts itself in and waits for the others, so a rank that never started is
// reported here, with the count, instead of later as an opaque communicator timeout.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> WaitForEveryRank(
    c10::intrusive_ptr<c10d::Store> store, const WorldInfo& world, const std::string& where,
    Clock::time_point deadline, std::chrono::milliseconds timeout, const char* role) {
  int64_t joined = 0;
  try {
    joined = store->add(kJoinedKey, 1);
    auto pause = std::chrono::milliseconds(5);
    while (joined < world.world_size && Clock::now() < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
      joined = store->add(kJoinedKey, 0);
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "rendezvous: lost the master at ", where, " while waiting for the other ranks (rank ",
        world.rank, " of ", world.world_size, "): ", internal::ExceptionMessage(e)));
  }
  if (joined < world.world_size) {
    return absl::DeadlineExceededError(absl::StrCat(
        "rendezvous: only ", joined, " of ", world.world_size, " ranks reached the master at ",
        where, " within ", timeout.count(), " ms (rank ", world.rank, " of ", world.world_size,
        "); were all ranks started, with the same MASTER_ADDR/MASTER_PORT?"));
  }
  FULCRUM_LOG(INFO) << "rendezvous: rank " << world.rank << " of " << world.world_size << " "
                    << role << " the store at " << where;
  return store;
}

}  // namespace

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const WorldInfo& world,
                                                             std::chrono::milliseconds timeout) {
  if (world.world_size < 1 || world.rank < 0 || world.rank >= world.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: rank ", world.rank,
                                                   " is outside a world of ", world.world_size,
                                                   " processes"));
  }
  if (timeout.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: timeout must be positive, got ", timeout.count(), " ms"));
  }
  // One process needs no network: an in-memory store serves the communicator's own keys,
  // and no port is opened that another job could collide with.
  if (world.world_size == 1) return internal::MakeHashStore(timeout);

  if (world.master_port <= 0 || world.master_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: MASTER_PORT must be in [1, 65535], got ", world.master_port));
  }
  if (world.master_addr.empty()) {
    return absl::InvalidArgumentError("rendezvous: MASTER_ADDR is empty");
  }
  const std::string where = absl::StrCat(world.master_addr, ":", world.master_port);
  const bool is_server = world.rank == 0;
  const auto port = static_cast<uint16_t>(world.master_port);
  const auto start = Clock::now();
  const auto deadline = start + timeout;

  // Under torchrun's agent every rank is a client of the agent's store, and this attempt's
  // keys get a prefix of their own (a restarted job must not read the last one's).
  if (world.agent_store) {
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = internal::MakePrefixStore(absl::StrCat("fulcrum/attempt_", world.restart_count, "/"),
                                        internal::ConnectC10dTcpStore(world.master_addr, port,
                                                                      timeout));
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat(
          "rendezvous: could not reach torchrun's agent store at ", where, " (rank ", world.rank,
          " of ", world.world_size, "): ", internal::ExceptionMessage(e)));
    }
    return WaitForEveryRank(std::move(store), world, where, deadline, timeout,
                            "joined torchrun's");
  }

  // Rank 0 hosts the server on MASTER_ADDR's interface only (NOTE [own store] in
  // internal/tcp_store.h) and is then a client like every other rank.
  // Its keys, values and connections are bounded by what a job of this size needs (NOTE
  // [store bounds] in internal/store_protocol.h).
  const auto limits = internal::store_protocol::Limits::ForWorld(world.world_size);
  std::shared_ptr<internal::StoreServer> server;
  if (is_server) {
    absl::StatusOr<std::unique_ptr<internal::StoreServer>> started =
        internal::StoreServer::Start(world.master_addr, port, limits);
    if (!started.ok()) {
      return absl::UnavailableError(absl::StrCat("rendezvous: rank 0 could not host the master at ",
                                                 where, ": ", started.status().message()));
    }
    server = std::move(started).value();
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = internal::TcpStore::Connect(world.master_addr, port, timeout, limits, std::move(server));
  } catch (const std::exception& e) {
    const std::string cause = internal::ExceptionMessage(e);
    if (is_server) {
      return absl::UnavailableError(absl::StrCat(
          "rendezvous: rank 0 could not reach the master it hosts at ", where, ": ", cause));
    }
    if (LooksLikeTimeout(e, Clock::now() - start, timeout)) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous: could not reach the master at ", where, " within ",
                       timeout.count(), " ms (rank ", world.rank, " of ", world.world_size,
                       "); is rank 0 running and MASTER_ADDR/MASTER_PORT right?"));
    }
    return absl::UnavailableError(absl::StrCat(
        "rendezvous: could not reach the master at ", where, " (rank ", world.rank, " of ",
        world.world_size, "): ", cause, "; is rank 0 running and MASTER_ADDR/MASTER_PORT right?"));
  }

  return WaitForEveryRank(std::move(store), world, where, deadline, timeout,
                          is_server ? "hosts" : "joined");
}

}  // namespace fulcrum::parallel
