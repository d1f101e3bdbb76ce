#include "pipeline/internal/stage_moves.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "pipeline/stage_executor.h"

namespace fulcrum::pipeline::internal {

double StageMoves::SinceRunStart() const {
  return std::chrono::duration<double, std::milli>(Clock::now() - run_start_).count();
}

absl::Status StageMoves::Begin(const std::vector<PlannedMove>& moves, Clock::time_point run_start) {
  if (active_) {
    return absl::FailedPreconditionError("StageExecutor::Run: FinishMoves was not called after the last run");
  }
  run_start_ = run_start;
  departed_.clear();  // a run that failed before Finish
  outgoing_.clear();
  incoming_.clear();
  const int stage = pp_->rank();
  // Only the first incoming layer from each source posts its receive now: communicators that
  // match messages between a pair in posting order (NCCL ignores tags) then still pair each
  // message with its receive, since the sender posts its layers in layer order too.
  std::set<int> sources;
  for (const PlannedMove& move : moves) {
    // Under chunks the stages of a move are virtual; the ranks holding them send and
    // receive, and a move between two chunks of one rank sends nothing (NOTE [early
    // migration]). With one chunk a rank is its stage.
    if (move.local()) continue;
    if (move.from_rank == stage) outgoing_.push_back(move);
    if (move.to_rank != stage) continue;
    const bool first_from_source = sources.insert(move.from_rank).second;
    incoming_.push_back(PendingReceive{
        move, first_from_source ? std::optional<UnitReceive>(StartReceiveUnit(
                                      *pp_, move.from_rank, UnitTag(move.layer)))
                                : std::nullopt});
  }
  active_ = !moves.empty();
  return absl::OkStatus();
}

absl::Status StageMoves::Send(GptModel& model, const PlannedMove& move, RunMeter* meter,
                              StageRunResult& result) {
  RunMeter::Pause pause(meter);
  MigrationTiming timing;
  timing.layer = move.layer;
  timing.from_stage = move.from_stage;
  timing.to_stage = move.to_stage;
  timing.sent = true;
  timing.early = true;
  timing.start_ms = SinceRunStart();
  {
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<TransformerLayer> layer, model.TakeLayer(move.layer));
    FULCRUM_ASSIGN_OR_RETURN(UnitSend send,
                             StartSendUnit(*pp_, move.to_rank, *layer, UnitTag(move.layer)));
    timing.bytes = send.bytes();
    sends_.push_back({std::move(send), result.migrations.size()});
    departed_.push_back(std::move(layer));  // its state travels as copies; freed at Finish
  }
  timing.end_ms = SinceRunStart();
  result.migrations.push_back(timing);
  return absl::OkStatus();
}

absl::Status StageMoves::Finish(GptModel& model, std::pair<int64_t, int64_t> range,
                                StageRunResult& result) {
  if (!active_) return absl::OkStatus();
  FULCRUM_RETURN_IF_ERROR(FinishTransfers(model, result));
  if (range.first <= range.second) {
    FULCRUM_RETURN_IF_ERROR(model.CheckRange(range.first, range.second));
  }
  return absl::OkStatus();
}

absl::Status StageMoves::Finish(GptModel& model,
                                std::vector<std::pair<int64_t, int64_t>> chunk_ranges,
                                StageRunResult& result) {
  if (active_) FULCRUM_RETURN_IF_ERROR(FinishTransfers(model, result));
  FULCRUM_RETURN_IF_ERROR(model.set_chunk_ranges(std::move(chunk_ranges)));
  return model.CheckChunkRanges();
}

absl::Status StageMoves::FinishTransfers(GptModel& model, StageRunResult& result) {
  active_ = false;
  departed_.clear();  // after the run: nothing of it references them any more
  std::vector<PendingReceive> incoming = std::exchange(incoming_, {});
  for (PendingReceive& pending : incoming) {
    const PlannedMove& move = pending.move;
    MigrationTiming timing;
    timing.layer = move.layer;
    timing.from_stage = move.from_stage;
    timing.to_stage = move.to_stage;
    timing.start_ms = SinceRunStart();
    if (!pending.receive.has_value()) {
      pending.receive.emplace(StartReceiveUnit(*pp_, move.from_rank, UnitTag(move.layer)));
    }
    std::unique_ptr<TransformerLayer> shell = model.NewLayerShell(move.layer);
    FULCRUM_RETURN_IF_ERROR(pending.receive->Finish(*shell));
    timing.bytes = pending.receive->bytes();
    FULCRUM_RETURN_IF_ERROR(model.InsertLayer(std::move(shell)));
    timing.end_ms = timing.done_ms = SinceRunStart();
    result.migrations.push_back(timing);
  }
  std::vector<PendingSend> sends = std::exchange(sends_, {});
  for (PendingSend& pending : sends) {
    pending.send.Wait();
    if (pending.timing < result.migrations.size()) {
      result.migrations[pending.timing].done_ms = SinceRunStart();
    }
  }
  outgoing_.clear();
  return absl::OkStatus();
}

}  // namespace fulcrum::pipeline::internal
