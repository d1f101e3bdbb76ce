// The point-to-point traffic of one stage's run (pipeline/stage_executor.h): activations
// from the previous stage and gradients from the next, received through queues posted
// ahead (NOTE [pre-posted receives] in stage_executor.h), and non-blocking sends to both
// neighbours, waited for at the end of the run.
//
// Not thread-safe; one per run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <deque>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "pipeline/schedule.h"

namespace fulcrum::pipeline::internal {

// Message tags between neighbouring stages: the activation and the gradient of each
// micro-batch travel under their own tags, so out-of-order arrivals never mix.
inline int ActivationTag(int microbatch) { return 2 * microbatch; }
inline int GradientTag(int microbatch) { return 2 * microbatch + 1; }

/// The receives of one direction, posted up to `depth` ahead in the order the action list
/// consumes them.
class ReceiveQueue {
 public:
  ReceiveQueue(parallel::Communicator* pp, int peer, std::vector<int> tags,
               std::vector<int64_t> shape, at::TensorOptions options, size_t depth);

  /// Waits for the message under `tag`, which must be the next one of the list, and posts
  /// the next receive. Adds the time blocked to *wait_ms.
  absl::StatusOr<at::Tensor> Take(int tag, double* wait_ms);

 private:
  struct Posted {
    int tag;
    at::Tensor buffer;
    std::unique_ptr<parallel::CommWork> work;
  };
  void Refill();

  parallel::Communicator* pp_;
  int peer_;
  std::vector<int> tags_;
  std::vector<int64_t> shape_;
  at::TensorOptions options_;  // dtype and device of the receive buffers
  size_t depth_;
  size_t next_ = 0;
  std::deque<Posted> posted_;
};

/// Both directions of one stage's run over `actions` (its list for the run).
class StageTransport {
 public:
  /// Posts the first receives. `shape` and `options` (the compute dtype and the device of
  /// the model's DeviceSpec) are those of an activation's gradient;
  /// the activation message has `carried_channels` more in its last dimension (the carried
  /// token state, NOTE [carried token state] in core/transformer_layer.h). Without
  /// `receive_gradients` the next stage sends none (NOTE [frozen prefix] in
  /// core/gpt_model.h: this stage's output needs no gradient).
  StageTransport(parallel::Communicator* pp, const std::vector<Action>& actions,
                 std::vector<int64_t> shape, at::TensorOptions options, size_t depth,
                 bool receive_gradients = true, int64_t carried_channels = 0);

  /// The activation of micro-batch `mb` from the previous stage; time blocked added to
  /// *wait_ms.
  absl::StatusOr<at::Tensor> TakeActivation(int mb, double* wait_ms);
  /// The output gradient of micro-batch `mb` from the next stage.
  absl::StatusOr<at::Tensor> TakeGradient(int mb, double* wait_ms);
  /// Posts `t` to the next stage as micro-batch `mb`'s activation (a copy is kept until
  /// it is sent).
  void SendActivation(const at::Tensor& t, int mb);
  /// Posts `t` to the previous stage as micro-batch `mb`'s input gradient.
  void SendGradient(const at::Tensor& t, int mb);
  /// Waits for every send posted; returns the milliseconds blocked.
  double WaitForSends();

 private:
  void Send(const at::Tensor& t, int peer, int tag);

  parallel::Communicator* pp_;
  int stage_;
  ReceiveQueue activations_;
  ReceiveQueue gradients_;
  std::vector<std::unique_ptr<parallel::CommWork>> sends_;
  std::vector<at::Tensor> send_buffers_;  // Alive until their sends complete.
};

}  // namespace fulcrum::pipeline::internal
