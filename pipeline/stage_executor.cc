#include "pipeline/stage_executor.h"

#include <chrono>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "pipeline/internal/activation_meter.h"
#include "pipeline/internal/stage_moves.h"
#include "pipeline/internal/stage_transport.h"

namespace fulcrum::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

// The live state of one micro-batch on this stage, from its F to its last backward action.
struct StageExecutor::InFlight {
  at::Tensor input;     // Received activation (requires grad), or undefined on stage 0.
  at::Tensor output;    // This stage's output, the root of its backward (non-last stages).
  at::Tensor loss;      // Scaled loss, the root of the backward (last stage).
  WeightGradStore weight_grads;  // Deferred weight gradients between B and W.
  // NOTE [per-layer timing]: the layers the F ran, in order, and when the backward passed
  // each one's input; on the last stage, when it reached the head's input.
  std::vector<int64_t> layers;
  std::vector<std::optional<Clock::time_point>> input_grad_at;
  std::optional<Clock::time_point> head_input_grad_at;
};

// Everything one Run works with. The meter is constructed first: every tensor of the run
// (the transport's receive buffers included) is allocated while it counts.
struct StageExecutor::RunContext {
  RunContext(GptModel& model, const MicroBatchPlan& plan, int64_t iteration, double loss_scale,
             bool forward_only, parallel::Communicator* pp, const std::vector<Action>& actions,
             int64_t micro_batch_size, size_t depth)
      : model(model),
        plan(plan),
        iteration(iteration),
        loss_scale(loss_scale),
        training(!forward_only),
        first(pp->rank() == 0),
        last(pp->rank() == pp->size() - 1),
        stage(pp->rank()),
        meter(/*enabled=*/training),
        // Activations are [seq_length, micro_batch_size, hidden] between stages.
        transport(pp, actions,
                  {model.options().seq_length, micro_batch_size, model.options().hidden_size},
                  // NOTE [device seam]: activations travel in the compute dtype (bf16
                  // under --bf16) and are received onto the spec's device.
                  at::TensorOptions()
                      .dtype(model.options().device_spec.compute_dtype)
                      .device(model.options().device_spec.device),
                  depth,
                  /*receive_gradients=*/training && model.output_needs_grad(),
                  /*carried_channels=*/model.carries_token_state() ? 1 : 0) {}

  GptModel& model;
  const MicroBatchPlan& plan;
  const int64_t iteration;
  const double loss_scale;
  const bool training;
  const bool first;
  const bool last;
  const int stage;
  internal::RunMeter meter;
  internal::StageTransport transport;
  std::map<int, std::unique_ptr<InFlight>> in_flight;
  StageRunResult result;
};

StageExecutor::StageExecutor(parallel::Communicator* pp, int64_t micro_batch_size)
    : pp_(pp),
      micro_batch_size_(micro_batch_size),
      moves_(std::make_unique<internal::StageMoves>(pp)) {}

StageExecutor::~StageExecutor() = default;

double StageExecutor::SinceRunStart() const { return Ms(Clock::now() - run_start_); }

absl::StatusOr<StageRunResult> StageExecutor::Run(GptModel& model, const Schedule& schedule,
                                                  int64_t iteration, const MicroBatchPlan& plan,
                                                  double loss_scale, bool forward_only,
                                                  const std::vector<PlannedMove>& moves) {
  const int stage = pp_->rank();
  const int stages = pp_->size();
  if (schedule.num_stages != stages || schedule.num_microbatches != plan.count) {
    return absl::InternalError(absl::StrCat("schedule ", schedule.name, " is for ",
                                            schedule.num_stages, " stages × ",
                                            schedule.num_microbatches, " micro-batches, the run has ",
                                            stages, " × ", plan.count));
  }
  const bool training = !forward_only;
  run_start_ = Clock::now();
  std::vector<Action> actions;
  int last_backward = -1;  // Index of the last B, W or BW: where outgoing layers leave.
  for (const Action& a : schedule.stages[stage]) {
    if (!training && a.kind != ActionKind::kForward) continue;
    if (a.kind != ActionKind::kForward) last_backward = static_cast<int>(actions.size());
    actions.push_back(a);
  }
  // This stage's part of the moves (NOTE [early migration]): the receives are posted now.
  FULCRUM_RETURN_IF_ERROR(moves_->Begin(training ? moves : std::vector<PlannedMove>{}, run_start_));
  if (moves_->sends() && last_backward < 0) {
    return absl::InternalError(absl::StrCat("stage ", stage, ": moves planned but no backward"));
  }

  // NOTE [pre-posted receives]: in the order the list consumes them.
  const size_t depth = static_cast<size_t>(std::max(1, schedule.max_in_flight));
  RunContext run(model, plan, iteration, loss_scale, forward_only, pp_, actions,
                 micro_batch_size_, depth);
  run.result.start = run_start_;
  for (int index = 0; index < static_cast<int>(actions.size()); ++index) {
    const Action& action = actions[index];
    ActionTiming timing;
    timing.action = action;
    timing.start_ms = SinceRunStart();
    const bool last_action = index == last_backward;
    switch (action.kind) {
      case ActionKind::kForward:
        FULCRUM_RETURN_IF_ERROR(Forward(run, action.microbatch, timing));
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        FULCRUM_RETURN_IF_ERROR(Backward(run, action.microbatch,
                                         action.kind == ActionKind::kBackwardInput, last_action,
                                         timing));
        break;
      case ActionKind::kBackwardWeight:
        FULCRUM_RETURN_IF_ERROR(Weight(run, action.microbatch, last_action, timing));
        break;
    }
    timing.end_ms = SinceRunStart();
    run.result.wait_ms += timing.wait_ms;
    run.result.timings.push_back(std::move(timing));
  }
  run.result.wait_ms += run.transport.WaitForSends();
  if (!run.in_flight.empty()) {
    return absl::InternalError(absl::StrCat("stage ", stage, ": ", run.in_flight.size(),
                                            " micro-batches still in flight after the schedule"));
  }
  run.result.total_ms = SinceRunStart();
  run.result.peak_activation_bytes = run.meter.peak();
  return std::move(run.result);
}

absl::Status StageExecutor::Forward(RunContext& run, int mb, ActionTiming& timing) {
  GptModel& model = run.model;
  auto state = std::make_unique<InFlight>();
  std::optional<at::NoGradGuard> no_grad;
  if (!run.training) no_grad.emplace();
  ForwardContext ctx{run.training, run.iteration, run.plan.first_sample(mb),
                     run.training ? run.loss_scale : 0.0};
  ctx.epoch = run.plan.epoch;
  if (run.training && run.plan.token_positions && model.needs_token_positions()) {
    ctx.token_positions = run.plan.token_positions(mb);
  }
  const int64_t s = model.options().seq_length;
  const bool carry = model.carries_token_state();
  at::Tensor tokens =
      (run.first || run.last || model.needs_labels()) ? run.plan.tokens(mb) : at::Tensor();
  if (model.needs_labels()) ctx.labels = tokens.narrow(1, 1, s).t();
  if (!run.first) {
    FULCRUM_ASSIGN_OR_RETURN(state->input, run.transport.TakeActivation(mb, &timing.wait_ms));
    if (carry) {  // NOTE [carried token state]: the last channel
      const int64_t h = model.options().hidden_size;
      ctx.token_state = state->input.select(2, h).to(at::kFloat);
      state->input = state->input.narrow(2, 0, h).contiguous();
    }
    // NOTE [frozen prefix] in core/gpt_model.h: no gradient into the frozen layers before.
    if (run.training && model.input_needs_grad()) state->input.requires_grad_(true);
  }
  const int64_t live_before = run.meter.live();
  at::Tensor hidden =
      run.first ? model.Embed(tokens.narrow(1, 0, s), ctx) : state->input;
  state->layers.reserve(model.layers().size());
  state->input_grad_at.resize(model.layers().size());
  for (const auto& [layer_index, layer] : model.layers()) {  // timed per layer: the load model
    const size_t slot = state->layers.size();
    state->layers.push_back(layer_index);
    if (run.training && hidden.requires_grad()) {
      InFlight* st = state.get();
      hidden.register_hook(
          [st, slot](const at::Tensor&) { st->input_grad_at[slot] = Clock::now(); });
    }
    const int64_t layer_live_before = run.meter.live();
    const auto t0 = Clock::now();
    {
      WeightGradStore::TagScope tag(layer_index);  // NOTE [weight-gradient tags]
      hidden = layer->Forward(hidden, ctx);
    }
    const double ms = Ms(Clock::now() - t0);
    run.result.layer_forward_ms[layer_index] += ms;
    timing.layer_ms.emplace_back(layer_index, ms);
    if (run.training) {
      double& bytes = run.result.layer_activation_bytes[layer_index];
      bytes = std::max(bytes, static_cast<double>(run.meter.live() - layer_live_before));
    }
  }
  if (run.last) {
    if (run.training && hidden.requires_grad()) {
      InFlight* st = state.get();
      hidden.register_hook([st](const at::Tensor&) { st->head_input_grad_at = Clock::now(); });
    }
    LossSum loss = model.HeadLoss(hidden, tokens.narrow(1, 1, s));
    run.result.loss_sum += loss.sum.item<double>();
    run.result.tokens += loss.tokens;
    if (run.training) state->loss = loss.sum * run.loss_scale;
  } else if (carry) {
    const at::Tensor carried = ctx.token_state.defined()
                                   ? ctx.token_state
                                   : at::full({hidden.size(0), hidden.size(1)},
                                             model.initial_token_state(),
                                             hidden.options().dtype(at::kFloat));
    run.transport.SendActivation(
        at::cat({hidden.detach(), carried.to(hidden.scalar_type()).unsqueeze(-1)}, 2), mb);
    if (run.training) state->output = hidden;
  } else {
    run.transport.SendActivation(hidden, mb);
    if (run.training) state->output = hidden;
  }
  if (run.training) {
    run.meter.Hold(mb, run.meter.live() - live_before + Bytes(state->input));
    run.in_flight[mb] = std::move(state);
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::Backward(RunContext& run, int mb, bool split, bool last_action,
                                     ActionTiming& timing) {
  auto it = run.in_flight.find(mb);
  if (it == run.in_flight.end()) {
    return absl::InternalError(absl::StrCat("stage ", run.stage, ": ", split ? "B" : "BW", mb,
                                            " before its forward"));
  }
  InFlight& state = *it->second;
  Clock::time_point backward_start = Clock::now();
  // NOTE [frozen prefix]: a stage whose layers all lie in the frozen prefix has nothing to
  // differentiate; the next stage sends it no gradient.
  const bool differentiate = run.last || state.output.requires_grad();
  if (differentiate) {
    std::optional<WeightGradStore::Scope> defer;
    if (split) defer.emplace(&state.weight_grads);
    if (run.last) {
      backward_start = Clock::now();
      state.loss.backward();
    } else {
      FULCRUM_ASSIGN_OR_RETURN(at::Tensor grad, run.transport.TakeGradient(mb, &timing.wait_ms));
      backward_start = Clock::now();
      state.output.backward(grad);
    }
  }
  // NOTE [per-layer timing]: the layers' backwards ran last to first.
  Clock::time_point boundary =
      run.last && state.head_input_grad_at ? *state.head_input_grad_at : backward_start;
  for (size_t i = state.layers.size(); i-- > 0;) {
    if (!state.input_grad_at[i]) continue;  // No gradient reached it (frozen).
    const double ms = Ms(*state.input_grad_at[i] - boundary);
    boundary = *state.input_grad_at[i];
    run.result.layer_backward_ms[state.layers[i]] += ms;
    timing.layer_ms.emplace_back(state.layers[i], ms);
  }
  if (!run.first && run.model.input_needs_grad()) run.transport.SendGradient(state.input.grad(), mb);
  // The graph is freed; only the deferred weight gradients (split) remain.
  state.output = at::Tensor();
  state.loss = at::Tensor();
  state.input = at::Tensor();
  if (split) {
    run.meter.Hold(mb, state.weight_grads.held_bytes());
    return absl::OkStatus();
  }
  run.meter.Release(mb);
  run.in_flight.erase(it);
  // After a last fused BW every weight gradient is final: the outgoing layers leave.
  if (last_action) FULCRUM_RETURN_IF_ERROR(SendOutgoingLayers(run, nullptr, nullptr, timing));
  return absl::OkStatus();
}

absl::Status StageExecutor::Weight(RunContext& run, int mb, bool last_action, ActionTiming& timing) {
  auto it = run.in_flight.find(mb);
  if (it == run.in_flight.end()) {
    return absl::InternalError(absl::StrCat("stage ", run.stage, ": W", mb, " without its B"));
  }
  WeightGradStore& store = it->second->weight_grads;
  std::map<int64_t, double> ms_by_tag;
  // NOTE [early migration]: each moving layer's last weight gradients first, then off.
  if (last_action) FULCRUM_RETURN_IF_ERROR(SendOutgoingLayers(run, &store, &ms_by_tag, timing));
  store.Flush(&ms_by_tag);
  for (const auto& [tag, ms] : ms_by_tag) {
    if (tag == WeightGradStore::kNoTag) continue;  // head, embedding: no layer's
    run.result.layer_weight_ms[tag] += ms;
    timing.layer_ms.emplace_back(tag, ms);
  }
  run.meter.Release(mb);
  run.in_flight.erase(it);
  return absl::OkStatus();
}

absl::Status StageExecutor::SendOutgoingLayers(RunContext& run, WeightGradStore* store,
                                               std::map<int64_t, double>* ms_by_tag,
                                               ActionTiming& timing) {
  for (const PlannedMove& move : moves_->outgoing()) {
    if (store != nullptr) store->FlushTag(move.layer, ms_by_tag);
    const double t0 = SinceRunStart();
    FULCRUM_RETURN_IF_ERROR(moves_->Send(run.model, move, &run.meter, run.result));
    timing.migration_ms += SinceRunStart() - t0;
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::FinishMoves(GptModel& model, StageRunResult& result,
                                        std::pair<int64_t, int64_t> range) {
  return moves_->Finish(model, range, result);
}

}  // namespace fulcrum::pipeline
