#include "pipeline/stage_executor.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace fulcrum::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

int64_t Bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Message tags between neighbouring stages: the activation and the gradient of each
// micro-batch travel under their own tags, so out-of-order arrivals never mix.
int ActivationTag(int microbatch) { return 2 * microbatch; }
int GradientTag(int microbatch) { return 2 * microbatch + 1; }

// The receives of one direction (activations from the previous stage, or gradients from the
// next), posted up to `depth` ahead in the order the action list consumes them (NOTE
// [pre-posted receives]).
class ReceiveQueue {
 public:
  ReceiveQueue(parallel::Communicator* pp, int peer, std::vector<int> tags,
               std::vector<int64_t> shape, at::ScalarType dtype, size_t depth)
      : pp_(pp),
        peer_(peer),
        tags_(std::move(tags)),
        shape_(std::move(shape)),
        dtype_(dtype),
        depth_(depth) {
    Refill();
  }

  // Waits for the message under `tag`, which must be the next one of the list, and posts
  // the next receive. Adds the time blocked to *wait_ms.
  absl::StatusOr<at::Tensor> Take(int tag, double* wait_ms) {
    if (posted_.empty() || posted_.front().tag != tag) {
      return absl::InternalError(absl::StrCat("receive with tag ", tag, " from stage ", peer_,
                                              " is not the next one the action list expects"));
    }
    Posted next = std::move(posted_.front());
    posted_.pop_front();
    const auto t0 = Clock::now();
    next.work->Wait();
    *wait_ms += Ms(Clock::now() - t0);
    Refill();
    return next.buffer;
  }

 private:
  struct Posted {
    int tag;
    at::Tensor buffer;
    std::unique_ptr<parallel::CommWork> work;
  };

  void Refill() {
    while (posted_.size() < depth_ && next_ < tags_.size()) {
      Posted p{tags_[next_++], at::empty(shape_, dtype_), nullptr};
      p.work = pp_->IRecv(p.buffer, peer_, p.tag);
      posted_.push_back(std::move(p));
    }
  }

  parallel::Communicator* pp_;
  int peer_;
  std::vector<int> tags_;
  std::vector<int64_t> shape_;
  at::ScalarType dtype_;
  size_t depth_;
  size_t next_ = 0;
  std::deque<Posted> posted_;
};

}  // namespace

// NOTE [activation memory]: bytes allocated minus bytes freed on the threads where it is
// installed, while enabled. The CPU allocator (and CUDA's caching allocator) report every
// allocation and free to the thread's c10 memory reporter.
class StageExecutor::ActivationMeter final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, int64_t /*total_allocated*/,
                         int64_t /*total_reserved*/, c10::Device /*device*/) override {
    live_.fetch_add(alloc_size, std::memory_order_relaxed);
  }
  // Disabled around migrations: they free tensors allocated before the meter was installed,
  // which c10 could not size (and would warn about).
  bool memoryProfilingEnabled() const override { return enabled_; }
  int64_t live() const { return live_.load(std::memory_order_relaxed); }
  void set_enabled(bool enabled) { enabled_ = enabled; }

 private:
  std::atomic<int64_t> live_{0};
  bool enabled_ = true;
};

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

StageExecutor::StageExecutor(parallel::Communicator* pp, int64_t micro_batch_size)
    : pp_(pp), micro_batch_size_(micro_batch_size) {}

double StageExecutor::SinceRunStart() const { return Ms(Clock::now() - run_start_); }

absl::Status StageExecutor::StartSend(GptModel& model, const PlannedMove& move, bool early,
                                      StageRunResult& result) {
  if (meter_ != nullptr) meter_->set_enabled(false);
  MigrationTiming timing;
  timing.layer = move.layer;
  timing.from_stage = move.from_stage;
  timing.to_stage = move.to_stage;
  timing.sent = true;
  timing.early = early;
  timing.start_ms = SinceRunStart();
  {
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<TransformerLayer> layer, model.ReleaseLayer(move.layer));
    FULCRUM_ASSIGN_OR_RETURN(UnitSend send, StartSendUnit(*pp_, move.to_stage, *layer));
    timing.bytes = send.bytes();
    sends_.push_back({std::move(send), result.migrations.size()});
  }  // The layer is gone; its state travels as copies.
  timing.end_ms = SinceRunStart();
  result.migrations.push_back(timing);
  if (meter_ != nullptr) meter_->set_enabled(true);
  return absl::OkStatus();
}

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
  if (!late_moves_.empty() || !sends_.empty()) {
    return absl::InternalError("StageExecutor::Run: FinishMoves was not called after the last run");
  }
  const bool training = !forward_only;
  const bool first = stage == 0;
  const bool last = stage == stages - 1;
  const ModelOptions& o = model.options();
  const std::vector<int64_t> activation_shape{o.seq_length, micro_batch_size_, o.hidden_size};
  run_start_ = Clock::now();
  auto since_start = [this]() { return SinceRunStart(); };

  StageRunResult result;
  result.start = run_start_;

  std::vector<Action> actions;
  for (const Action& a : schedule.stages[stage]) {
    if (training || a.kind == ActionKind::kForward) actions.push_back(a);
  }

  // This stage's part of the moves (NOTE [early migration]): sends before its first receive
  // go in the last action; the rest wait for FinishMoves. Receives are posted now.
  std::vector<PlannedMove> early_sends;
  int last_backward = -1;
  if (training) {
    bool received = false;
    for (const PlannedMove& move : moves) {
      if (move.to_stage == stage) {
        received = true;
        receives_.push_back(StartReceiveUnit(*pp_, move.from_stage));
        late_moves_.push_back(move);
      } else if (move.from_stage == stage) {
        (received ? late_moves_ : early_sends).push_back(move);
      }
    }
    for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
      if (actions[i].kind == ActionKind::kBackward ||
          actions[i].kind == ActionKind::kBackwardWeight) {
        last_backward = i;
      }
    }
    if (!early_sends.empty() && last_backward < 0) {
      return absl::InternalError(absl::StrCat("stage ", stage, ": moves planned but no backward"));
    }
  }

  // NOTE [activation memory]: counted on this thread for the whole run (training only),
  // installed before anything of the run is allocated, so that every tensor freed while it
  // counts was allocated while it counted.
  std::shared_ptr<ActivationMeter> meter;
  std::optional<c10::DebugInfoGuard> meter_guard;
  if (training) {
    meter = std::make_shared<ActivationMeter>();
    meter_guard.emplace(c10::DebugInfoKind::PROFILER_STATE, meter);
  }
  struct MeterReset {
    StageExecutor* executor;
    ~MeterReset() { executor->meter_ = nullptr; }
  } meter_reset{this};
  meter_ = meter.get();

  // NOTE [pre-posted receives]: in the order the list consumes them.
  std::vector<int> activation_tags, gradient_tags;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward && !first) activation_tags.push_back(ActivationTag(a.microbatch));
    if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && !last) {
      gradient_tags.push_back(GradientTag(a.microbatch));
    }
  }
  const size_t depth = static_cast<size_t>(std::max(1, schedule.max_in_flight));
  const at::ScalarType dtype = ParamsScalarType(o);
  ReceiveQueue activations(pp_, stage - 1, std::move(activation_tags), activation_shape, dtype,
                           depth);
  ReceiveQueue gradients(pp_, stage + 1, std::move(gradient_tags), activation_shape, dtype, depth);

  std::map<int, int64_t> held_bytes;  // Per micro-batch in flight.
  int64_t held_total = 0;
  auto hold = [&](int mb, int64_t bytes) {
    held_total += bytes - held_bytes[mb];
    held_bytes[mb] = bytes;
    result.peak_activation_bytes = std::max(result.peak_activation_bytes, held_total);
  };
  auto release = [&](int mb) {
    held_total -= held_bytes[mb];
    held_bytes.erase(mb);
  };

  std::map<int, std::unique_ptr<InFlight>> in_flight;
  std::vector<std::unique_ptr<parallel::CommWork>> sends;
  std::vector<at::Tensor> send_buffers;  // Kept alive until their sends complete.
  auto send = [&](const at::Tensor& t, int peer, int tag) {
    send_buffers.push_back(t.detach().contiguous());
    sends.push_back(pp_->ISend(send_buffers.back(), peer, tag));
  };

  for (int index = 0; index < static_cast<int>(actions.size()); ++index) {
    const Action& action = actions[index];
    const int mb = action.microbatch;
    ActionTiming timing;
    timing.action = action;
    timing.start_ms = since_start();
    switch (action.kind) {
      case ActionKind::kForward: {
        auto state = std::make_unique<InFlight>();
        std::optional<at::NoGradGuard> no_grad;
        if (forward_only) no_grad.emplace();
        ForwardContext ctx{training, iteration, plan.first_sample(mb),
                           forward_only ? 0.0 : loss_scale};
        ctx.epoch = plan.epoch;
        if (training && plan.token_positions && model.needs_token_positions()) {
          ctx.token_positions = plan.token_positions(mb);
        }
        const int64_t s = o.seq_length;
        at::Tensor tokens = (first || last) ? plan.tokens(mb) : at::Tensor();
        at::Tensor hidden;
        if (!first) {
          FULCRUM_ASSIGN_OR_RETURN(state->input,
                                   activations.Take(ActivationTag(mb), &timing.wait_ms));
          if (training) state->input.requires_grad_(true);
        }
        const int64_t live_before = meter ? meter->live() : 0;
        hidden = first ? model.embedding()->Forward(tokens.narrow(1, 0, s), ctx) : state->input;
        state->layers.reserve(model.layers().size());
        state->input_grad_at.resize(model.layers().size());
        for (const auto& [layer_index, layer] : model.layers()) {  // timed per layer: the load model
          const size_t slot = state->layers.size();
          state->layers.push_back(layer_index);
          if (training && hidden.requires_grad()) {
            InFlight* st = state.get();
            hidden.register_hook(
                [st, slot](const at::Tensor&) { st->input_grad_at[slot] = Clock::now(); });
          }
          const auto t0 = Clock::now();
          {
            WeightGradStore::TagScope tag(layer_index);  // NOTE [weight-gradient tags]
            hidden = layer->Forward(hidden, ctx);
          }
          const double ms = Ms(Clock::now() - t0);
          result.layer_forward_ms[layer_index] += ms;
          timing.layer_ms.emplace_back(layer_index, ms);
        }
        if (last) {
          if (training && hidden.requires_grad()) {
            InFlight* st = state.get();
            hidden.register_hook([st](const at::Tensor&) { st->head_input_grad_at = Clock::now(); });
          }
          LossSum loss = model.HeadLoss(hidden, tokens.narrow(1, 1, s));
          result.loss_sum += loss.sum.item<double>();
          result.tokens += loss.tokens;
          if (training) state->loss = loss.sum * loss_scale;
        } else {
          send(hidden, stage + 1, ActivationTag(mb));
          if (training) state->output = hidden;
        }
        if (training) {
          hold(mb, (meter ? meter->live() - live_before : 0) + Bytes(state->input));
          in_flight[mb] = std::move(state);
        }
        break;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        auto it = in_flight.find(mb);
        if (it == in_flight.end()) {
          return absl::InternalError(absl::StrCat("stage ", stage, ": ", action.ToString(),
                                                  " before its forward"));
        }
        InFlight& state = *it->second;
        const bool split = action.kind == ActionKind::kBackwardInput;
        Clock::time_point backward_start;
        {
          std::optional<WeightGradStore::Scope> defer;
          if (split) defer.emplace(&state.weight_grads);
          if (last) {
            backward_start = Clock::now();
            state.loss.backward();
          } else {
            FULCRUM_ASSIGN_OR_RETURN(at::Tensor grad,
                                     gradients.Take(GradientTag(mb), &timing.wait_ms));
            backward_start = Clock::now();
            state.output.backward(grad);
          }
        }
        // NOTE [per-layer timing]: the layers' backwards ran last to first.
        Clock::time_point boundary =
            last && state.head_input_grad_at ? *state.head_input_grad_at : backward_start;
        for (size_t i = state.layers.size(); i-- > 0;) {
          if (!state.input_grad_at[i]) continue;  // No gradient reached it (frozen).
          const double ms = Ms(*state.input_grad_at[i] - boundary);
          boundary = *state.input_grad_at[i];
          result.layer_backward_ms[state.layers[i]] += ms;
          timing.layer_ms.emplace_back(state.layers[i], ms);
        }
        if (!first) send(state.input.grad(), stage - 1, GradientTag(mb));
        // The graph is freed; only the deferred weight gradients (split) remain.
        state.output = at::Tensor();
        state.loss = at::Tensor();
        state.input = at::Tensor();
        if (split) {
          hold(mb, state.weight_grads.held_bytes());
        } else {
          release(mb);
          in_flight.erase(it);
          if (index == last_backward) {
            const double t0 = since_start();
            for (const PlannedMove& move : early_sends) {
              FULCRUM_RETURN_IF_ERROR(StartSend(model, move, /*early=*/true, result));
            }
            timing.migration_ms += since_start() - t0;
          }
        }
        break;
      }
      case ActionKind::kBackwardWeight: {
        auto it = in_flight.find(mb);
        if (it == in_flight.end()) {
          return absl::InternalError(absl::StrCat("stage ", stage, ": ", action.ToString(),
                                                  " without its B"));
        }
        WeightGradStore& store = it->second->weight_grads;
        std::map<int64_t, double> ms_by_tag;
        if (index == last_backward) {
          // NOTE [early migration]: a moving layer's last weight gradients first, then off.
          for (const PlannedMove& move : early_sends) {
            store.FlushTag(move.layer, &ms_by_tag);
            const double t0 = since_start();
            FULCRUM_RETURN_IF_ERROR(StartSend(model, move, /*early=*/true, result));
            timing.migration_ms += since_start() - t0;
          }
        }
        store.Flush(&ms_by_tag);
        for (const auto& [tag, ms] : ms_by_tag) {
          if (tag == WeightGradStore::kNoTag) continue;  // head, embedding: no layer's
          result.layer_weight_ms[tag] += ms;
          timing.layer_ms.emplace_back(tag, ms);
        }
        release(mb);
        in_flight.erase(it);
        break;
      }
    }
    timing.end_ms = since_start();
    result.wait_ms += timing.wait_ms;
    result.timings.push_back(std::move(timing));
  }
  const auto drain = Clock::now();
  for (auto& work : sends) work->Wait();
  result.wait_ms += Ms(Clock::now() - drain);
  if (!in_flight.empty()) {
    return absl::InternalError(absl::StrCat("stage ", stage, ": ", in_flight.size(),
                                            " micro-batches still in flight after the schedule"));
  }
  result.total_ms = since_start();
  return result;
}

absl::Status StageExecutor::FinishMoves(GptModel& model, StageRunResult& result) {
  const int stage = pp_->rank();
  std::vector<PlannedMove> moves = std::exchange(late_moves_, {});
  std::vector<UnitReceive> receives = std::exchange(receives_, {});
  size_t next_receive = 0;
  for (const PlannedMove& move : moves) {
    if (move.to_stage != stage) {
      FULCRUM_RETURN_IF_ERROR(StartSend(model, move, /*early=*/false, result));
      continue;
    }
    MigrationTiming timing;
    timing.layer = move.layer;
    timing.from_stage = move.from_stage;
    timing.to_stage = move.to_stage;
    timing.start_ms = SinceRunStart();
    std::unique_ptr<TransformerLayer> shell = model.NewLayerShell(move.layer);
    UnitReceive& receive = receives[next_receive++];
    FULCRUM_RETURN_IF_ERROR(receive.Finish(*shell));
    timing.bytes = receive.bytes();
    FULCRUM_RETURN_IF_ERROR(model.AdoptLayer(std::move(shell)));
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
  return absl::OkStatus();
}

}  // namespace fulcrum::pipeline
