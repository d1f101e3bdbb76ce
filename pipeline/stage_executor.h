// Runs one pipeline stage's action list for an iteration: F(mb) receives the activation
// from the previous stage (or embeds the tokens), runs this stage's layers and sends the
// output on (or computes the loss); B(mb) receives the output gradient (or starts from the
// loss), back-propagates with weight gradients deferred (NOTE [B/W split] in
// core/linear.h) and sends the input gradient back; W(mb) runs the deferred weight
// gradients; a fused BW(mb) (1F1B) does B and W at once. Sends are non-blocking; receives
// block (bounded by the communicator's timeout). Every action and every wait is timed.
//
// Not thread-safe; one executor per stage process.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/gpt_model.h"
#include "core/linear.h"
#include "core/parallel_context.h"
#include "parallel/communicator.h"
#include "pipeline/schedule.h"

namespace fulcrum::pipeline {

/// One executed action: what, and when (milliseconds from the start of the iteration).
struct ActionTiming {
  Action action;
  double start_ms = 0;
  double end_ms = 0;
  double wait_ms = 0;  // Part of [start, end) spent waiting for a receive.
};

struct StageRunResult {
  std::chrono::steady_clock::time_point start;  // When the run began (timings are relative).
  double loss_sum = 0;  // Σ token losses (the stage holding the head), else 0.
  int64_t tokens = 0;
  std::vector<ActionTiming> timings;
  std::map<int64_t, double> layer_forward_ms;  // Per global layer, summed over micro-batches.
  double total_ms = 0;
  double wait_ms = 0;  // Time blocked in receives and in the final wait for sends.
};

class StageExecutor {
 public:
  /// `model` is this stage's part; `pp` the pipeline communicator (rank = stage index).
  /// Activations are [seq_length, micro_batch_size, hidden] between stages.
  StageExecutor(parallel::Communicator* pp, int64_t micro_batch_size);

  /// Runs `schedule` (its row for this stage) for `iteration`. Each micro-batch's summed
  /// token loss is multiplied by `loss_scale` before the backward. With `forward_only`,
  /// only the F actions run, without autograd (evaluation).
  absl::StatusOr<StageRunResult> Run(GptModel& model, const Schedule& schedule,
                                     int64_t iteration, const MicroBatchPlan& plan,
                                     double loss_scale, bool forward_only = false);

 private:
  struct InFlight;

  parallel::Communicator* pp_;
  int64_t micro_batch_size_;
};

}  // namespace fulcrum::pipeline
