// One stage's part in an iteration's layer moves (NOTE [early migration] in
// pipeline/stage_executor.h): which layers it sends and receives, the receives posted when
// the run starts, the sends posted from inside its last backward action (each layer right
// after its own last weight gradients), and the receives finished — and the layers
// inserted — before the optimizer step.
//
// Not thread-safe; one per executor, reused run after run.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/gpt_model.h"
#include "parallel/communicator.h"
#include "pipeline/internal/activation_meter.h"
#include "pipeline/migration.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::pipeline {
struct MigrationTiming;
struct StageRunResult;
}  // namespace fulcrum::pipeline

namespace fulcrum::pipeline::internal {

class StageMoves {
 public:
  using Clock = std::chrono::steady_clock;

  explicit StageMoves(parallel::Communicator* pp) : pp_(pp) {}

  /// Takes this stage's part of `moves` (every stage passes the same list; a stage is a
  /// rank: from_rank/to_rank, local moves send nothing): posts the receive of each incoming
  /// layer's first message. `run_start` is the origin of the
  /// timings. FailedPrecondition if the last run's moves were not finished.
  absl::Status Begin(const std::vector<PlannedMove>& moves, Clock::time_point run_start);
  /// Whether this stage sends layers in this run.
  bool sends() const { return !outgoing_.empty(); }
  /// The layers this stage sends, in layer order.
  const std::vector<PlannedMove>& outgoing() const { return outgoing_; }
  /// Takes `move.layer` out of `model` and posts its state to its new stage; the meter
  /// does not count the packing. Records the timing in `result`.
  absl::Status Send(GptModel& model, const PlannedMove& move, RunMeter* meter,
                    StageRunResult& result);
  /// Receives and inserts every incoming layer, waits for every send, and checks that
  /// `model` holds `range` (this stage's range in the plan; unchecked when begin > end).
  /// Appends the receives' timings and completes the sends'. No-op without moves.
  absl::Status Finish(GptModel& model, std::pair<int64_t, int64_t> range, StageRunResult& result);
  /// The same under chunks (NOTE [early migration]): after the transfers sets the model's
  /// chunk ranges to `chunk_ranges` (the plan's for this rank, chunk order; local moves
  /// change only these) and checks that it holds exactly their layers. Always sets them,
  /// moves or not.
  absl::Status Finish(GptModel& model, std::vector<std::pair<int64_t, int64_t>> chunk_ranges,
                      StageRunResult& result);

 private:
  // Receives and inserts the incoming layers and waits for the sends (Finish's common part).
  absl::Status FinishTransfers(GptModel& model, StageRunResult& result);

  double SinceRunStart() const;

  struct PendingSend {
    UnitSend send;
    size_t timing;  // Index into the run's StageRunResult::migrations.
  };
  struct PendingReceive {
    PlannedMove move;
    std::optional<UnitReceive> receive;  // Posted in Begin (first from its source) or Finish.
  };

  parallel::Communicator* pp_;
  Clock::time_point run_start_;
  std::vector<PlannedMove> outgoing_;
  std::vector<PendingReceive> incoming_;
  std::vector<PendingSend> sends_;
  // The layers sent this run, kept until Finish: the run's deferred weight gradients may
  // still hold activations whose autograd graph references their parameters, and the
  // parameters must not be freed under the run's activation meter (they were allocated
  // before it: c10 warns of a free of unknown size).
  std::vector<std::unique_ptr<TransformerLayer>> departed_;
  bool active_ = false;  // Begin called, Finish not yet.
};

}  // namespace fulcrum::pipeline::internal
