// The one call a program makes to join the job: rendezvous through the store, then the
// world communicator of the chosen backend. Everything else (tp, dp, pp, ep groups) is
// split from it.
//
//   FULCRUM_ASSIGN_OR_RETURN(WorldInfo world, WorldInfoFromEnvironment());
//   FULCRUM_ASSIGN_OR_RETURN(auto comm, CreateWorldCommunicator(world, Backend::kGloo,
//                                                               std::chrono::seconds(300)));
//
// Thread-safety: CreateWorldCommunicator may be called from any thread.
#pragma once

#include <chrono>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/world.h"

namespace fulcrum::parallel {

enum class Backend { kGloo, kNccl };

/// "gloo" or "nccl".
const char* BackendName(Backend backend);

/// Parses "gloo" or "nccl"; InvalidArgument naming the value otherwise.
absl::StatusOr<Backend> ParseBackend(std::string_view name);

/// Whether this build has the NCCL backend (CUDA toolkit and NCCL found at configure time).
bool HaveNccl();

/// Connects to the job's store (ConnectStore) and creates the world communicator of
/// `backend`, bounded by `timeout`, which then bounds every operation of the communicator.
/// Gloo binds to loopback when the master is on loopback, else as GlooOptions defaults
/// (GLOO_SOCKET_IFNAME, else the hostname). NCCL uses GPU `world.local_rank`.
///
/// Errors: those of ConnectStore and the backend's factory; Unimplemented for kNccl in a
/// build without NCCL.
absl::StatusOr<std::unique_ptr<Communicator>> CreateWorldCommunicator(
    const WorldInfo& world, Backend backend, std::chrono::milliseconds timeout);

}  // namespace fulcrum::parallel
