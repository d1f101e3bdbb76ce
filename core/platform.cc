#include "core/platform.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/headeronly/version.h>

#include "absl/strings/str_cat.h"

namespace fulcrum {

Platform CurrentPlatform() {
  Platform p;
  p.libtorch_version = absl::StrCat(TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".",
                                    TORCH_VERSION_PATCH);
  const at::CUDAHooksInterface& cuda = at::detail::getCUDAHooks();
  p.cuda_build = cuda.isBuilt();
  if (p.cuda_build) {
    const long runtime = cuda.versionCUDART();  // 13000 for 13.0
    p.cuda_version = absl::StrCat(runtime / 1000, ".", (runtime % 1000) / 10);
    p.visible_gpus = at::hasCUDA() ? cuda.getNumGPUs() : 0;
  }
  return p;
}

std::string DescribePlatform(const Platform& p) {
  std::string out = absl::StrCat("LibTorch ", p.libtorch_version, " (",
                                 p.cuda_build ? absl::StrCat("CUDA ", p.cuda_version, " build")
                                              : std::string("CPU build"),
                                 "); device: cpu");
  // The model computes on the CPU until the device seam lands (the GPU issue); say so
  // rather than let a visible GPU suggest otherwise.
  if (p.visible_gpus == 0) {
    absl::StrAppend(&out, " (no GPU visible)");
  } else {
    absl::StrAppend(&out, " (", p.visible_gpus, " GPU", p.visible_gpus == 1 ? "" : "s",
                    " visible; the model does not use them yet)");
  }
  return out;
}

}  // namespace fulcrum
