// Data-parallel gradient reduction: gradients are summed over the data-parallel group in
// buckets (flattened runs of consecutive gradients up to a byte budget), so the number of
// collectives stays small whatever the number of parameters. The trainer scales the loss by
// the global token count, so the sum is the gradient of the global-batch mean.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/unit.h"
#include "parallel/communicator.h"

namespace fulcrum::parallel {

class GradientReducer {
 public:
  /// Which parameters a reducer sums: those replicated over the data-parallel group, or
  /// the expert-parallel ones (Parameter::expert_parallel), replicated only over the
  /// expert-data-parallel group.
  enum class Select { kAll, kDense, kExpertParallel };

  /// `dp` (the group the selected parameters are replicated over) must outlive the
  /// reducer. Default bucket: 25 MB (Megatron's default).
  explicit GradientReducer(Communicator* dp, Select select = Select::kAll,
                           int64_t bucket_bytes = 25 * 1024 * 1024)
      : dp_(dp), select_(select), bucket_bytes_(bucket_bytes) {}

  /// Sums every defined gradient of `units` over the group, in place. Gradients are
  /// bucketed per dtype in unit and parameter order, identical on every rank (the units of a
  /// data-parallel group hold the same parameters).
  /// Parameters for which `reduced` (when given) is true are left out: an overlapped
  /// reduction summed them already.
  void AllReduce(const std::vector<Unit*>& units,
                 const std::function<bool(const Parameter&)>& reduced = nullptr);

 private:
  Communicator* dp_;
  Select select_;
  int64_t bucket_bytes_;
};

}  // namespace fulcrum::parallel
