// Precompiled header: the heavy, stable headers shared by every translation unit.
// Project headers never include torch/torch.h; .cc files get ATen and autograd from here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// LibTorch's tensor library and autograd, not the whole C++ frontend: torch/torch.h adds
// torch::nn, torch::optim, torch::data, torch::jit and serialization, which Fulcrum does not
// use, and loading its precompiled header cost every translation unit 5-6 s instead of 2.5-3
// (2 cores, g++ 12). A file that needs the frontend includes <torch/torch.h> itself.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
