// The Gloo backend of Communicator: c10d::ProcessGroupGloo over TCP, for CPU tensors. What
// tests and CI use, and what a CPU-only job trains with.
//
// Behaviour worth knowing (see communicator.h for the common contract):
//  - Every operation waits for completion, bounded by timeout(). A failure (a peer died, a
//    timeout, mismatched calls) throws CommError naming the operation, the communicator and
//    the members that went silent, and leaves the communicator unusable: its later calls
//    throw at once instead of waiting out another timeout against a broken mesh.
//  - bfloat16, which Gloo lacks, is reduced in float32 and moved as raw 16-bit words.
//  - ReduceScatter costs an all_reduce (see ReduceScatter in gloo_communicator.cc).
//  - Split builds a new process group among the members only, through the store. A Split
//    that fails (a member never called it) leaves this communicator usable, but that
//    (name, ranks) must not be split again: the members' split counts no longer agree.
//  - Creating a communicator ignores SIGPIPE for the process when it is at its default
//    (as Python does), so a peer that dies mid-send raises CommError instead of killing
//    this process.
//
// Thread-safety: as Communicator (one thread at a time).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace fulcrum::parallel {

/// Where Gloo's TCP transport listens for its peers.
struct GlooOptions {
  /// Network interface to bind, e.g. "eth0". Default: empty, meaning $GLOO_SOCKET_IFNAME
  /// when set (the variable torchrun users know), else `hostname`.
  std::string interface;
  /// Address or hostname to bind. Default: empty, meaning the address this machine's
  /// hostname resolves to, or loopback when it does not resolve. CreateWorldCommunicator
  /// sets "127.0.0.1" when the master is on loopback, so one-machine jobs stay on it.
  std::string hostname;
};

/// The world communicator ("world") of `size` processes, this one being `rank`, meeting
/// through `store` (see ConnectStore). Every rank calls it with the same `size` and
/// `timeout`; it returns once all of them are connected. `timeout` bounds the connection
/// and, afterwards, every operation.
///
/// Errors: InvalidArgument for a bad rank/size/timeout or a null store; DeadlineExceeded
/// when not every rank connected within `timeout`; Unavailable when the transport cannot
/// bind (bad interface or hostname) or the store fails.
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
    const GlooOptions& options = {});

}  // namespace fulcrum::parallel
