#include "pipeline/stage_executor.h"

#include <chrono>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/kernels/device_timer.h"
#include "core/status.h"
#include "pipeline/internal/activation_meter.h"
#include "pipeline/internal/stage_moves.h"
#include "pipeline/internal/stage_transport.h"

namespace fulcrum::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// NOTE [per-layer timing]: the timer's keys name the action (its index in the run's list)
// and the layer, so that one Collect at the end of the run gives each action its own
// per-layer times. W keys end in the weight-gradient tag (WeightGradStore appends it).
std::string LayerKey(char kind, int action, int64_t layer) {
  return absl::StrCat(std::string(1, kind), "/", action, "/", layer);
}
std::string WeightKeyPrefix(int action) { return absl::StrCat("W/", action, "/"); }
// NOTE [action times on the device]: the whole action, for its start and end.
std::string ActionKey(int action) { return absl::StrCat("A/", action); }

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

// The live state of one micro-batch on this stage, from its F to its last backward action.
struct StageExecutor::InFlight {
  int chunk = 0;        // Which of the stage's chunks (NOTE [model chunks] in core/gpt_model.h).
  int meter_key = 0;    // The pair's key in the activation meter.
  bool local_input = false;  // Handed over from this stage's chunk before (not received).
  at::Tensor input;     // Received activation (requires grad), or undefined on stage 0.
  at::Tensor output;    // This stage's output, the root of its backward (non-last stages).
  at::Tensor loss;      // Scaled loss, the root of the backward (last stage).
  WeightGradStore weight_grads;  // Deferred weight gradients between B and W.
  // NOTE [per-layer timing]: the layers the F ran, in order; the first slot whose input
  // carries a gradient hook (the hooked slots are a suffix: after the frozen prefix, every
  // input requires grad). During a B the hooks chain the timer's intervals: `open_slot` is
  // the slot whose backward is being timed, -1 when none.
  std::vector<int64_t> layers;
  size_t first_hooked = SIZE_MAX;
  int64_t open_slot = -1;
  std::string open_key;
  int backward_action = -1;  // Index of the B (or BW) running now.
};

// A per-layer interval of the run, resolved after the one Collect (F and B; W intervals
// are found by their keys' prefix).
struct StageExecutor::LayerInterval {
  int action;
  int64_t layer;
  std::string key;
};

// Everything one Run works with. The meter is constructed first: every tensor of the run
// (the transport's receive buffers included) is allocated while it counts.
struct StageExecutor::RunContext {
  RunContext(GptModel& model, const Schedule& schedule, const MicroBatchPlan& plan,
             int64_t iteration, double loss_scale, bool forward_only, parallel::Communicator* pp,
             const std::vector<Action>& actions, int64_t micro_batch_size, size_t depth)
      : model(model),
        plan(plan),
        iteration(iteration),
        loss_scale(loss_scale),
        training(!forward_only),
        stage(pp->rank()),
        num_chunks(schedule.num_chunks),
        virtual_of(ChunkVirtualStages(schedule, pp->rank())),
        last_virtual(schedule.num_stages * schedule.num_chunks - 1),
        forward_only_virtual(schedule.forward_only),
        meter(/*enabled=*/training),
        // Activations are [seq_length, micro_batch_size, hidden] between stages (this
        // rank's rows of the sequence under sequence parallelism).
        transport(pp, VirtualStages(schedule), actions,
                  {model.local_sequence_length(), micro_batch_size, model.options().hidden_size},
                  // NOTE [device seam]: activations travel in the compute dtype (bf16
                  // under --bf16) and are received onto the spec's device.
                  at::TensorOptions()
                      .dtype(model.options().device_spec.compute_dtype)
                      .device(model.options().device_spec.device),
                  depth, ReceiveGradients(model, schedule.num_chunks, training),
                  /*carried_channels=*/model.carries_token_state() ? 1 : 0) {}

  // NOTE [model chunks]: chunk c holds the first piece of the model (the embedding) or the
  // last (the head and the loss); with one chunk, the first and the last stage.
  bool first(int chunk) const { return virtual_of[chunk] == 0; }
  bool last(int chunk) const { return virtual_of[chunk] == last_virtual; }
  // NOTE [forward-only stages]: the chunk has no B, BW or W in this run's schedule.
  bool runs_forward_only(int chunk) const { return virtual_of[chunk] < forward_only_virtual; }
  // A (micro-batch, chunk) pair's key in the activation meter (the micro-batch with v = 1).
  int MeterKey(int mb, int chunk) const { return mb * num_chunks + chunk; }

  static std::vector<int> ChunkVirtualStages(const Schedule& schedule, int stage) {
    std::vector<int> out(schedule.num_chunks);
    for (int c = 0; c < schedule.num_chunks; ++c) out[c] = VirtualStageOf(schedule, stage, c);
    return out;
  }
  static std::vector<bool> ReceiveGradients(const GptModel& model, int chunks, bool training) {
    std::vector<bool> out(chunks);
    for (int c = 0; c < chunks; ++c) out[c] = training && model.output_needs_grad(c);
    return out;
  }

  GptModel& model;
  const MicroBatchPlan& plan;
  const int64_t iteration;
  const double loss_scale;
  const bool training;
  const int stage;
  const int num_chunks;
  const std::vector<int> virtual_of;  // Per chunk, its virtual stage.
  const int last_virtual;
  const int forward_only_virtual;  // Virtual stages 0..this-1 run forward only.
  internal::RunMeter meter;
  internal::StageTransport transport;
  // By (micro-batch, chunk).
  std::map<std::pair<int, int>, std::unique_ptr<InFlight>> in_flight;
  StageRunResult result;
  // NOTE [per-layer timing]: one timer per run, collected once at its end.
  std::unique_ptr<kernels::DeviceTimer> timer;
  bool time_layers = true;               // StageExecutor::set_layer_timing
  std::vector<LayerInterval> intervals;  // F and B, in the order they were timed
  int action = -1;                       // Index of the action running now.
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
  // NOTE [model chunks]: the model holds one chunk per virtual stage of this rank.
  if (model.num_chunks() != schedule.num_chunks) {
    return absl::InternalError(absl::StrCat("schedule ", schedule.name, " runs ",
                                            schedule.num_chunks, " chunks per stage; stage ",
                                            stage, "'s model holds ", model.num_chunks()));
  }
  for (int c = 0; c < schedule.num_chunks; ++c) {
    if (VirtualStageOf(schedule, stage, c) < 0) {
      return absl::InternalError(absl::StrCat("schedule ", schedule.name, " has no chunk ", c,
                                              " on stage ", stage));
    }
  }
  const bool training = !forward_only;
  run_start_ = Clock::now();
  // NOTE [action times on the device]: time zero of the device axis, marked with the host's.
  const c10::Device device = model.options().device_spec.device;
  std::unique_ptr<kernels::DeviceTimer> timer =
      timer_factory_ ? timer_factory_(device) : std::make_unique<kernels::DeviceTimer>(device);
  timer->MarkOrigin();
  std::vector<Action> actions;
  // Where each chunk's outgoing layers leave (NOTE [early migration]): the index of the
  // chunk's last action after which none of its weights changes — its last B, W or BW, or
  // its last F when it runs forward only (NOTE [forward-only stages]).
  std::vector<int> chunk_done(schedule.num_chunks, -1);
  for (const Action& a : schedule.stages[stage]) {
    if (!training && a.kind != ActionKind::kForward) continue;
    if (training && (a.kind != ActionKind::kForward || RunsForwardOnly(schedule, stage, a.chunk))) {
      chunk_done[a.chunk] = static_cast<int>(actions.size());
    }
    actions.push_back(a);
  }
  // This stage's part of the moves (NOTE [early migration]): the receives are posted now.
  FULCRUM_RETURN_IF_ERROR(moves_->Begin(training ? moves : std::vector<PlannedMove>{}, run_start_));
  for (const PlannedMove& move : moves_->outgoing()) {
    const int chunk = model.chunk_of(move.layer);
    if (chunk < 0 || chunk_done[chunk] < 0) {
      return absl::InternalError(absl::StrCat("stage ", stage, ": layer ", move.layer,
                                              " is to move but no action of its chunk ends its "
                                              "weights' work"));
    }
  }

  // NOTE [pre-posted receives]: in the order the list consumes them.
  const size_t depth = static_cast<size_t>(std::max(1, schedule.max_in_flight));
  RunContext run(model, schedule, plan, iteration, loss_scale, forward_only, pp_, actions,
                 micro_batch_size_, depth);
  run.result.start = run_start_;
  run.timer = std::move(timer);
  run.time_layers = layer_timing_;
  for (int index = 0; index < static_cast<int>(actions.size()); ++index) {
    const Action& action = actions[index];
    ActionTiming timing;
    timing.action = action;
    timing.start_ms = SinceRunStart();
    run.timer->Start(ActionKey(index));
    run.action = index;
    // NOTE [early migration]: the action after which this chunk's outgoing layers leave.
    const bool last_action = index == chunk_done[action.chunk];
    switch (action.kind) {
      case ActionKind::kForward:
        FULCRUM_RETURN_IF_ERROR(Forward(run, action.microbatch, action.chunk, timing));
        if (last_action) {
          FULCRUM_RETURN_IF_ERROR(SendOutgoingLayers(run, nullptr, action.chunk, timing));
        }
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        FULCRUM_RETURN_IF_ERROR(Backward(run, action.microbatch, action.chunk,
                                         action.kind == ActionKind::kBackwardInput, last_action,
                                         timing));
        break;
      case ActionKind::kBackwardWeight:
        FULCRUM_RETURN_IF_ERROR(Weight(run, action.microbatch, action.chunk, last_action, timing));
        break;
    }
    run.timer->Stop(ActionKey(index));
    timing.end_ms = SinceRunStart();
    run.result.wait_ms += timing.wait_ms;
    run.result.timings.push_back(std::move(timing));
  }
  run.result.wait_ms += run.transport.WaitForSends();
  if (!run.in_flight.empty()) {
    return absl::InternalError(absl::StrCat("stage ", stage, ": ", run.in_flight.size(),
                                            " micro-batches still in flight after the schedule"));
  }
  // NOTE [tied head on the embedding's rank]: every head W of the run is done.
  model.FoldTiedHeadGradient();
  run.result.total_ms = SinceRunStart();
  run.result.peak_activation_bytes = run.meter.peak();
  FULCRUM_RETURN_IF_ERROR(CollectTimes(run));
  run.result.device_memory = kernels::DeviceMemoryStats(device);
  return std::move(run.result);
}

// NOTE [per-layer timing]: the one synchronisation of the run (on a GPU, waiting for its
// events); then every action's per-layer times and the per-layer sums, added in action
// order as they were when each was timed inline; and, where the timer uses device events,
// every action's start and end (NOTE [action times on the device]).
absl::Status StageExecutor::CollectTimes(RunContext& run) {
  const bool on_device = run.timer->uses_device_events();
  std::vector<kernels::DeviceTimer::Span> spans;
  const std::map<std::string, double> ms = run.timer->Collect(on_device ? &spans : nullptr);
  std::vector<ActionTiming>& timings = run.result.timings;
  if (on_device) {
    std::vector<bool> placed(timings.size(), false);
    for (const kernels::DeviceTimer::Span& span : spans) {
      int action = 0;
      if (span.key.rfind("A/", 0) != 0 || !absl::SimpleAtoi(span.key.substr(2), &action)) continue;
      if (action < 0 || action >= static_cast<int>(timings.size()) || placed[action]) {
        return absl::InternalError(absl::StrCat("stage ", run.stage, ": the device timer returned ",
                                                "an unexpected interval '", span.key, "'"));
      }
      timings[action].start_ms = span.start_ms;
      timings[action].end_ms = span.end_ms;
      placed[action] = true;
      // The stream may finish after the host's last look at the clock.
      run.result.total_ms = std::max(run.result.total_ms, span.end_ms);
    }
    for (size_t action = 0; action < timings.size(); ++action) {
      if (!placed[action]) {
        return absl::InternalError(absl::StrCat("stage ", run.stage, ": the device timer returned ",
                                                "no interval for action ", action, " (",
                                                timings[action].action.ToString(), ")"));
      }
    }
  }
  auto by_kind = [&](int action) -> PerLayer& {
    switch (timings[action].action.kind) {
      case ActionKind::kForward:
        return run.result.layer_forward_ms;
      case ActionKind::kBackwardWeight:
        return run.result.layer_weight_ms;
      default:
        return run.result.layer_backward_ms;
    }
  };
  for (const LayerInterval& interval : run.intervals) {
    auto it = ms.find(interval.key);
    const double value = it == ms.end() ? 0.0 : it->second;
    by_kind(interval.action)[interval.layer] += value;
    timings[interval.action].layer_ms.emplace_back(interval.layer, value);
  }
  // W: "W/<action>/<tag>", by action, then tag (the order of the ms_by_tag map before).
  std::map<std::pair<int, int64_t>, double> weight;
  for (const auto& [key, value] : ms) {
    if (key.rfind("W/", 0) != 0) continue;
    const std::vector<std::string> parts = absl::StrSplit(key, '/');
    int action = 0;
    int64_t tag = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[1], &action) ||
        !absl::SimpleAtoi(parts[2], &tag)) {
      continue;
    }
    weight[{action, tag}] += value;
  }
  for (const auto& [at, value] : weight) {
    if (at.second == WeightGradStore::kNoTag) continue;  // head, embedding: no layer's
    by_kind(at.first)[at.second] += value;
    timings[at.first].layer_ms.emplace_back(at.second, value);
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::Forward(RunContext& run, int mb, int chunk, ActionTiming& timing) {
  GptModel& model = run.model;
  const bool first = run.first(chunk);
  const bool last = run.last(chunk);
  auto state = std::make_unique<InFlight>();
  state->chunk = chunk;
  state->meter_key = run.MeterKey(mb, chunk);
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
      (first || last || model.needs_labels()) ? run.plan.tokens(mb) : at::Tensor();
  if (model.needs_labels()) {  // read by plugins (early exit) on the model's device
    ctx.labels = tokens.narrow(1, 1, s).t().to(model.options().device_spec.device);
  }
  if (!first) {
    state->local_input = run.transport.HandsOverInput(chunk);
    FULCRUM_ASSIGN_OR_RETURN(state->input,
                             run.transport.TakeActivation(mb, chunk, &timing.wait_ms));
    if (carry) {  // NOTE [carried token state]: the last channel
      const int64_t h = model.options().hidden_size;
      ctx.token_state = state->input.select(2, h).to(at::kFloat);
      state->input = state->input.narrow(2, 0, h).contiguous();
    }
    // NOTE [frozen prefix] in core/gpt_model.h: no gradient into the frozen layers before.
    if (run.training && model.input_needs_grad(chunk)) state->input.requires_grad_(true);
  }
  const int64_t live_before = run.meter.live();
  at::Tensor hidden =
      first ? model.Embed(tokens.narrow(1, 0, s), ctx) : state->input;
  // NOTE [model chunks]: this chunk's layers (with one chunk, every held layer).
  const auto [chunk_begin, chunk_end] = model.chunk_range(chunk);
  const auto layers_begin = model.layers().lower_bound(chunk_begin);
  const auto layers_end = model.layers().lower_bound(chunk_end);
  state->layers.reserve(std::distance(layers_begin, layers_end));
  for (auto it = layers_begin; it != layers_end; ++it) {  // timed per layer: the load model
    const int64_t layer_index = it->first;
    const std::unique_ptr<TransformerLayer>& layer = it->second;
    const size_t slot = state->layers.size();
    state->layers.push_back(layer_index);
    if (run.training && run.time_layers && hidden.requires_grad()) {
      InFlight* st = state.get();
      RunContext* r = &run;
      state->first_hooked = std::min(state->first_hooked, slot);
      // NOTE [per-layer timing]: the gradient reached this layer's input, so its backward
      // is done: its interval ends and the previous layer's begins.
      hidden.register_hook([st, r, slot](const at::Tensor&) {
        if (st->open_slot != static_cast<int64_t>(slot)) return;  // not timed (never opened)
        r->timer->Stop(st->open_key);
        r->intervals.push_back({st->backward_action, st->layers[slot], st->open_key});
        st->open_slot = -1;
        if (slot > st->first_hooked) OpenBackwardInterval(*r, *st, slot - 1);
      });
    }
    const int64_t layer_live_before = run.meter.live();
    const std::string key = run.time_layers ? LayerKey('F', run.action, layer_index) : "";
    if (run.time_layers) run.timer->Start(key);
    // NOTE [weight-gradient tags]: ForwardLayer tags the layer's deferred weight gradients.
    hidden = model.ForwardLayer(*layer, layer_index - chunk_begin, hidden, ctx);
    if (run.time_layers) {
      run.timer->Stop(key);
      run.intervals.push_back({run.action, layer_index, key});
    }
    if (run.training) {
      double& bytes = run.result.layer_activation_bytes[layer_index];
      bytes = std::max(bytes, static_cast<double>(run.meter.live() - layer_live_before));
    }
  }
  if (last) {
    if (run.training && hidden.requires_grad() && state->first_hooked != SIZE_MAX) {
      InFlight* st = state.get();
      RunContext* r = &run;
      // The head and the loss are no layer's: the last layer's B begins here.
      hidden.register_hook([st, r](const at::Tensor&) {
        if (st->open_slot < 0 && st->backward_action >= 0) {
          OpenBackwardInterval(*r, *st, st->layers.size() - 1);
        }
      });
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
        at::cat({hidden.detach(), carried.to(hidden.scalar_type()).unsqueeze(-1)}, 2), mb, chunk);
    if (run.training) state->output = hidden;
  } else {
    run.transport.SendActivation(hidden, mb, chunk);
    if (run.training) state->output = hidden;
  }
  if (run.training && run.runs_forward_only(chunk)) {
    // NOTE [forward-only stages]: no backward comes for this chunk; it holds nothing.
    if (hidden.requires_grad()) {
      return absl::InternalError(absl::StrCat(
          "stage ", run.stage, ": chunk ", chunk, " runs forward only (virtual stage ",
          run.virtual_of[chunk], " of ", run.forward_only_virtual,
          " forward-only), but its output needs a gradient: a layer there trains"));
    }
    return absl::OkStatus();
  }
  if (run.training) {
    // A hand-over from this stage's chunk before shares that chunk's output: counted there.
    const int64_t input_bytes = state->local_input ? 0 : Bytes(state->input);
    run.meter.Hold(state->meter_key, run.meter.live() - live_before + input_bytes);
    run.in_flight[{mb, chunk}] = std::move(state);
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::Backward(RunContext& run, int mb, int chunk, bool split,
                                     bool last_action, ActionTiming& timing) {
  auto it = run.in_flight.find({mb, chunk});
  if (it == run.in_flight.end()) {
    return absl::InternalError(absl::StrCat(
        "stage ", run.stage, ": ",
        Action{split ? ActionKind::kBackwardInput : ActionKind::kBackward, mb, chunk}.ToString(),
        " before its forward"));
  }
  const bool first = run.first(chunk);
  const bool last = run.last(chunk);
  InFlight& state = *it->second;
  state.backward_action = run.action;
  // NOTE [frozen prefix]: a stage whose layers all lie in the frozen prefix has nothing to
  // differentiate; the next stage sends it no gradient.
  const bool differentiate = last || state.output.requires_grad();
  if (differentiate) {
    std::optional<WeightGradStore::Scope> defer;
    if (split) defer.emplace(&state.weight_grads);
    // NOTE [per-layer timing]: the layers' backwards run last to first; the hooks close
    // each interval and open the next (on the last stage the head's input hook opens the
    // first).
    if (last) {
      state.loss.backward();
    } else {
      FULCRUM_ASSIGN_OR_RETURN(at::Tensor grad,
                               run.transport.TakeGradient(mb, chunk, &timing.wait_ms));
      if (state.first_hooked != SIZE_MAX) {
        OpenBackwardInterval(run, state, state.layers.size() - 1);
      }
      state.output.backward(grad);
    }
  }
  if (state.open_slot >= 0) {
    // No gradient reached that layer's input: it is not timed (as before), but the
    // interval must be closed for the one Collect.
    run.timer->Stop(state.open_key);
    state.open_slot = -1;
  }
  state.backward_action = -1;
  if (!first && run.model.input_needs_grad(chunk)) {
    run.transport.SendGradient(state.input.grad(), mb, chunk);
  }
  // The graph is freed; only the deferred weight gradients (split) remain.
  state.output = at::Tensor();
  state.loss = at::Tensor();
  state.input = at::Tensor();
  if (split) {
    run.meter.Hold(state.meter_key, state.weight_grads.held_bytes());
    return absl::OkStatus();
  }
  run.meter.Release(state.meter_key);
  run.in_flight.erase(it);
  // After the chunk's last fused BW its weight gradients are final: its outgoing layers
  // leave, and the others' reductions may start.
  if (last_action) {
    FULCRUM_RETURN_IF_ERROR(SendOutgoingLayers(run, nullptr, chunk, timing));
    FULCRUM_RETURN_IF_ERROR(ReportFinalGradients(run, nullptr, chunk));
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::Weight(RunContext& run, int mb, int chunk, bool last_action,
                                   ActionTiming& timing) {
  auto it = run.in_flight.find({mb, chunk});
  if (it == run.in_flight.end()) {
    return absl::InternalError(absl::StrCat(
        "stage ", run.stage, ": ", Action{ActionKind::kBackwardWeight, mb, chunk}.ToString(),
        " without its B"));
  }
  WeightGradStore& store = it->second->weight_grads;
  // NOTE [early migration]: each moving layer's last weight gradients first, then off.
  if (last_action) FULCRUM_RETURN_IF_ERROR(SendOutgoingLayers(run, &store, chunk, timing));
  // NOTE [per-layer timing]: per tag into the timer; CollectLayerTimes reads them back.
  if (last_action && run.plan.gradients_final) {
    // NOTE [overlapped gradient reduction]: one layer's weight gradients at a time, each
    // layer's reduction free to start after its own.
    FULCRUM_RETURN_IF_ERROR(ReportFinalGradients(run, &store, chunk));
  } else {
    store.Flush(nullptr, run.time_layers ? run.timer.get() : nullptr, WeightKeyPrefix(run.action));
  }
  run.meter.Release(it->second->meter_key);
  run.in_flight.erase(it);
  return absl::OkStatus();
}

absl::Status StageExecutor::SendOutgoingLayers(RunContext& run, WeightGradStore* store,
                                               int chunk, ActionTiming& timing) {
  const auto [begin, end] = run.model.chunk_range(chunk);
  for (const PlannedMove& move : moves_->outgoing()) {
    if (move.layer < begin || move.layer >= end) continue;  // another chunk's
    if (store != nullptr) {
      store->FlushTag(move.layer, nullptr, run.time_layers ? run.timer.get() : nullptr,
                      WeightKeyPrefix(run.action));
    }
    const double t0 = SinceRunStart();
    FULCRUM_RETURN_IF_ERROR(moves_->Send(run.model, move, &run.meter, run.result));
    timing.migration_ms += SinceRunStart() - t0;
  }
  return absl::OkStatus();
}

absl::Status StageExecutor::ReportFinalGradients(RunContext& run, WeightGradStore* store,
                                                 int chunk) {
  if (!run.plan.gradients_final) return absl::OkStatus();
  const auto [begin, end] = run.model.chunk_range(chunk);
  kernels::DeviceTimer* timer = run.time_layers ? run.timer.get() : nullptr;
  const std::string prefix = WeightKeyPrefix(run.action);
  std::function<void(std::optional<int64_t>)> run_weight_grads;
  if (store != nullptr) {
    run_weight_grads = [&](std::optional<int64_t> tag) { store->Run(tag, nullptr, timer, prefix); };
  }
  return run.model.ReportFinalGradients(begin, end, run.last(chunk), run.first(chunk),
                                        run_weight_grads, run.plan.gradients_final);
}

void StageExecutor::OpenBackwardInterval(RunContext& run, InFlight& state, size_t slot) {
  state.open_slot = static_cast<int64_t>(slot);
  state.open_key = LayerKey('B', state.backward_action, state.layers[slot]);
  run.timer->Start(state.open_key);
}

absl::Status StageExecutor::FinishMoves(GptModel& model, StageRunResult& result,
                                        std::pair<int64_t, int64_t> range) {
  return moves_->Finish(model, range, result);
}

absl::Status StageExecutor::FinishMoves(GptModel& model, StageRunResult& result,
                                        std::vector<std::pair<int64_t, int64_t>> chunk_ranges) {
  return moves_->Finish(model, std::move(chunk_ranges), result);
}

}  // namespace fulcrum::pipeline
