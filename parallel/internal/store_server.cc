// StoreServer (tcp_store.h): binds the addresses MASTER_ADDR resolves to and serves the
// key-value map from one poll() thread.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "parallel/internal/store_protocol.h"
#include "parallel/internal/tcp_store.h"

namespace fulcrum::parallel::internal {
namespace {

using store_protocol::Decoder;
using store_protocol::Encoder;
using store_protocol::Limits;
using store_protocol::Op;
using store_protocol::Status;

std::string NumericHost(const sockaddr* address, socklen_t length) {
  char host[NI_MAXHOST] = {};
  if (getnameinfo(address, length, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) {
    return "?";
  }
  return host;
}

void SetPort(sockaddr* address, uint16_t port) {
  if (address->sa_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(address)->sin_port = htons(port);
  } else if (address->sa_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(address)->sin6_port = htons(port);
  }
}

// One client connection of the serving thread.
struct Connection {
  int fd = -1;
  std::string in;      // Received bytes not yet handled.
  std::string out;     // Reply bytes not yet sent.
  std::string parked;  // A get or wait whose keys do not all exist yet (its payload).
  bool closed = false;
};

// What handling one request did.
struct Outcome {
  enum Kind { kReply, kPark, kDrop } kind = kReply;  // kDrop: malformed, close the connection.
  std::string reply;                                 // A whole frame, for kReply.
};

// The map and the requests that change or read it. Runs on the serving thread only.
class KeyValueMap {
 public:
  // Handles one request payload; *changed tells whether a key was created or updated (so
  // parked requests may now be answerable).
  Outcome Handle(const std::string& request, bool* changed) {
    Decoder in(request);
    const auto op = static_cast<Op>(in.U8());
    switch (op) {
      case Op::kSet: {
        std::string key = in.Bytes();
        std::string value = in.Bytes();
        if (!in.Done()) return Drop();
        map_[std::move(key)] = std::move(value);
        *changed = true;
        return Ok(Reply());
      }
      case Op::kCompareSet: {
        std::string key = in.Bytes();
        std::string expected = in.Bytes();
        std::string desired = in.Bytes();
        if (!in.Done()) return Drop();
        auto it = map_.find(key);
        if (it == map_.end()) {
          if (!expected.empty()) return Ok(Reply().Bytes(expected));  // As c10d does.
          it = map_.emplace(std::move(key), std::move(desired)).first;
          *changed = true;
        } else if (it->second == expected) {
          it->second = std::move(desired);
          *changed = true;
        }
        return Ok(Reply().Bytes(it->second));
      }
      case Op::kGet: {
        const std::string key = in.Bytes();
        if (!in.Done()) return Drop();
        auto it = map_.find(key);
        if (it == map_.end()) return Park();
        return Ok(Reply().Bytes(it->second));
      }
      case Op::kAdd: {
        std::string key = in.Bytes();
        const int64_t delta = in.I64();
        if (!in.Done()) return Drop();
        int64_t sum = delta;
        auto it = map_.find(key);
        if (it != map_.end()) {
          int64_t current = 0;
          if (!absl::SimpleAtoi(it->second, &current)) {
            return Error(absl::StrCat("add to '", key, "': its value is not an integer"));
          }
          sum = current + delta;
        }
        map_[std::move(key)] = std::to_string(sum);
        *changed = true;
        return Ok(Reply().I64(sum));
      }
      case Op::kDeleteKey: {
        const std::string key = in.Bytes();
        if (!in.Done()) return Drop();
        return Ok(Reply().U8(map_.erase(key) > 0 ? 1 : 0));
      }
      case Op::kCheck: {
        const std::vector<std::string> keys = in.Keys();
        if (!in.Done()) return Drop();
        return Ok(Reply().U8(AllExist(keys) ? 1 : 0));
      }
      case Op::kNumKeys:
        if (!in.Done()) return Drop();
        return Ok(Reply().I64(static_cast<int64_t>(map_.size())));
      case Op::kWait: {
        const std::vector<std::string> keys = in.Keys();
        if (!in.Done()) return Drop();
        if (!AllExist(keys)) return Park();
        return Ok(Reply());
      }
    }
    return Drop();  // Unknown opcode: not one of our clients.
  }

 private:
  static Encoder Reply() {
    Encoder reply;
    reply.U8(static_cast<uint8_t>(Status::kOk));
    return reply;
  }
  static Outcome Ok(const Encoder& reply) { return {Outcome::kReply, reply.Frame()}; }
  static Outcome Error(const std::string& message) {
    return Ok(Encoder().U8(static_cast<uint8_t>(Status::kError)).Bytes(message));
  }
  static Outcome Park() { return {Outcome::kPark, {}}; }
  static Outcome Drop() { return {Outcome::kDrop, {}}; }

  bool AllExist(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (map_.count(key) == 0) return false;
    }
    return true;
  }

  std::unordered_map<std::string, std::string> map_;
};

// The most input a connection may hold: one frame (NOTE [store bounds]) and one byte, which
// tells that more than a frame came.
size_t InputCap(const Limits& limits) { return 4 + size_t{limits.max_frame_bytes()} + 1; }

// Whether `in` starts with a whole frame (or with the header of one too long to accept).
bool HasWholeFrame(const std::string& in, const Limits& limits) {
  if (in.size() < 4) return false;
  const uint32_t length = store_protocol::FrameLength(in);
  return length > limits.max_frame_bytes() || in.size() >= 4 + size_t{length};
}

// Handles what `connection` sent, one request at a time: the next waits until the reply to
// the last has been sent and no request is parked (so replies stay in order, and the server
// holds one reply per connection).
void HandleInput(Connection& connection, KeyValueMap& map, const Limits& limits, bool* changed) {
  while (!connection.closed && connection.parked.empty() && connection.out.empty() &&
         connection.in.size() >= 4) {
    const uint32_t length = store_protocol::FrameLength(connection.in);
    if (length > limits.max_frame_bytes()) {
      connection.closed = true;
      return;
    }
    if (connection.in.size() < 4 + static_cast<size_t>(length)) return;
    std::string request = connection.in.substr(4, length);
    connection.in.erase(0, 4 + static_cast<size_t>(length));
    Outcome outcome = map.Handle(request, changed);
    if (outcome.kind == Outcome::kDrop) {
      connection.closed = true;
    } else if (outcome.kind == Outcome::kPark) {
      connection.parked = std::move(request);
    } else {
      connection.out += outcome.reply;
    }
  }
  // Our clients wait for each reply: one piling up more than a frame behind a request is not
  // one of ours.
  if (connection.in.size() >= InputCap(limits)) connection.closed = true;
}

// Answers the parked requests that the last changes made answerable; repeats while that
// changes the map again. (What their connections sent next waits for the reply to go out.)
void ResumeParked(std::vector<Connection>& connections, KeyValueMap& map, const Limits& limits,
                  bool changed) {
  while (changed) {
    changed = false;
    for (Connection& connection : connections) {
      if (connection.closed || connection.parked.empty()) continue;
      Outcome outcome = map.Handle(connection.parked, &changed);
      if (outcome.kind == Outcome::kPark) continue;
      connection.parked.clear();
      connection.out += outcome.reply;  // get and wait are never kDrop once parsed.
      HandleInput(connection, map, limits, &changed);
    }
  }
}

// Reads what `connection` sent, up to InputCap bytes held (the rest waits in the socket).
void Receive(Connection& connection, const Limits& limits) {
  char buffer[64 * 1024];
  const size_t cap = InputCap(limits);
  while (connection.in.size() < cap) {
    const ssize_t n =
        recv(connection.fd, buffer, std::min(sizeof(buffer), cap - connection.in.size()), 0);
    if (n > 0) {
      connection.in.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    connection.closed = true;  // 0: the client closed; < 0: reset or another error.
    return;
  }
}

void Send(Connection& connection) {
  while (!connection.out.empty() && !connection.closed) {
    const ssize_t n =
        send(connection.fd, connection.out.data(), connection.out.size(), MSG_NOSIGNAL);
    if (n > 0) {
      connection.out.erase(0, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;  // The rest goes when poll() says the socket is writable.
    } else {
      connection.closed = true;
    }
  }
}

// Accepts the connections waiting on `listen_fd`; those beyond limits.max_connections are
// closed at once (*refused counts them, for the log).
void Accept(int listen_fd, std::vector<Connection>& connections, const Limits& limits,
            uint64_t* refused) {
  for (;;) {
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&peer), &peer_length,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;  // EAGAIN: no more; other errors (EMFILE, a reset): the client retries.
    }
    if (connections.size() >= static_cast<size_t>(limits.max_connections)) {
      close(fd);
      // The 1st, 2nd, 4th, 8th... refusal: a scanner hammering the port cannot flood the log.
      const uint64_t count = ++*refused;
      if ((count & (count - 1)) == 0) {
        FULCRUM_LOG(WARNING) << "store: closed a connection from "
                             << NumericHost(reinterpret_cast<sockaddr*>(&peer), peer_length)
                             << ": already " << connections.size()
                             << " open, the most a job of this size needs (" << count
                             << " closed so far)";
      }
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Connection connection;
    connection.fd = fd;
    connections.push_back(std::move(connection));
  }
}

void CloseAll(std::vector<int>& fds) {
  for (int fd : fds) close(fd);
  fds.clear();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host,
                                                                uint16_t port,
                                                                const Limits& limits) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &resolved); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve MASTER_ADDR=", host, ": ", gai_strerror(rc)));
  }

  // Every address the name resolves to ("localhost" may be 127.0.0.1 and ::1), each once;
  // those that are not this machine's are skipped, and if none is, that is the error.
  std::vector<int> fds;
  std::set<std::string> seen;
  std::vector<std::string> foreign;
  uint16_t bound_port = port;
  absl::Status failure;
  for (addrinfo* ai = resolved; ai != nullptr && failure.ok(); ai = ai->ai_next) {
    const std::string numeric = NumericHost(ai->ai_addr, ai->ai_addrlen);
    if (!seen.insert(numeric).second) continue;
    const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      failure = absl::UnavailableError(absl::StrCat("socket for ", numeric, ": ", strerror(errno)));
      break;
    }
    // As c10d does: a restarted job may reuse the port while the last job's connections
    // are in TIME_WAIT.
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    SetPort(ai->ai_addr, bound_port);  // Port 0 binds any port, then the same on the rest.
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      const int error = errno;
      close(fd);
      if (error == EADDRNOTAVAIL) {
        foreign.push_back(numeric);
        continue;
      }
      failure = absl::UnavailableError(
          absl::StrCat("cannot listen on ", numeric, ":", bound_port, ": ", strerror(error),
                       error == EADDRINUSE ? "; is MASTER_PORT already in use?" : ""));
      break;
    }
    if (listen(fd, SOMAXCONN) != 0) {
      failure = absl::UnavailableError(
          absl::StrCat("cannot listen on ", numeric, ":", bound_port, ": ", strerror(errno)));
      close(fd);
      break;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0) {
      bound_port =
          ntohs(local.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&local)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
    }
    fds.push_back(fd);
  }
  freeaddrinfo(resolved);
  if (failure.ok() && fds.empty()) {
    failure = absl::UnavailableError(
        absl::StrCat("MASTER_ADDR=", host, " is not an address of rank 0's host (it resolves to ",
                     absl::StrJoin(foreign, ", "),
                     "); set MASTER_ADDR to an address of the machine that "
                     "runs rank 0"));
  }
  if (!failure.ok()) {
    CloseAll(fds);
    return failure;
  }

  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    const std::string error = strerror(errno);
    CloseAll(fds);
    return absl::UnavailableError(absl::StrCat("store server: pipe: ", error));
  }
  return std::unique_ptr<StoreServer>(
      new StoreServer(std::move(fds), wake[0], wake[1], bound_port, limits));
}

StoreServer::StoreServer(std::vector<int> listen_fds, int wake_read_fd, int wake_write_fd,
                         uint16_t port, const Limits& limits)
    : listen_fds_(std::move(listen_fds)),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      limits_(limits) {
  thread_ = std::thread([this] { Serve(); });
}

StoreServer::~StoreServer() {
  const char stop = 0;
  while (write(wake_write_fd_, &stop, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  CloseAll(listen_fds_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void StoreServer::Serve() {
  KeyValueMap map;
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  uint64_t refused = 0;
  for (;;) {
    polled.clear();
    polled.push_back({wake_read_fd_, POLLIN, 0});
    for (int fd : listen_fds_) polled.push_back({fd, POLLIN, 0});
    // A request received while the last reply was still being sent waits in `in`: handle it
    // now rather than when the socket next becomes readable.
    bool runnable = false;
    for (const Connection& connection : connections) {
      polled.push_back(
          {connection.fd, static_cast<short>(POLLIN | (connection.out.empty() ? 0 : POLLOUT)), 0});
      runnable |= connection.out.empty() && connection.parked.empty() &&
                  HasWholeFrame(connection.in, limits_);
    }
    if (poll(polled.data(), polled.size(), runnable ? 0 : -1) < 0) continue;  // EINTR.
    if (polled[0].revents != 0) break;

    const size_t first_connection = 1 + listen_fds_.size();
    bool changed = false;
    for (size_t i = 0; i < connections.size(); ++i) {
      const short revents = polled[first_connection + i].revents;
      Connection& connection = connections[i];
      if (revents & (POLLIN | POLLHUP | POLLERR)) Receive(connection, limits_);
      HandleInput(connection, map, limits_, &changed);
    }
    ResumeParked(connections, map, limits_, changed);
    for (Connection& connection : connections) Send(connection);
    // Closed connections go (their parked requests with them); new ones come last, so the
    // indices above matched `polled`.
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->closed) {
        close(it->fd);
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
    for (size_t i = 0; i < listen_fds_.size(); ++i) {
      if (polled[1 + i].revents & POLLIN) Accept(listen_fds_[i], connections, limits_, &refused);
    }
  }
  for (Connection& connection : connections) close(connection.fd);
}

}  // namespace fulcrum::parallel::internal
