// The NCCL backend of Communicator, for CUDA tensors, written against <nccl.h> directly so
// it builds wherever the CUDA toolkit and NCCL are installed, with or without a CUDA
// LibTorch. Built only when CMake finds both (FULCRUM_HAVE_NCCL); elsewhere
// CreateNcclCommunicator returns Unimplemented (HaveNccl() in world_communicator.h tells).
//
// Behaviour worth knowing (see communicator.h for the common contract):
//  - Operations are enqueued on the communicator's own stream, after the work already
//    queued on the compute stream — the one the provider returns (a CUDA LibTorch build
//    passes the current torch stream; default: the legacy default stream) — so
//    point-to-point traffic overlaps later compute (NOTE [nccl stream]); then the host
//    polls for completion, bounded by timeout(). On timeout or an asynchronous NCCL error
//    the communicator is aborted (ncclCommAbort) and CommError is thrown; later calls fail
//    at once.
//  - The communicator is non-blocking (ncclConfig_t::blocking = 0), so creation and Split
//    are bounded by the timeout too, even when a peer never shows up.
//  - ISend/IRecv are queued and launched together, in one ncclGroupStart/End, at the first
//    Wait() or collective after them, so an exchange in which every rank sends before it
//    receives cannot deadlock. NCCL has no tags: messages between two ranks match in the
//    order they were issued, and `tag` only labels errors. The communicator must outlive
//    the handles.
//  - Split creates a new NCCL communicator among the members only (a fresh unique id
//    exchanged through the store), so non-members need not take part.
//
// Thread-safety: as Communicator (one thread at a time). The device is set around each
// call and restored afterwards.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed here.

namespace c10d {
class Store;
}  // namespace c10d

namespace fulcrum::parallel {

/// Returns the CUDA stream (cudaStream_t) to enqueue the next operation on.
using NcclStreamProvider = std::function<CUstream_st*()>;

/// The world communicator ("world") over NCCL: `size` processes, this one being `rank` and
/// using GPU `device`, meeting through `store` (see ConnectStore). Every rank calls it with
/// the same `size` and `timeout`; `timeout` bounds creation and every later operation.
/// `stream_provider` null means the legacy default stream.
///
/// Errors: InvalidArgument for bad arguments; FailedPrecondition when `device` is not a
/// visible GPU; DeadlineExceeded when the peers did not all join within `timeout`;
/// Unavailable for CUDA/NCCL failures; Unimplemented in a build without NCCL.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
    std::chrono::milliseconds timeout, NcclStreamProvider stream_provider = nullptr);

/// Number of CUDA devices this process can use: 0 without NCCL in the build, without a
/// driver, or without a GPU.
int NcclVisibleDevices();

}  // namespace fulcrum::parallel
