// The point-to-point traffic of one stage's run (pipeline/stage_executor.h): activations
// from the previous stage and gradients from the next, received through queues posted
// ahead (NOTE [pre-posted receives] in stage_executor.h), and non-blocking sends to both
// neighbours, waited for at the end of the run.
//
// NOTE [chunk transport]
// With v model chunks per stage (virtual pipeline stages, NOTE [pipeline dependencies] in
// pipeline/schedule.h) each chunk has its own neighbours: the ranks holding the virtual
// stages before and after it in model order. Each (direction, chunk) gets its own receive
// queue, posted ahead in the order the list consumes that queue, and its own tags, so that
// two chunks exchanging with the same rank (interleaved 1F1B at p = 2: both of rank 1's
// chunks receive from rank 0) never take each other's messages. A tag names the receiving
// chunk: 2·(mb·v + chunk) for activations, one more for gradients — 2·mb and 2·mb + 1 with
// one chunk, the tags of before. When the neighbouring virtual stage is on this rank (ZB-V's
// turn at the bottom of the V) nothing is sent: the tensor is handed over in memory, as the
// receive would have delivered it (a separate leaf; the graphs of the two chunks stay apart
// as between ranks, so the arithmetic is the same).
//
// Not thread-safe; one per run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "pipeline/schedule.h"

namespace fulcrum::pipeline::internal {

// Message tags between neighbouring stages: the activation and the gradient of each
// micro-batch travel under their own tags, so out-of-order arrivals never mix; with chunks
// each receiving chunk has its own (NOTE [chunk transport]).
inline int ActivationTag(int microbatch, int chunk = 0, int num_chunks = 1) {
  return 2 * (microbatch * num_chunks + chunk);
}
inline int GradientTag(int microbatch, int chunk = 0, int num_chunks = 1) {
  return 2 * (microbatch * num_chunks + chunk) + 1;
}

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
  /// Posts the first receives. `virtual_stages` is the schedule's model order
  /// (VirtualStages(schedule)); this stage's chunks are its entries with stage = the pp
  /// rank. `shape` and `options` (the compute dtype and the device of the model's
  /// DeviceSpec) are those of an activation's gradient; the activation message has
  /// `carried_channels` more in its last dimension (the carried token state, NOTE [carried
  /// token state] in core/transformer_layer.h). Chunk c receives gradients only when
  /// `receive_gradients[c]` (NOTE [frozen prefix] in core/gpt_model.h: else its output
  /// needs none and the next virtual stage sends none).
  StageTransport(parallel::Communicator* pp, const std::vector<ChunkId>& virtual_stages,
                 const std::vector<Action>& actions, std::vector<int64_t> shape,
                 at::TensorOptions options, size_t depth, std::vector<bool> receive_gradients,
                 int64_t carried_channels = 0);

  /// The activation of micro-batch `mb` for chunk `chunk` from the virtual stage before it;
  /// time blocked added to *wait_ms.
  absl::StatusOr<at::Tensor> TakeActivation(int mb, int chunk, double* wait_ms);
  /// The output gradient of micro-batch `mb` of chunk `chunk` from the virtual stage after.
  absl::StatusOr<at::Tensor> TakeGradient(int mb, int chunk, double* wait_ms);
  /// Posts `t`, chunk `chunk`'s output for micro-batch `mb`, to the virtual stage after it
  /// (a copy is kept until it is sent; handed over in memory on this rank).
  void SendActivation(const at::Tensor& t, int mb, int chunk);
  /// Posts `t`, chunk `chunk`'s input gradient for `mb`, to the virtual stage before it.
  void SendGradient(const at::Tensor& t, int mb, int chunk);
  /// Waits for every send posted; returns the milliseconds blocked.
  double WaitForSends();
  /// Whether chunk `chunk`'s input is handed over from this stage (NOTE [chunk transport]).
  bool HandsOverInput(int chunk) const { return neighbours_[chunk].prev_rank == stage_; }

 private:
  // One chunk's neighbours in model order: the rank and chunk of the virtual stage before
  // (rank -1 for virtual 0) and after (-1 for the last).
  struct Neighbours {
    int prev_rank = -1;
    int prev_chunk = 0;
    int next_rank = -1;
    int next_chunk = 0;
  };
  void Send(const at::Tensor& t, int peer, int tag);
  // Takes the hand-over of `mb` from `local` (NOTE [chunk transport]).
  absl::StatusOr<at::Tensor> TakeLocal(std::map<int, at::Tensor>& local, int mb, int chunk,
                                       const char* what);

  parallel::Communicator* pp_;
  int stage_;
  int num_chunks_;
  std::vector<Neighbours> neighbours_;  // Per chunk.
  std::vector<std::unique_ptr<ReceiveQueue>> activations_;  // Per chunk.
  std::vector<std::unique_ptr<ReceiveQueue>> gradients_;    // Per chunk.
  // Hand-overs between chunks of this stage, per receiving chunk, by micro-batch.
  std::vector<std::map<int, at::Tensor>> local_activations_;
  std::vector<std::map<int, at::Tensor>> local_gradients_;
  std::vector<std::unique_ptr<parallel::CommWork>> sends_;
  std::vector<at::Tensor> send_buffers_;  // Alive until their sends complete.
};

}  // namespace fulcrum::pipeline::internal
