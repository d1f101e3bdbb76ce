#include "parallel/world_communicator.h"

#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "parallel/gloo_communicator.h"
#include "parallel/host_staged_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/rendezvous.h"
#include "parallel/split_plane_communicator.h"

namespace fulcrum::parallel {
namespace {

bool IsLoopback(const std::string& address) {
  return absl::StartsWith(address, "127.") || address == "localhost" || address == "::1";
}

}  // namespace

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(std::string_view name) {
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") return Backend::kNccl;
  return absl::InvalidArgumentError(absl::StrCat("unknown communication backend '",
                                                 std::string(name), "'; expected gloo or nccl"));
}

absl::StatusOr<Backend> ResolveBackend(std::string_view name, const c10::Device& device,
                                       bool have_nccl) {
  const std::string on = absl::StrCat("the device is ", device.str(), " (--device)");
  if (name != "auto" && name != "gloo" && name != "nccl") {
    return absl::InvalidArgumentError(absl::StrCat("unknown --distributed_backend '",
                                                   std::string(name),
                                                   "'; expected auto, gloo or nccl"));
  }
  const bool cuda = device.is_cuda();
  if (name == "auto") {
    if (!cuda) return Backend::kGloo;
    if (!have_nccl) {
      return absl::UnimplementedError(absl::StrCat(
          "--distributed_backend=auto picks nccl because ", on,
          ", but this build has no NCCL (CMake found no CUDA toolkit with NCCL); rebuild "
          "where both are installed, or train on --device=cpu"));
    }
    return Backend::kNccl;
  }
  if (name == "nccl") {
    if (!cuda) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--distributed_backend=nccl needs a CUDA device, but ", on,
          ": NCCL moves CUDA memory only; use --distributed_backend=gloo (or auto) on the CPU"));
    }
    if (!have_nccl) {
      return absl::UnimplementedError(
          "--distributed_backend=nccl: the nccl backend is not in this build (CMake found no "
          "CUDA toolkit with NCCL); use gloo on the CPU or rebuild where both are installed");
    }
    return Backend::kNccl;
  }
  // gloo on a GPU: the tensors are staged through host memory (NOTE [host staging]).
  return Backend::kGloo;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateWorldCommunicator(
    const WorldInfo& world, Backend backend, std::chrono::milliseconds timeout) {
  if (backend == Backend::kNccl && !HaveNccl()) {
    return absl::UnimplementedError(
        "the nccl backend is not in this build (CMake found no CUDA toolkit with NCCL); use "
        "gloo or rebuild where both are installed");
  }
  FULCRUM_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store, ConnectStore(world, timeout));
  GlooOptions options;
  if (IsLoopback(world.master_addr)) {
    options.hostname = world.master_addr == "::1" ? "::1" : "127.0.0.1";
  }
  switch (backend) {
    case Backend::kGloo: {
      // CPU tensors go straight to Gloo; a CUDA tensor is staged through host memory
      // (NOTE [host staging]), so one GPU can hold several ranks.
      FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> gloo,
                               CreateGlooCommunicator(std::move(store), world.rank,
                                                      world.world_size, timeout, options));
      return std::unique_ptr<Communicator>(
          std::make_unique<HostStagedCommunicator>(std::move(gloo)));
    }
    case Backend::kNccl: {
      // NOTE [control plane]: the tensors go through NCCL, the CPU control values through a
      // Gloo world over the same store (the two backends key their store entries apart).
      FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> tensor,
                               CreateNcclCommunicator(store, world.rank, world.world_size,
                                                      world.local_rank, timeout));
      FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> control,
                               CreateGlooCommunicator(std::move(store), world.rank,
                                                      world.world_size, timeout, options));
      return std::unique_ptr<Communicator>(
          std::make_unique<SplitPlaneCommunicator>(std::move(tensor), std::move(control)));
    }
  }
  return absl::InternalError("unreachable backend");
}

}  // namespace fulcrum::parallel
