#include "parallel/world_communicator.h"

#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "parallel/gloo_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/rendezvous.h"

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

absl::StatusOr<std::unique_ptr<Communicator>> CreateWorldCommunicator(
    const WorldInfo& world, Backend backend, std::chrono::milliseconds timeout) {
  if (backend == Backend::kNccl && !HaveNccl()) {
    return absl::UnimplementedError(
        "the nccl backend is not in this build (CMake found no CUDA toolkit with NCCL); use "
        "gloo or rebuild where both are installed");
  }
  FULCRUM_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store, ConnectStore(world, timeout));
  switch (backend) {
    case Backend::kGloo: {
      GlooOptions options;
      if (IsLoopback(world.master_addr)) {
        options.hostname = world.master_addr == "::1" ? "::1" : "127.0.0.1";
      }
      return CreateGlooCommunicator(std::move(store), world.rank, world.world_size, timeout,
                                    options);
    }
    case Backend::kNccl:
      return CreateNcclCommunicator(std::move(store), world.rank, world.world_size,
                                    world.local_rank, timeout);
  }
  return absl::InternalError("unreachable backend");
}

}  // namespace fulcrum::parallel
