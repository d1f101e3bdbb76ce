// The job's rendezvous store over TCP: StoreServer, the key-value map that rank 0 hosts, and
// TcpStore, the c10d::Store client every rank (rank 0 included) talks to it through.
//
// NOTE [own store]: Fulcrum has its own store instead of c10d's TCPStore for two reasons.
//  - c10d 1.13's TCPStore server listens on every interface (getaddrinfo(nullptr,
//    AI_PASSIVE)) with no option to bind one address, so a job on MASTER_ADDR=127.0.0.1 was
//    reachable, unauthenticated, from other machines. StoreServer listens on the address(es)
//    MASTER_ADDR resolves to and nothing else.
//  - c10d's client bounds every reply by the timeout it was created with, so the failure
//    probe of a communicator (gloo_communicator.cc) waited the whole timeout again when rank
//    0 was stopped. Every TcpStore call has a deadline, and SetWithin/CheckWithin give the
//    probe a shorter one.
//
// Wire format (both directions): frames of a 4-byte big-endian length and that many bytes.
// A request is an opcode byte and its fields; a reply is a status byte (ok or error) and its
// fields. Strings and byte vectors are a 4-byte length and the bytes; integers are 8 bytes,
// big-endian. A client sends one request at a time and waits for its reply. Keys, values,
// frames and connections are bounded by the job's world size (NOTE [store bounds] in
// store_protocol.h).
//
// Thread-safety: a StoreServer serves from one thread of its own; its methods may be called
// from any thread. TcpStore is thread-safe: calls are serialized over its one connection, and
// waiting for the connection counts against a call's deadline.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/internal/store_protocol.h"

namespace fulcrum::parallel::internal {

/// The server: a key-value map served to TcpStore clients from one thread (poll()). Requests
/// that wait for keys (get, wait) are parked until another client sets them; a client that
/// gives up closes its connection, which drops its parked request. A connection beyond
/// `limits.max_connections`, a frame longer than `limits.max_frame_bytes()` or more than a
/// frame sent before the last request was answered is closed, and the server goes on
/// serving the others.
class StoreServer {
 public:
  /// Listens on the addresses `host` resolves to (not on every interface), port `port`
  /// (0: any free port, see port()), with SO_REUSEADDR as c10d sets it. Errors (all
  /// Unavailable): `host` does not resolve; none of its addresses belongs to this machine
  /// ("MASTER_ADDR=<host> is not an address of rank 0's host"); the port is in use.
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(const std::string& host, uint16_t port,
                                                            const store_protocol::Limits& limits);

  /// Stops serving and closes every connection: clients' calls fail at once.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  /// The port it listens on.
  uint16_t port() const { return port_; }

 private:
  StoreServer(std::vector<int> listen_fds, int wake_read_fd, int wake_write_fd, uint16_t port,
              const store_protocol::Limits& limits);
  void Serve();

  std::vector<int> listen_fds_;  // One per bound address.
  int wake_read_fd_;             // A pipe whose write end stops Serve().
  int wake_write_fd_;
  uint16_t port_;
  store_protocol::Limits limits_;
  std::thread thread_;
};

/// A client of a StoreServer, with c10d's semantics: get waits (up to the store's timeout)
/// for the key to exist; wait blocks until all keys exist; add creates the key at 0 and is
/// atomic, keeping the number as decimal text (as c10d does, so get returns "3"); compareSet
/// sets the key when its value equals `currentValue` (or when it is missing and
/// `currentValue` is empty) and returns the value it has afterwards (c10d returns
/// `currentValue` for a missing key with a non-empty one, and so does this).
///
/// Every call is bounded by the store's timeout (getTimeout(); kNoTimeout waits forever).
/// A call that runs out of time throws c10d::TimeoutError and drops the connection (a late
/// reply would otherwise answer the next call); the next call reconnects once. A connection
/// that breaks (the server's process died) throws std::runtime_error naming the store. A
/// key or value longer than the limits' max_field_bytes (or a key list whose request would
/// be longer than a frame) throws std::invalid_argument naming the call and both sizes,
/// before anything is sent; the connection stays usable.
class TcpStore : public c10d::Store {
 public:
  /// A client of host:port that connects on first use, without retrying. `limits` must be
  /// those of the server (Limits::ForWorld of the same world size).
  TcpStore(std::string host, uint16_t port, std::chrono::milliseconds timeout,
           const store_protocol::Limits& limits);

  /// Connects to host:port, retrying a refused connection (the server may not be listening
  /// yet) until `timeout` passes: then it throws c10d::TimeoutError. Other errors (the host
  /// does not resolve) throw std::runtime_error at once. `timeout` also becomes the store's
  /// timeout. `hosted`, when set, is the server this process runs; the client (and its
  /// clones) keep it alive.
  static c10::intrusive_ptr<TcpStore> Connect(const std::string& host, uint16_t port,
                                              std::chrono::milliseconds timeout,
                                              const store_protocol::Limits& limits,
                                              std::shared_ptr<StoreServer> hosted = nullptr);

  ~TcpStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                  const std::vector<uint8_t>& newValue) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  /// A new client of the same server (c10d::Store::clone).
  c10::intrusive_ptr<c10d::Store> clone() override;

  /// set and check bounded by `timeout` instead of the store's timeout: the failure probe's
  /// calls, which a stopped server must not hold for the whole store timeout.
  void SetWithin(const std::string& key, const std::vector<uint8_t>& value,
                 std::chrono::milliseconds timeout);
  bool CheckWithin(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  /// "127.0.0.1:29500", for messages.
  const std::string& address() const { return address_; }

 private:
  using Clock = std::chrono::steady_clock;
  using Deadline = std::optional<Clock::time_point>;  // nullopt: no deadline.

  // Sends a request `frame` and returns the reply's fields (after the status byte), all
  // before `deadline`; `what` names the call in errors ("get 'key'"), `bound` is the time it
  // was given. Throws as the class comment says.
  std::string Call(const std::string& frame, const std::string& what, Deadline deadline,
                   std::chrono::milliseconds bound);
  void EnsureConnected(const std::string& what, Deadline deadline, std::chrono::milliseconds bound);
  void Disconnect();
  Deadline DeadlineAfter(std::chrono::milliseconds timeout) const;
  // Throws std::invalid_argument when `field` (a key or value of call `what`) is longer than
  // the limits allow.
  void CheckField(const std::string& what, const char* kind, size_t bytes) const;

  std::string host_;
  uint16_t port_;
  std::string address_;
  store_protocol::Limits limits_;
  std::shared_ptr<StoreServer> hosted_;
  std::timed_mutex mutex_;  // Serializes calls; a call waits for it up to its deadline.
  int fd_ = -1;             // The connection, or -1 before the first call and after a failure.
};

/// store.set(key, value), bounded by `timeout` when `store` is a TcpStore (other stores, such
/// as the in-memory store of a one-process job, do not block).
void SetWithin(c10d::Store& store, const std::string& key, const std::vector<uint8_t>& value,
               std::chrono::milliseconds timeout);

/// store.check(keys), bounded as SetWithin is.
bool CheckWithin(c10d::Store& store, const std::vector<std::string>& keys,
                 std::chrono::milliseconds timeout);

}  // namespace fulcrum::parallel::internal
