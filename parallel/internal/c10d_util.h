// The communicator layer's few direct uses of c10d (LibTorch 2.11): the in-memory and
// prefix stores, Gloo's transport and process group, c10d's timeout exception and reduce
// ops. Include it from .cc files only: it pulls in c10d and Gloo headers, which are heavy.
//
// Worth knowing:
//  - ProcessGroupGloo is a c10d::Backend; its Options are Backend::Options with the Gloo
//    devices and the worker-thread count added.
//  - USE_C10D_GLOO, which guards ProcessGroupGloo.hpp, comes with LibTorch's CMake target
//    (INTERFACE_COMPILE_DEFINITIONS of torch_cpu), as it does for LibTorch's own code.
//  - c10d throws subclasses of c10::Error (DistBackendError, DistNetworkError,
//    DistStoreError, TimeoutError); callers catch std::exception and tell a timeout by its
//    type (IsC10dTimeout) or by the time it took, since not every timeout is reported as
//    c10d::TimeoutError.
//
// Thread-safety: stateless functions.
#pragma once

#include <torch/csrc/distributed/c10d/exception.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "parallel/communicator.h"

namespace fulcrum::parallel::internal {

using GlooDevice = std::shared_ptr<::gloo::transport::Device>;

/// An in-process store, for a one-process job.
inline c10::intrusive_ptr<c10d::Store> MakeHashStore(std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(timeout);
  return store;
}

/// A client of the c10d TCPStore at host:port that another process hosts (torchrun's
/// elastic agent), connecting within `timeout`, which then bounds each of its calls. Throws
/// what c10d throws (DistNetworkError when it cannot connect in time).
inline c10::intrusive_ptr<c10d::Store> ConnectC10dTcpStore(const std::string& host,
                                                           uint16_t port,
                                                           std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = port;
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

/// A view of `store` whose keys all start with `prefix`.
inline c10::intrusive_ptr<c10d::Store> MakePrefixStore(const std::string& prefix,
                                                       c10::intrusive_ptr<c10d::Store> store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

/// Gloo's TCP transport bound to a network interface ("eth0") when `interface` is set, else
/// to the address `hostname` resolves to when set, else to this machine's hostname (falling
/// back to loopback when it does not resolve). Throws what c10d throws.
inline GlooDevice MakeGlooDevice(const std::string& interface, const std::string& hostname) {
  if (!interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  if (!hostname.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

/// A Gloo process group over `store` (whose keys it may use freely): connects to every
/// other member, bounded by `timeout`, which also bounds each of its operations.
/// `threads` is the number of worker threads running its collectives. Throws what c10d
/// throws.
inline c10::intrusive_ptr<c10d::ProcessGroupGloo> MakeGlooProcessGroup(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
    GlooDevice device, int threads) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(std::move(device));
  options->threads = threads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

/// Throws c10d::TimeoutError(message) (built with the throwing source location, as c10d
/// does).
[[noreturn]] inline void ThrowC10dTimeout(const std::string& message) {
  C10D_THROW_ERROR(TimeoutError, message);
}

/// Whether `e` is c10d's timeout exception. Not every timeout is reported this way (a
/// Gloo operation that times out throws DistBackendError), so callers also look at the clock.
inline bool IsC10dTimeout(const std::exception& e) {
  return dynamic_cast<const c10d::TimeoutError*>(&e) != nullptr;
}

inline c10d::ReduceOp ToC10dReduceOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp ", static_cast<int>(op));
}

}  // namespace fulcrum::parallel::internal
