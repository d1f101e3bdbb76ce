// The one place where the communicator layer touches c10d calls whose spelling differs
// between LibTorch 1.13 (Debian's libtorch-dev, the CPU build) and LibTorch 2.x (the CUDA
// build), so a 2.x build needs only this header changed. Include it from .cc files only:
// it pulls in c10d and Gloo headers, which are heavy.
//
// What differs, and what this header does about it:
//  - 2.x makes ProcessGroupGloo a c10d::Backend (not a ProcessGroup) and its Options a
//    Backend::Options; the constructor and the collective methods Fulcrum uses (allreduce,
//    allgather, broadcast, alltoall_base, send, recv, barrier) keep their 1.13 signatures.
//    MakeGlooProcessGroup hides the Options type and its default-timeout constant
//    (kProcessGroupDefaultTimeout in 1.13, kBackendDefaultTimeout in 2.x).
//  - c10d::TimeoutError is a std::runtime_error built from a message in 1.13 and a
//    c10::Error built from a source location and a message (C10D_THROW_ERROR) in 2.x;
//    ThrowC10dTimeout builds either. (Fulcrum's own store, tcp_store.h, throws it; c10d's
//    TCPStore, which differs more between versions, is not used.)
//  - c10d::Store gains virtuals in 2.x (append, multiGet, multiSet, hasExtendedApi with
//    defaults; clone, pure in recent versions); tcp_store.h declares clone without
//    `override` so that both compile.
//  - ProcessGroupGloo.hpp is guarded by USE_C10D_GLOO; LibTorch's CMake package defines it
//    for consumers of a Gloo-enabled build, and this header defines it for those that do not
//    propagate it.
//  - 2.x throws subclasses of c10::Error (DistBackendError, DistStoreError...) where 1.13
//    throws c10::Error or c10d::TimeoutError; callers catch std::exception and tell a
//    timeout by its type (IsC10dTimeout) or by the time it took, which works with both.
//  - Gloo in 1.13 has no reduce_scatter and no bfloat16; the Gloo communicator works around
//    both without c10d's help, so nothing here changes for them.
//
// Thread-safety: stateless functions.
#pragma once

#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif

#include <torch/csrc/distributed/c10d/exception.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
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

/// Throws c10d::TimeoutError(message), however this LibTorch constructs it.
[[noreturn]] inline void ThrowC10dTimeout(const std::string& message) {
#ifdef C10D_THROW_ERROR  // 2.x: TimeoutError(SourceLocation, message).
  C10D_THROW_ERROR(TimeoutError, message);
#else
  throw c10d::TimeoutError(message);
#endif
}

/// Whether `e` is c10d's own timeout exception (c10d::TimeoutError in 1.13). Not every
/// timeout is reported this way (2.x uses other types), so callers also look at the clock.
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
