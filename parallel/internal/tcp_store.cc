// TcpStore (tcp_store.h): the client side of the rendezvous store. Every socket operation
// waits in poll() up to the call's deadline, so no call can outlive its bound.
#include "parallel/internal/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "parallel/internal/c10d_util.h"
#include "parallel/internal/store_protocol.h"

namespace fulcrum::parallel::internal {
namespace {

using Clock = std::chrono::steady_clock;
using store_protocol::Decoder;
using store_protocol::Encoder;
using store_protocol::Op;
using store_protocol::Status;

// How a socket operation ended.
enum class Io { kOk, kTimeout, kClosed, kError };

// Milliseconds poll() may wait before `deadline` (-1: forever), at least 0.
int PollMillis(const std::optional<Clock::time_point>& deadline) {
  if (!deadline) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 60 * 60 * 1000));
}

// Waits until `fd` is ready for `events` or `deadline` passes.
Io WaitFor(int fd, short events, const std::optional<Clock::time_point>& deadline) {
  for (;;) {
    pollfd polled{fd, events, 0};
    const int ready = poll(&polled, 1, PollMillis(deadline));
    if (ready > 0) return Io::kOk;  // Errors and hang-ups show in the read or write that follows.
    if (ready < 0 && errno != EINTR) return Io::kError;
    if (ready == 0 && deadline && Clock::now() >= *deadline) return Io::kTimeout;
  }
}

Io SendAll(int fd, const std::string& bytes, const std::optional<Clock::time_point>& deadline) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (const Io io = WaitFor(fd, POLLOUT, deadline); io != Io::kOk) return io;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return errno == EPIPE || errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
  }
  return Io::kOk;
}

Io ReceiveExactly(int fd, size_t size, std::string* out,
                  const std::optional<Clock::time_point>& deadline) {
  out->resize(size);
  size_t received = 0;
  while (received < size) {
    const ssize_t n = recv(fd, out->data() + received, size - received, 0);
    if (n > 0) {
      received += static_cast<size_t>(n);
    } else if (n == 0) {
      return Io::kClosed;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (const Io io = WaitFor(fd, POLLIN, deadline); io != Io::kOk) return io;
    } else if (errno != EINTR) {
      return errno == ECONNRESET ? Io::kClosed : Io::kError;
    }
  }
  return Io::kOk;
}

// One attempt to connect to host:port, trying each address it resolves to. Returns the
// connected (non-blocking) socket, or -1 with *error set; *resolved tells whether the name
// resolved at all.
int ConnectOnce(const std::string& host, uint16_t port,
                const std::optional<Clock::time_point>& deadline, std::string* error,
                bool* resolved) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* addresses = nullptr;
  const std::string port_text = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &addresses); rc != 0) {
    *resolved = false;
    *error = absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc));
    return -1;
  }
  *resolved = true;
  int connected = -1;
  for (addrinfo* ai = addresses; ai != nullptr && connected < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *error = absl::StrCat("socket: ", strerror(errno));
      continue;
    }
    int status = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
    if (status == EINPROGRESS) {
      const Io io = WaitFor(fd, POLLOUT, deadline);
      socklen_t length = sizeof(status);
      if (io == Io::kTimeout) {
        status = ETIMEDOUT;
      } else if (io != Io::kOk || getsockopt(fd, SOL_SOCKET, SO_ERROR, &status, &length) != 0) {
        status = errno;
      }
    }
    if (status != 0) {
      *error = strerror(status);
      close(fd);
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    connected = fd;
  }
  freeaddrinfo(addresses);
  return connected;
}

// A key for messages; a long one (a split's key lists its members) is cut.
std::string Quoted(const std::string& key) {
  constexpr size_t kShown = 120;
  if (key.size() <= kShown) return absl::StrCat("'", key, "'");
  return absl::StrCat("'", key.substr(0, kShown), "...' (", key.size(), " bytes)");
}

std::string QuotedKeys(const std::vector<std::string>& keys) {
  std::string text;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) {
    absl::StrAppend(&text, i == 0 ? "" : ", ", Quoted(keys[i]));
  }
  if (keys.size() > 4) absl::StrAppend(&text, " and ", keys.size() - 4, " more");
  return text;
}

[[noreturn]] void ThrowMalformed(const std::string& address, const std::string& what) {
  throw std::runtime_error(
      absl::StrCat("store at ", address, ": ", what, ": malformed reply (not a Fulcrum store?)"));
}

}  // namespace

TcpStore::TcpStore(std::string host, uint16_t port, std::chrono::milliseconds timeout,
                   const store_protocol::Limits& limits)
    : c10d::Store(timeout),
      host_(std::move(host)),
      port_(port),
      address_(
          absl::StrCat(host_.find(':') == std::string::npos ? host_ : absl::StrCat("[", host_, "]"),
                       ":", port)),
      limits_(limits) {}

c10::intrusive_ptr<TcpStore> TcpStore::Connect(const std::string& host, uint16_t port,
                                               std::chrono::milliseconds timeout,
                                               const store_protocol::Limits& limits,
                                               std::shared_ptr<StoreServer> hosted) {
  auto store = c10::make_intrusive<TcpStore>(host, port, timeout, limits);
  store->hosted_ = std::move(hosted);
  // The server may not listen yet (rank 0 starts a moment later): retry refusals, more
  // often at first.
  const Clock::time_point deadline = Clock::now() + timeout;
  auto pause = std::chrono::milliseconds(10);
  std::string error;
  for (;;) {
    bool resolved = true;
    store->fd_ = ConnectOnce(host, port, deadline, &error, &resolved);
    if (store->fd_ >= 0) return store;
    if (!resolved)
      throw std::runtime_error(absl::StrCat("store at ", store->address_, ": ", error));
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, left));
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
  ThrowC10dTimeout(absl::StrCat("store at ", store->address_, ": could not connect within ",
                                timeout.count(), " ms (", error, ")"));
}

TcpStore::~TcpStore() { Disconnect(); }

c10::intrusive_ptr<c10d::Store> TcpStore::clone() {
  auto copy = c10::make_intrusive<TcpStore>(host_, port_, timeout_, limits_);
  copy->hosted_ = hosted_;
  return copy;
}

TcpStore::Deadline TcpStore::DeadlineAfter(std::chrono::milliseconds timeout) const {
  if (timeout == c10d::Store::kNoTimeout) return std::nullopt;
  return Clock::now() + timeout;
}

void TcpStore::CheckField(const std::string& what, const char* kind, size_t bytes) const {
  if (bytes <= limits_.max_field_bytes) return;
  throw std::invalid_argument(absl::StrCat(
      "store at ", address_, ": ", what, ": the ", kind, " has ", bytes,
      " bytes, more than the store's limit of ", limits_.max_field_bytes,
      " bytes for a job of this size (NOTE [store bounds] in parallel/internal/store_protocol.h)"));
}

void TcpStore::Disconnect() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void TcpStore::EnsureConnected(const std::string& what, Deadline deadline,
                               std::chrono::milliseconds bound) {
  if (fd_ >= 0) return;
  std::string error;
  bool resolved = true;
  fd_ = ConnectOnce(host_, port_, deadline, &error, &resolved);
  if (fd_ >= 0) return;
  if (deadline && Clock::now() >= *deadline) {
    ThrowC10dTimeout(absl::StrCat("store at ", address_, ": ", what,
                                  ": could not reconnect within ", bound.count(), " ms (", error,
                                  ")"));
  }
  throw std::runtime_error(absl::StrCat("store at ", address_, ": ", what, ": cannot reconnect (",
                                        error, "); has its host, rank 0, exited?"));
}

std::string TcpStore::Call(const std::string& frame, const std::string& what, Deadline deadline,
                           std::chrono::milliseconds bound) {
  // Keys and values were checked by the callers; a key list may still be too long.
  if (frame.size() - 4 > limits_.max_frame_bytes()) {
    throw std::invalid_argument(absl::StrCat("store at ", address_, ": ", what, ": the request has ",
                                             frame.size() - 4, " bytes, more than the store's limit of ",
                                             limits_.max_frame_bytes(), " bytes"));
  }
  std::unique_lock<std::timed_mutex> lock(mutex_, std::defer_lock);
  if (!deadline) {
    lock.lock();
  } else if (!lock.try_lock_until(*deadline)) {
    ThrowC10dTimeout(absl::StrCat("store at ", address_, ": ", what, " timed out after ",
                                  bound.count(), " ms waiting for another call on this client"));
  }
  EnsureConnected(what, deadline, bound);

  std::string header;
  std::string reply;
  Io io = SendAll(fd_, frame, deadline);
  if (io == Io::kOk) io = ReceiveExactly(fd_, 4, &header, deadline);
  if (io == Io::kOk) {
    const uint32_t length = store_protocol::FrameLength(header);
    if (length == 0 || length > limits_.max_frame_bytes()) {
      Disconnect();
      ThrowMalformed(address_, what);
    }
    io = ReceiveExactly(fd_, length, &reply, deadline);
  }
  if (io != Io::kOk) {
    const int error = errno;
    // A reply may still come, and would answer the next call: start that one afresh.
    Disconnect();
    if (io == Io::kTimeout) {
      ThrowC10dTimeout(absl::StrCat("store at ", address_, ": ", what, " timed out after ",
                                    bound.count(), " ms"));
    }
    throw std::runtime_error(
        absl::StrCat("store at ", address_, ": ", what, ": ",
                     io == Io::kClosed ? "the connection was closed" : strerror(error),
                     " (has its host, rank 0, exited?)"));
  }
  if (static_cast<Status>(reply[0]) == Status::kError) {
    Decoder in(std::string_view(reply).substr(1));
    const std::string message = in.Bytes();
    throw std::runtime_error(absl::StrCat("store at ", address_, ": ", message));
  }
  if (static_cast<Status>(reply[0]) != Status::kOk) {
    Disconnect();
    ThrowMalformed(address_, what);
  }
  return reply.substr(1);
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  SetWithin(key, value, timeout_);
}

void TcpStore::SetWithin(const std::string& key, const std::vector<uint8_t>& value,
                         std::chrono::milliseconds timeout) {
  const std::string what = absl::StrCat("set ", Quoted(key));
  CheckField(what, "key", key.size());
  CheckField(what, "value", value.size());
  Call(Encoder().U8(static_cast<uint8_t>(Op::kSet)).Bytes(key).Bytes(value).Frame(), what,
       DeadlineAfter(timeout), timeout);
}

std::vector<uint8_t> TcpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& currentValue,
                                          const std::vector<uint8_t>& newValue) {
  const std::string what = absl::StrCat("compareSet ", Quoted(key));
  CheckField(what, "key", key.size());
  CheckField(what, "expected value", currentValue.size());
  CheckField(what, "new value", newValue.size());
  const std::string reply = Call(Encoder()
                                     .U8(static_cast<uint8_t>(Op::kCompareSet))
                                     .Bytes(key)
                                     .Bytes(currentValue)
                                     .Bytes(newValue)
                                     .Frame(),
                                 what, DeadlineAfter(timeout_), timeout_);
  Decoder in(reply);
  std::string value = in.Bytes();
  if (!in.Done()) ThrowMalformed(address_, what);
  return store_protocol::ToVector(value);
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  const std::string what = absl::StrCat("get ", Quoted(key));
  CheckField(what, "key", key.size());
  const std::string reply = Call(Encoder().U8(static_cast<uint8_t>(Op::kGet)).Bytes(key).Frame(),
                                 what, DeadlineAfter(timeout_), timeout_);
  Decoder in(reply);
  std::string value = in.Bytes();
  if (!in.Done()) ThrowMalformed(address_, what);
  return store_protocol::ToVector(value);
}

int64_t TcpStore::add(const std::string& key, int64_t value) {
  const std::string what = absl::StrCat("add to ", Quoted(key));
  CheckField(what, "key", key.size());
  const std::string reply =
      Call(Encoder().U8(static_cast<uint8_t>(Op::kAdd)).Bytes(key).I64(value).Frame(), what,
           DeadlineAfter(timeout_), timeout_);
  Decoder in(reply);
  const int64_t sum = in.I64();
  if (!in.Done()) ThrowMalformed(address_, what);
  return sum;
}

bool TcpStore::deleteKey(const std::string& key) {
  const std::string what = absl::StrCat("deleteKey ", Quoted(key));
  CheckField(what, "key", key.size());
  const std::string reply =
      Call(Encoder().U8(static_cast<uint8_t>(Op::kDeleteKey)).Bytes(key).Frame(), what,
           DeadlineAfter(timeout_), timeout_);
  Decoder in(reply);
  const bool deleted = in.U8() != 0;
  if (!in.Done()) ThrowMalformed(address_, what);
  return deleted;
}

bool TcpStore::check(const std::vector<std::string>& keys) { return CheckWithin(keys, timeout_); }

bool TcpStore::CheckWithin(const std::vector<std::string>& keys,
                           std::chrono::milliseconds timeout) {
  const std::string what = absl::StrCat("check ", QuotedKeys(keys));
  const std::string reply = Call(Encoder().U8(static_cast<uint8_t>(Op::kCheck)).Keys(keys).Frame(),
                                 what, DeadlineAfter(timeout), timeout);
  Decoder in(reply);
  const bool all = in.U8() != 0;
  if (!in.Done()) ThrowMalformed(address_, what);
  return all;
}

int64_t TcpStore::getNumKeys() {
  const std::string reply = Call(Encoder().U8(static_cast<uint8_t>(Op::kNumKeys)).Frame(),
                                 "getNumKeys", DeadlineAfter(timeout_), timeout_);
  Decoder in(reply);
  const int64_t count = in.I64();
  if (!in.Done()) ThrowMalformed(address_, "getNumKeys");
  return count;
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) {
  const std::string what = absl::StrCat("wait for ", QuotedKeys(keys));
  const std::string reply = Call(Encoder().U8(static_cast<uint8_t>(Op::kWait)).Keys(keys).Frame(),
                                 what, DeadlineAfter(timeout), timeout);
  if (!reply.empty()) ThrowMalformed(address_, what);
}

void SetWithin(c10d::Store& store, const std::string& key, const std::vector<uint8_t>& value,
               std::chrono::milliseconds timeout) {
  if (auto* tcp = dynamic_cast<TcpStore*>(&store)) {
    tcp->SetWithin(key, value, timeout);
  } else {
    store.set(key, value);
  }
}

bool CheckWithin(c10d::Store& store, const std::vector<std::string>& keys,
                 std::chrono::milliseconds timeout) {
  if (auto* tcp = dynamic_cast<TcpStore*>(&store)) return tcp->CheckWithin(keys, timeout);
  return store.check(keys);
}

}  // namespace fulcrum::parallel::internal
