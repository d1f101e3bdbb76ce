// Checking macros for CUDA runtime and NCCL calls: a failure throws parallel::CommError
// whose message names the call, the error, the rank, and the file and line. Include from
// .cc files that are compiled only when NCCL is found (FULCRUM_HAVE_NCCL): it includes
// <cuda_runtime_api.h> and <nccl.h>.
//
//   FULCRUM_CUDA_CHECK(cudaSetDevice(device), rank, "nccl init");
//   FULCRUM_NCCL_CHECK(ncclGetUniqueId(&id), rank, "nccl init");
//
// ncclInProgress (a non-blocking communicator still working) is not a failure here: the
// caller polls ncclCommGetAsyncError until the call has settled.
//
// Thread-safety: the macros and functions are thread-safe.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace fulcrum::parallel::internal {

/// Throws CommError("<context>: <expr> failed: <cuda error> (rank <rank>, <file>:<line>)").
[[noreturn]] void ThrowCudaError(cudaError_t error, const char* expr, const char* file, int line,
                                 int rank, const std::string& context);

/// As ThrowCudaError for an NCCL result; adds ncclGetLastError's detail.
[[noreturn]] void ThrowNcclError(ncclResult_t result, const char* expr, const char* file, int line,
                                 int rank, const std::string& context);

}  // namespace fulcrum::parallel::internal

/// Throws CommError unless `expr` returns cudaSuccess. `context` names what was being done
/// ("all_reduce on 'tp' (ranks 0,1)").
#define FULCRUM_CUDA_CHECK(expr, rank, context)                                           \
  do {                                                                                    \
    const cudaError_t fulcrum_cuda_error_ = (expr);                                       \
    if (fulcrum_cuda_error_ != cudaSuccess) {                                             \
      ::fulcrum::parallel::internal::ThrowCudaError(fulcrum_cuda_error_, #expr, __FILE__, \
                                                    __LINE__, (rank), (context));         \
    }                                                                                     \
  } while (0)

/// Throws CommError unless `expr` returns ncclSuccess or ncclInProgress.
#define FULCRUM_NCCL_CHECK(expr, rank, context)                                            \
  do {                                                                                     \
    const ncclResult_t fulcrum_nccl_result_ = (expr);                                      \
    if (fulcrum_nccl_result_ != ncclSuccess && fulcrum_nccl_result_ != ncclInProgress) {   \
      ::fulcrum::parallel::internal::ThrowNcclError(fulcrum_nccl_result_, #expr, __FILE__, \
                                                    __LINE__, (rank), (context));          \
    }                                                                                      \
  } while (0)
