// Rendezvous: the key-value store through which the processes of a job find each other.
// Rank 0 hosts the store's server at MASTER_ADDR:MASTER_PORT, listening on MASTER_ADDR's
// interface only (loopback stays loopback), and every rank, rank 0 included, connects to it
// as a client (internal/tcp_store.h); communicators exchange their connection details (Gloo
// addresses, NCCL unique ids) through it. A one-process job gets an in-memory store and
// opens no port.
//
// Thread-safety: ConnectStore may be called from any thread; the returned c10d::Store is
// itself thread-safe.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>

#include "absl/status/statusor.h"
#include "parallel/world.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace fulcrum::parallel {

/// Connects this process to the job's store. Rank 0 listens on world.master_port on the
/// address(es) world.master_addr resolves to (MASTER_ADDR's interface, not every interface);
/// every rank connects to world.master_addr:world.master_port, retrying until `timeout`, and
/// waits until all world.world_size ranks have connected. Every operation of the store
/// (set, get, wait...) is bounded by `timeout` too.
///
/// Errors: InvalidArgument for an inconsistent `world`; DeadlineExceeded when the master
/// cannot be reached, or not every rank joined, within `timeout`; Unavailable when the
/// master cannot listen (port in use; MASTER_ADDR is not an address of rank 0's host) or
/// the address cannot be resolved. Messages name the address, the rank and the likely fix.
absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const WorldInfo& world,
                                                             std::chrono::milliseconds timeout);

}  // namespace fulcrum::parallel
