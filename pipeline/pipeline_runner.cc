#include "pipeline/pipeline_runner.h"

#include "core/status.h"

namespace fulcrum::pipeline {

PipelineRunner::PipelineRunner(parallel::Communicator* pp, std::string schedule_name,
                               int64_t micro_batch_size)
    : pp_(pp), schedule_name_(std::move(schedule_name)), executor_(pp, micro_batch_size) {}

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
  // Bubble ratio of this stage: time blocked on neighbours over the iteration's pipeline
  // time; mean and max over the stages.
  const double ratio = last_run_.total_ms > 0 ? last_run_.wait_ms / last_run_.total_ms : 0.0;
  at::Tensor sum = at::tensor({ratio}, at::kDouble);
  at::Tensor max = sum.clone();
  pp_->AllReduce(sum, parallel::ReduceOp::kSum);
  pp_->AllReduce(max, parallel::ReduceOp::kMax);
  metrics_ = {{"bubble_ratio", sum.item<double>() / pp_->size()},
              {"bubble_ratio_max", max.item<double>()},
              {"pipeline_ms", last_run_.total_ms}};
  return ShareLoss(last_run_);
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
