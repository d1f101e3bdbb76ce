// The trainer's forward/backward over a pipeline: builds the schedule for (stages,
// micro-batches), runs this stage's part with a StageExecutor, and measures the bubble —
// the time a stage spends waiting on its neighbours — per iteration, as mean and max over
// the stages.
//
// Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/parallel_context.h"
#include "parallel/communicator.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "pipeline/stage_executor.h"
#include "pipeline/timeline.h"

namespace fulcrum::pipeline {

class PipelineRunner final : public ForwardBackwardRunner {
 public:
  /// `pp` (the pipeline communicator) must outlive the runner. `schedule_name` is a
  /// registered schedule ("1f1b", "zbh1", "zbh2"). `rebalancer` (null: never move) is
  /// asked once per iteration for layer moves, carried out before the optimizer step.
  PipelineRunner(parallel::Communicator* pp, std::string schedule_name, int64_t micro_batch_size,
                 std::unique_ptr<Rebalancer> rebalancer = nullptr);

  /// Records every iteration's actions, waits and migrations into `timeline` (flushed by
  /// Finish and every `flush_every` iterations); it must outlive the runner.
  void SetTimeline(TimelineRecorder* timeline, int64_t flush_every = 50) {
    timeline_ = timeline;
    flush_every_ = flush_every;
  }
  absl::Status Finish() override;

  absl::StatusOr<std::pair<double, int64_t>> Run(GptModel& stage, int64_t iteration,
                                                 const MicroBatchPlan& plan,
                                                 double loss_scale) override;
  absl::StatusOr<std::pair<double, int64_t>> Evaluate(GptModel& stage,
                                                      const MicroBatchPlan& plan) override;
  std::vector<std::pair<std::string, double>> Metrics() const override { return metrics_; }

  /// The last Run's per-action timings on this stage.
  const StageRunResult& last_run() const { return last_run_; }

 private:
  absl::StatusOr<const Schedule*> ScheduleFor(const std::string& name, int microbatches);
  /// Sums the head stage's loss over the pipeline so every stage returns the same value.
  std::pair<double, int64_t> ShareLoss(const StageRunResult& run);
  /// Every stage's load of the last run, gathered over the pipeline.
  std::vector<StageLoad> GatherLoads(const GptModel& stage, const Schedule& schedule);
  /// Asks the rebalancer and carries out its moves (NOTE [layer migration]).
  absl::Status Rebalance(GptModel& stage, const Schedule& schedule, int64_t iteration);

  parallel::Communicator* pp_;
  std::string schedule_name_;
  StageExecutor executor_;
  std::unique_ptr<Rebalancer> rebalancer_;
  TimelineRecorder* timeline_ = nullptr;
  int64_t flush_every_ = 50;
  int64_t layers_moved_ = 0;
  std::map<std::pair<std::string, int>, Schedule> schedules_;
  StageRunResult last_run_;
  std::vector<std::pair<std::string, double>> metrics_;
};

}  // namespace fulcrum::pipeline
