// What this process runs on: the LibTorch it was built against, whether that LibTorch is a
// CUDA build, and the GPUs it sees. For the first log lines of the programs and for tests
// that need a GPU (they skip, naming why, when none is visible).
#pragma once

#include <string>

namespace fulcrum {

struct Platform {
  std::string libtorch_version;  ///< "2.11.0", from the headers built against.
  bool cuda_build = false;       ///< LibTorch's CUDA half is loaded (libtorch_cuda).
  std::string cuda_version;      ///< The CUDA runtime LibTorch was built with ("13.0"), or "".
  int visible_gpus = 0;          ///< CUDA devices this process can use.
};

/// Reads the platform (cheap: no device is initialised when none is visible).
Platform CurrentPlatform();

/// "LibTorch 2.11.0 (CUDA 13.0 build); device: cpu (no GPU visible)".
std::string DescribePlatform(const Platform& platform);

}  // namespace fulcrum
