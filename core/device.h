// Where a model's tensors live and in which precision they compute: the device seam of
// DESIGN.md ("Device-agnostic code").
//
// NOTE [device seam]
// One DeviceSpec value, in ModelOptions, decides for the whole model:
//   device         every parameter, gradient, optimizer moment, activation, pipeline buffer
//                  and plugin tensor of the rank is created on it (cpu, or cuda:<LOCAL_RANK>);
//   master_dtype   parameters, their gradients (accumulated over micro-batches), the
//                  optimizer state, checkpoints, data-parallel and tensor-parallel gradient
//                  reductions and the gradient norm (fp32; fp64 for numerical checks);
//   compute_dtype  activations and the operands of every GEMM (fp32, fp64, or bf16 for
//                  Megatron-style mixed precision: --bf16).
// Model code never names a device or a dtype literally: it asks the spec (or the tensor it
// was given). GPU-specific code lives behind core/kernels/ and the communicator.
// Where it stands: the dense model (embedding, layers, head, loss), the optimizer and the
// pipeline's receive buffers follow the spec; batches move to the device at the model's
// entry; checkpoints and layer migrations go through the CPU as before. --bf16 covers the
// dense model (NOTE [mixed precision] in core/linear.h) and MoE (NOTE [MoE mixed precision]
// in moe/moe_layer.cc: the router in fp32); it is refused with the other plugins, whose
// tensors are not yet written against the spec (recipes/train_main.cc names them).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum {

struct DeviceSpec {
  c10::Device device = c10::Device(c10::kCPU);  // Default: cpu.
  at::ScalarType master_dtype = at::kFloat;     // Default: fp32.
  at::ScalarType compute_dtype = at::kFloat;    // Default: fp32 (bf16 with --bf16).

  /// Whether compute and master precisions differ (bf16 compute over fp32 masters).
  bool mixed_precision() const { return compute_dtype != master_dtype; }
  bool is_cuda() const { return device.is_cuda(); }
  /// "cpu fp32", "cuda:0 bf16/fp32" (compute/master when they differ): for logs and manifests.
  std::string ToString() const;
  /// fp32/fp64 masters; compute equal to master, or bf16 over fp32 masters; bf16 only where
  /// the device has bf16 GEMMs (every CPU and every CUDA GPU LibTorch 2.11 supports).
  absl::Status Validate() const;
};

/// Resolves --device: "cpu"; "cuda" (the GPU of `local_rank`, which must be visible);
/// "cuda:N"; "auto" (cuda:<local_rank> when this process sees a GPU, else cpu).
/// InvalidArgument naming --device for anything else, or for cuda without a visible GPU
/// (with the number of GPUs seen).
absl::StatusOr<c10::Device> ResolveDevice(const std::string& text, int local_rank);

/// The number of CUDA devices this process sees (0 in a CPU-only run or build).
int VisibleCudaDevices();

/// "fp32", "fp64", "bf16" (also float32, float64, bfloat16) ↔ dtype; InvalidArgument naming
/// `flag` otherwise.
absl::StatusOr<at::ScalarType> ParseDtypeName(const std::string& text, const std::string& flag);
const char* DtypeName(at::ScalarType dtype);

}  // namespace fulcrum
