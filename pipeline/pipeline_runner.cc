#include "pipeline/pipeline_runner.h"

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/status.h"
#include "pipeline/migration.h"

namespace fulcrum::pipeline {

PipelineRunner::PipelineRunner(parallel::Communicator* pp, std::string schedule_name,
                               int64_t micro_batch_size, std::unique_ptr<Rebalancer> rebalancer)
    : pp_(pp),
      schedule_name_(std::move(schedule_name)),
      executor_(pp, micro_batch_size),
      rebalancer_(rebalancer ? std::move(rebalancer) : std::make_unique<NoOpRebalancer>()) {}

std::vector<StageLoad> PipelineRunner::GatherLoads(const GptModel& stage, const Schedule& schedule) {
  // Fixed-size record per stage: range, action totals, then per-layer forward time for
  // every global layer (zero where another stage holds it).
  const int64_t layers = stage.options().num_layers;
  constexpr int64_t kFixed = 7;
  at::Tensor mine = at::zeros({kFixed + layers}, at::kDouble);
  double* m = mine.data_ptr<double>();
  m[0] = static_cast<double>(stage.layer_begin());
  m[1] = static_cast<double>(stage.layer_end());
  for (const ActionTiming& t : last_run_.timings) {
    const double ms = t.end_ms - t.start_ms - t.wait_ms;
    switch (t.action.kind) {
      case ActionKind::kForward: m[2] += ms; break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: m[3] += ms; break;
      case ActionKind::kBackwardWeight: m[4] += ms; break;
    }
  }
  m[5] = last_run_.wait_ms;
  m[6] = last_run_.total_ms;
  for (const auto& [index, ms] : last_run_.layer_forward_ms) m[kFixed + index] = ms;
  at::Tensor all = pp_->AllGather(mine.unsqueeze(0));  // [stages, kFixed + layers]
  std::vector<StageLoad> loads(schedule.num_stages);
  for (int s = 0; s < schedule.num_stages; ++s) {
    const double* r = all[s].data_ptr<double>();
    StageLoad& load = loads[s];
    load.stage = s;
    load.layer_begin = static_cast<int64_t>(r[0]);
    load.layer_end = static_cast<int64_t>(r[1]);
    load.forward_ms = r[2];
    load.backward_ms = r[3];
    load.weight_ms = r[4];
    load.wait_ms = r[5];
    load.total_ms = r[6];
    for (int64_t l = load.layer_begin; l < load.layer_end; ++l) {
      load.layer_forward_ms.push_back(r[kFixed + l]);
    }
  }
  return loads;
}

absl::Status PipelineRunner::Rebalance(GptModel& stage, const Schedule& schedule,
                                       int64_t iteration) {
  const std::vector<StageLoad> loads = GatherLoads(stage, schedule);
  const std::vector<LayerMove> moves = rebalancer_->Plan(iteration, loads);
  if (moves.empty()) return absl::OkStatus();
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const StageLoad& load : loads) ranges.emplace_back(load.layer_begin, load.layer_end);
  // Validated on the gathered ranges first: every stage refuses a bad plan alike.
  FULCRUM_RETURN_IF_ERROR(ApplyMoves(ranges, moves).status());
  const int me = pp_->rank();
  for (const LayerMove& move : moves) {
    int from = -1;
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
      if (ranges[s].first <= move.layer && move.layer < ranges[s].second) from = s;
    }
    const double start_ms = timeline_ ? timeline_->NowMs() : 0.0;
    if (me == from) {
      FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<TransformerLayer> layer, stage.ReleaseLayer(move.layer));
      FULCRUM_RETURN_IF_ERROR(SendUnit(*pp_, move.to_stage, *layer));
    } else if (me == move.to_stage) {
      std::unique_ptr<TransformerLayer> shell = stage.NewLayerShell(move.layer);
      FULCRUM_RETURN_IF_ERROR(ReceiveUnit(*pp_, from, *shell));
      FULCRUM_RETURN_IF_ERROR(stage.AdoptLayer(std::move(shell)));
    }
    if (timeline_ != nullptr && (me == from || me == move.to_stage)) {
      timeline_->RecordSpan(
          absl::StrCat("move layers.", move.layer, " ", from, "->", move.to_stage), "migration",
          start_ms, timeline_->NowMs(),
          {{"iteration", std::to_string(iteration)}, {"layer", std::to_string(move.layer)},
           {"from_stage", std::to_string(from)}, {"to_stage", std::to_string(move.to_stage)}});
    }
    if (me == 0) {
      FULCRUM_LOG(INFO) << "iteration " << iteration << ": moved layer " << move.layer
                        << " from stage " << from << " to stage " << move.to_stage << " ("
                        << rebalancer_->name() << ")";
    }
    FULCRUM_ASSIGN_OR_RETURN(ranges, ApplyMoves(ranges, {move}));
    ++layers_moved_;
  }
  return absl::OkStatus();
}

absl::StatusOr<const Schedule*> PipelineRunner::ScheduleFor(const std::string& name,
                                                            int microbatches) {
  auto key = std::make_pair(name, microbatches);
  auto it = schedules_.find(key);
  if (it == schedules_.end()) {
    FULCRUM_ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(name, pp_->size(), microbatches));
    FULCRUM_RETURN_IF_ERROR(ValidateSchedule(schedule));
    it = schedules_.emplace(key, std::move(schedule)).first;
  }
  return &it->second;
}

std::pair<double, int64_t> PipelineRunner::ShareLoss(const StageRunResult& run) {
  at::Tensor t = at::tensor({run.loss_sum, static_cast<double>(run.tokens)}, at::kDouble);
  pp_->AllReduce(t, parallel::ReduceOp::kSum);
  return {t[0].item<double>(), static_cast<int64_t>(t[1].item<double>())};
}

absl::StatusOr<std::pair<double, int64_t>> PipelineRunner::Run(GptModel& stage, int64_t iteration,
                                                               const MicroBatchPlan& plan,
                                                               double loss_scale) {
  FULCRUM_ASSIGN_OR_RETURN(const Schedule* schedule, ScheduleFor(schedule_name_, plan.count));
  FULCRUM_ASSIGN_OR_RETURN(last_run_, executor_.Run(stage, *schedule, iteration, plan, loss_scale));
  if (timeline_ != nullptr) timeline_->RecordIteration(iteration, last_run_);
  // Every W of the iteration is done: layers may move now, with their final gradients, and
  // the optimizer step that follows runs on the new layout.
  FULCRUM_RETURN_IF_ERROR(Rebalance(stage, *schedule, iteration));
  // Bubble ratio of this stage: time blocked on neighbours over the iteration's pipeline
  // time; mean and max over the stages.
  const double ratio = last_run_.total_ms > 0 ? last_run_.wait_ms / last_run_.total_ms : 0.0;
  at::Tensor sum = at::tensor({ratio}, at::kDouble);
  at::Tensor max = sum.clone();
  pp_->AllReduce(sum, parallel::ReduceOp::kSum);
  pp_->AllReduce(max, parallel::ReduceOp::kMax);
  metrics_ = {{"bubble_ratio", sum.item<double>() / pp_->size()},
              {"bubble_ratio_max", max.item<double>()},
              {"pipeline_ms", last_run_.total_ms},
              {"layers_moved", static_cast<double>(layers_moved_)}};
  auto loss = ShareLoss(last_run_);
  if (timeline_ != nullptr && flush_every_ > 0 && iteration % flush_every_ == 0) {
    FULCRUM_RETURN_IF_ERROR(timeline_->Flush());
  }
  return loss;
}

absl::Status PipelineRunner::Finish() {
  return timeline_ != nullptr ? timeline_->Flush() : absl::OkStatus();
}

absl::StatusOr<std::pair<double, int64_t>> PipelineRunner::Evaluate(GptModel& stage,
                                                                    const MicroBatchPlan& plan) {
  // Any schedule's F actions form a valid forward-only order; 1F1B's is the simplest.
  FULCRUM_ASSIGN_OR_RETURN(const Schedule* schedule, ScheduleFor("1f1b", plan.count));
  FULCRUM_ASSIGN_OR_RETURN(StageRunResult run,
                           executor_.Run(stage, *schedule, /*iteration=*/0, plan, 1.0,
                                         /*forward_only=*/true));
  return ShareLoss(run);
}

}  // namespace fulcrum::pipeline
