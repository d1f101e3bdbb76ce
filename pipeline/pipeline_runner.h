// The trainer's forward/backward over a pipeline: builds the schedule for (stages,
// micro-batches), asks the rebalancer for the iteration's placement (NOTE [when the plan is
// made] in pipeline/rebalancer.h), checks that every replica plans alike, runs this stage's
// part with a StageExecutor, which carries the moves out in the backward tail, and measures
// the bubble and the imbalance per iteration, as mean and max over the stages (the
// bookkeeping is pipeline/pipeline_metrics.h's).
//
// NOTE [imbalance measurement]
// A stage's load in an iteration is the time its F, B and W actions computed (without
// waits and migrations); the imbalance is (max − min) / mean of the loads over the stages,
// DynMo's ΔL (§2, Eq. 2), measured every iteration — not predicted. Each decision is logged
// with the placement before and after and the load model's predicted bottleneck; the
// iteration after a move logs the measured bottleneck and bubble next to those before it.
//
// NOTE [bubble measurement]
// A stage's bubble is the time it is idle while the pipeline's iteration runs: blocked in
// receives inside its run, waiting for its sends at the end, and — after its last action —
// waiting for the slowest stage to finish, since the optimizer step waits for every stage
// (the loss and the tied-embedding gradients are reduced over the pipeline). The last part
// is measured as the time in the pipeline-wide reduction of the loss that follows the run;
// it includes that reduction's own latency. bubble_ratio = idle / (run + tail wait), the
// simulator's SimulationResult::BubbleRatio. bubble_ratio_in_run leaves the tail wait out
// (the measure before this note, kept for comparison): a stage that finishes early, as the
// last stages of 1F1B do, shows no bubble there although it idles until the step. Metrics:
// bubble_ratio (mean over stages), bubble_ratio_max, bubble_ratio_in_run (mean),
// stage_bubble_ratio (every stage's bubble_ratio), and this stage's pipeline_ms (run + tail
// wait) and activation_peak_mb.
//
// Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <optional>

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/parallel_context.h"
#include "parallel/communicator.h"
#include "pipeline/measured_order.h"
#include "pipeline/pipeline_metrics.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"
#include "pipeline/stage_executor.h"
#include "pipeline/timeline.h"

namespace fulcrum::pipeline {

/// NOTE [model chunks] (core/gpt_model.h) under a schedule: (stage, chunk) of each virtual
/// stage in model order (VirtualStages as plain pairs, for core and parallel/).
std::vector<std::pair<int, int>> VirtualOwners(const Schedule& schedule);
/// The even split of `num_layers` over `virtual_stages` pieces (EvenStage's rule), in model
/// order: the initial placement with chunks.
LayerRanges EvenVirtualRanges(int64_t num_layers, int virtual_stages);
/// What `stage` holds when `ranges` (one per virtual stage) run under `schedule`.
StageSpec ChunkedStage(const Schedule& schedule, const LayerRanges& ranges, int stage);

class PipelineRunner final : public ForwardBackwardRunner {
 public:
  /// `pp` (the pipeline communicator) must outlive the runner. `schedule_name` is a
  /// registered schedule ("1f1b", "zbh1", "zbh2", "zbv"). `rebalancer` (null: never move) is
  /// asked at the start of each iteration for the layer moves carried out in its backward
  /// tail, before the optimizer step. `replica_groups` are communicators over the ranks
  /// that hold this same stage in other replicas (the data-parallel group, and the
  /// tensor-parallel one): the loads are averaged over each in turn, so every replica's
  /// rebalancer gets identical inputs and all apply the same plan. They must outlive the
  /// runner; groups of size 1 are skipped.
  /// `num_chunks` is v, the model chunks per stage (virtual pipeline stages: interleaved
  /// 1F1B, ZB-V; NOTE [model chunks] in core/gpt_model.h); the placement is then one range
  /// per virtual stage, p·v in model order; the rebalancer's loads carry each rank's chunk
  /// ranges, its plan places the virtual stages, and a move between two chunks of one rank
  /// is local (NOTE [early migration] in pipeline/stage_executor.h).
  PipelineRunner(parallel::Communicator* pp, std::string schedule_name, int64_t micro_batch_size,
                 std::unique_ptr<Rebalancer> rebalancer = nullptr,
                 std::vector<parallel::Communicator*> replica_groups = {}, int num_chunks = 1);

  /// Whether each run times every layer (StageExecutor::set_layer_timing; on by default).
  /// Off, the loads' per-layer times read 0: only for runs whose rebalancer never moves.
  void set_layer_timing(bool on) { executor_.set_layer_timing(on); }
  /// Records every iteration's actions, waits and migrations into `timeline` (flushed by
  /// Finish and every `flush_every` iterations); it must outlive the runner.
  void SetTimeline(TimelineRecorder* timeline, int64_t flush_every = 50) {
    timeline_ = timeline;
    flush_every_ = flush_every;
  }
  void SetBeforeLayersMove(std::function<absl::Status()> hook) override {
    before_moves_ = std::move(hook);
  }
  absl::Status Finish() override;

  absl::StatusOr<std::pair<double, int64_t>> Run(GptModel& stage, int64_t iteration,
                                                 const MicroBatchPlan& plan,
                                                 double loss_scale) override;
  absl::StatusOr<std::pair<double, int64_t>> Evaluate(GptModel& stage,
                                                      const MicroBatchPlan& plan) override;
  /// bubble_ratio (mean over stages), bubble_ratio_max, bubble_ratio_in_run,
  /// stage_bubble_ratio (every stage's), pipeline_ms and activation_peak_mb (this stage),
  /// imbalance (NOTE [imbalance measurement]),
  /// stage_ms (every stage's load), layers_moved (so far), stage_ranges (after the
  /// iteration's moves), and the rebalancer's own figures.
  void Metrics(nlohmann::json* record, std::string* log_line) const override;
  /// The --load_trace line of the previous iteration's measurement (NOTE [load trace lines]
  /// in pipeline/load_trace.h); nothing before the second Run.
  void LoadTrace(nlohmann::json* record) const override;
  void ModelChanged(int64_t iteration, const std::string& reason) override {
    rebalancer_->OnModelChanged(iteration, reason);
    model_changes_.emplace_back(iteration, reason);
  }

  /// NOTE [ZB-V at measured costs] (pipeline/measured_order.h): under zbv, whether the order
  /// is rebuilt from the measured chunk costs (the default, --zbv_order=measured) or stays
  /// the unit-cost one (--zbv_order=unit). Set before the first Run.
  void set_measured_zbv_order(bool measured) { measured_zbv_order_ = measured; }
  /// The costs the current zbv order was built for; nullopt: the unit order.
  const std::optional<ActionCosts>& zbv_order_costs() const { return zbv_order_.costs(); }

  /// The last Run's per-action timings on this stage (with its migrations).
  const StageRunResult& last_run() const { return last_run_; }
  /// What the rebalancer was given at the start of the last Run (one StageLoad per stage).
  const std::vector<StageLoad>& last_loads() const { return last_loads_; }
  /// The moves the last Run carried out.
  const std::vector<PlannedMove>& last_moves() const { return last_moves_; }
  /// Every stage's range after the last Run (with chunks, every virtual stage's, in model
  /// order).
  const LayerRanges& ranges() const { return ranges_; }

 private:
  /// The schedule `name` for `microbatches`, its first `forward_only` virtual stages
  /// forward only (NOTE [forward-only stages] in schedule.h); made and validated once.
  absl::StatusOr<const Schedule*> ScheduleFor(const std::string& name, int microbatches,
                                              int forward_only = 0);
  /// Sums the head stage's loss over the pipeline so every stage returns the same value.
  std::pair<double, int64_t> ShareLoss(const StageRunResult& run);
  /// Every stage's load of the last run on the current layout, gathered over the pipeline
  /// and averaged over the replica groups (collective).
  std::vector<StageLoad> GatherLoads(const GptModel& stage, const Schedule& schedule);
  /// Asks the rebalancer for `iteration`'s placement, checks it (a valid placement, the
  /// same on every replica: PlanHash compared over the pipeline and the replica groups)
  /// and returns the moves that reach it; every rank refuses a bad plan alike (collective).
  absl::StatusOr<std::vector<PlannedMove>> PlanMoves(const GptModel& stage,
                                                     const Schedule& schedule, int64_t iteration);
  /// InvalidArgument naming the ranks when the plan hashes differ over `group`.
  absl::Status CheckSamePlan(parallel::Communicator* group, uint64_t hash, const char* what,
                             int64_t iteration);
  /// Logs the last run's decision and moves and puts them on the timeline.
  void RecordMoves(int64_t iteration);

  // The ranges of every virtual stage, in model order (collective over the pipeline): what
  // the placement is with chunks.
  LayerRanges GatherVirtualRanges(const GptModel& stage, const Schedule& schedule);

  parallel::Communicator* pp_;
  std::string schedule_name_;
  int num_chunks_ = 1;
  StageExecutor executor_;
  std::unique_ptr<Rebalancer> rebalancer_;
  std::vector<parallel::Communicator*> replica_groups_;
  TimelineRecorder* timeline_ = nullptr;
  int64_t flush_every_ = 50;
  std::map<std::tuple<std::string, int, int>, Schedule> schedules_;  // (name, m, forward_only)
  bool measured_zbv_order_ = true;
  MeasuredVOrder zbv_order_;  // NOTE [ZB-V at measured costs]
  StageRunResult last_run_;
  bool has_run_ = false;  // last_run_ holds a training run's measurements.
  std::vector<StageLoad> last_loads_;
  std::vector<PlannedMove> last_moves_;
  std::function<absl::Status()> before_moves_;  // SetBeforeLayersMove's hook
  RebalanceDecision last_decision_;
  LayerRanges ranges_;  // After the last Run's moves.
  // The model's frozen prefix in the last Run (its load-trace line says what ran forward
  // only; NOTE [forward-only stages]).
  int64_t frozen_prefix_ = 0;
  LayerRanges ran_on_;  // What the last Run ran on (before its moves).
  int64_t last_iteration_ = 0;
  std::vector<std::pair<int64_t, std::string>> model_changes_;  // For the load trace.
  double plan_ms_ = 0;  // Time the last plan took (gather, decision, checks).
  // Bubble, imbalance and the before/after of moves, per iteration; what the Run before
  // the last one measured, for the load trace.
  PipelineMetrics metrics_;
  bool logged_move_ = true;  // The last decision logged moved layers (or none was logged yet).
};

}  // namespace fulcrum::pipeline
