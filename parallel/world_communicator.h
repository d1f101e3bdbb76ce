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

#include <c10/core/Device.h>

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

/// Resolves --distributed_backend against the device the job computes on, before any
/// work: "auto" is nccl on a CUDA device and gloo on the CPU; "gloo" and "nccl" are taken
/// as they are but must fit the device. `have_nccl` is HaveNccl() (a parameter so tests can
/// ask about either build).
///
/// Errors, each naming the flag, the value and the device: InvalidArgument for an unknown
/// name; FailedPrecondition for nccl on the CPU (NCCL moves CUDA memory only);
/// Unimplemented for nccl, or auto on a CUDA device, in a build without NCCL. gloo on a
/// CUDA device is allowed: its tensors are staged through host memory (NOTE [host
/// staging] in parallel/host_staged_communicator.h) — slow, but several ranks can share
/// one GPU, which NCCL refuses.
absl::StatusOr<Backend> ResolveBackend(std::string_view name, const c10::Device& device,
                                       bool have_nccl);

/// Connects to the job's store (ConnectStore) and creates the world communicator of
/// `backend`, bounded by `timeout`, which then bounds every operation of the communicator.
/// Gloo binds to loopback when the master is on loopback, else as GlooOptions defaults
/// (GLOO_SOCKET_IFNAME, else the hostname), and carries non-CPU tensors by staging them
/// through host memory (HostStagedCommunicator). NCCL uses GPU `world.local_rank`, and comes
/// paired with a Gloo communicator over the same ranks for CPU control values
/// (SplitPlaneCommunicator, NOTE [control plane]); its backend() is "nccl+gloo".
///
/// Errors: those of ConnectStore and the backend's factory; Unimplemented for kNccl in a
/// build without NCCL.
absl::StatusOr<std::unique_ptr<Communicator>> CreateWorldCommunicator(
    const WorldInfo& world, Backend backend, std::chrono::milliseconds timeout);

}  // namespace fulcrum::parallel
