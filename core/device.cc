#include "core/device.h"

#include <torch/cuda.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace fulcrum {

std::string DeviceSpec::ToString() const {
  std::string out = absl::StrCat(device.str(), " ", DtypeName(compute_dtype));
  if (mixed_precision()) absl::StrAppend(&out, "/", DtypeName(master_dtype));
  return out;
}

absl::Status DeviceSpec::Validate() const {
  if (master_dtype != at::kFloat && master_dtype != at::kDouble) {
    return absl::InvalidArgumentError(absl::StrCat("master dtype ", DtypeName(master_dtype),
                                                   " is not supported; expected fp32 or fp64"));
  }
  if (compute_dtype != master_dtype &&
      !(compute_dtype == at::kBFloat16 && master_dtype == at::kFloat)) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute dtype ", DtypeName(compute_dtype), " over master dtype ",
                     DtypeName(master_dtype),
                     " is not supported; bf16 mixed precision keeps fp32 masters (--bf16 "
                     "with --params_dtype=fp32)"));
  }
  if (master_dtype == at::kDouble && device.is_cuda()) {
    return absl::InvalidArgumentError("--params_dtype=fp64 is for numerical checks on the CPU; "
                                      "use fp32 or --bf16 with --device=cuda");
  }
  return absl::OkStatus();
}

int VisibleCudaDevices() { return static_cast<int>(torch::cuda::device_count()); }

absl::StatusOr<c10::Device> ResolveDevice(const std::string& text, int local_rank) {
  const int gpus = VisibleCudaDevices();
  if (text == "cpu") return c10::Device(c10::kCPU);
  if (text == "auto") {
    if (gpus == 0) return c10::Device(c10::kCPU);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
  }
  int index = local_rank;
  if (text != "cuda") {
    absl::string_view rest = text;
    if (!absl::ConsumePrefix(&rest, "cuda:") || !absl::SimpleAtoi(rest, &index) || index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device='", text, "' is unknown; expected cpu, cuda, cuda:N or auto"));
    }
  }
  if (index >= gpus) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device=", text, " needs GPU ", index, " (LOCAL_RANK ", local_rank, ") but this process sees ",
        gpus, gpus == 1 ? " GPU" : " GPUs", gpus == 0 ? " (use --device=cpu or auto)" : ""));
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

absl::StatusOr<at::ScalarType> ParseDtypeName(const std::string& text, const std::string& flag) {
  if (text == "fp32" || text == "float32") return at::kFloat;
  if (text == "fp64" || text == "float64") return at::kDouble;
  if (text == "bf16" || text == "bfloat16") return at::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "='", text, "' is unknown; expected fp32, fp64 or bf16"));
}

const char* DtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "fp32";
    case at::kDouble: return "fp64";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    default: return c10::toString(dtype);
  }
}

}  // namespace fulcrum
