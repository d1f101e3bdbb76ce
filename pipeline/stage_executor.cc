#include "pipeline/stage_executor.h"

#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"

namespace fulcrum::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

// Message tags between neighbouring stages: the activation and the gradient of each
// micro-batch travel under their own tags, so out-of-order arrivals never mix.
int ActivationTag(int microbatch) { return 2 * microbatch; }
int GradientTag(int microbatch) { return 2 * microbatch + 1; }

}  // namespace

// The live state of one micro-batch on this stage, from its F to its last backward action.
struct StageExecutor::InFlight {
  at::Tensor input;     // Received activation (requires grad), or undefined on stage 0.
  at::Tensor output;    // This stage's output, the root of its backward (non-last stages).
  at::Tensor loss;      // Scaled loss, the root of the backward (last stage).
  WeightGradStore weight_grads;  // Deferred weight gradients between B and W.
};

StageExecutor::StageExecutor(parallel::Communicator* pp, int64_t micro_batch_size)
    : pp_(pp), micro_batch_size_(micro_batch_size) {}

absl::StatusOr<StageRunResult> StageExecutor::Run(GptModel& model, const Schedule& schedule,
                                                  int64_t iteration, const MicroBatchPlan& plan,
                                                  double loss_scale, bool forward_only) {
  const int stage = pp_->rank();
  const int stages = pp_->size();
  if (schedule.num_stages != stages || schedule.num_microbatches != plan.count) {
    return absl::InternalError(absl::StrCat("schedule ", schedule.name, " is for ",
                                            schedule.num_stages, " stages × ",
                                            schedule.num_microbatches, " micro-batches, the run has ",
                                            stages, " × ", plan.count));
  }
  const bool first = stage == 0;
  const bool last = stage == stages - 1;
  const ModelOptions& o = model.options();
  const std::vector<int64_t> activation_shape{o.seq_length, micro_batch_size_, o.hidden_size};
  const auto start = Clock::now();
  auto since_start = [&]() {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };

  StageRunResult result;
  result.start = start;
  std::map<int, std::unique_ptr<InFlight>> in_flight;
  std::vector<std::unique_ptr<parallel::CommWork>> sends;
  std::vector<at::Tensor> send_buffers;  // Kept alive until their sends complete.
  auto send = [&](const at::Tensor& t, int peer, int tag) {
    send_buffers.push_back(t.detach().contiguous());
    sends.push_back(pp_->ISend(send_buffers.back(), peer, tag));
  };
  auto receive = [&](int peer, int tag, double* wait_ms) {
    at::Tensor buffer = at::empty(activation_shape, at::kFloat);
    const auto t0 = Clock::now();
    pp_->Recv(buffer, peer, tag);
    *wait_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    return buffer;
  };

  std::vector<Action> actions;
  for (const Action& a : schedule.stages[stage]) {
    if (!forward_only || a.kind == ActionKind::kForward) actions.push_back(a);
  }
  for (const Action& action : actions) {
    const int mb = action.microbatch;
    ActionTiming timing{action, since_start(), 0, 0};
    switch (action.kind) {
      case ActionKind::kForward: {
        auto state = std::make_unique<InFlight>();
        std::optional<at::NoGradGuard> no_grad;
        if (forward_only) no_grad.emplace();
        ForwardContext ctx{!forward_only, iteration, plan.first_sample(mb),
                           forward_only ? 0.0 : loss_scale};
        const int64_t s = o.seq_length;
        at::Tensor tokens = (first || last) ? plan.tokens(mb) : at::Tensor();
        at::Tensor hidden;
        if (first) {
          hidden = model.embedding()->Forward(tokens.narrow(1, 0, s), ctx);
        } else {
          state->input = receive(stage - 1, ActivationTag(mb), &timing.wait_ms);
          if (!forward_only) state->input.requires_grad_(true);
          hidden = state->input;
        }
        for (const auto& [index, layer] : model.layers()) {  // timed per layer: the load model
          const auto t0 = Clock::now();
          hidden = layer->Forward(hidden, ctx);
          result.layer_forward_ms[index] +=
              std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        }
        if (last) {
          LossSum loss = model.HeadLoss(hidden, tokens.narrow(1, 1, s));
          result.loss_sum += loss.sum.item<double>();
          result.tokens += loss.tokens;
          if (!forward_only) state->loss = loss.sum * loss_scale;
        } else {
          send(hidden, stage + 1, ActivationTag(mb));
          if (!forward_only) state->output = hidden;
        }
        if (!forward_only) in_flight[mb] = std::move(state);
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
        {
          std::optional<WeightGradStore::Scope> defer;
          if (split) defer.emplace(&state.weight_grads);
          if (last) {
            state.loss.backward();
          } else {
            at::Tensor grad = receive(stage + 1, GradientTag(mb), &timing.wait_ms);
            state.output.backward(grad);
          }
        }
        if (!first) send(state.input.grad(), stage - 1, GradientTag(mb));
        // The graph is freed; only the deferred weight gradients (split) remain.
        state.output = at::Tensor();
        state.loss = at::Tensor();
        state.input = at::Tensor();
        if (!split) in_flight.erase(it);
        break;
      }
      case ActionKind::kBackwardWeight: {
        auto it = in_flight.find(mb);
        if (it == in_flight.end()) {
          return absl::InternalError(absl::StrCat("stage ", stage, ": ", action.ToString(),
                                                  " without its B"));
        }
        it->second->weight_grads.Flush();
        in_flight.erase(it);
        break;
      }
    }
    timing.end_ms = since_start();
    result.wait_ms += timing.wait_ms;
    result.timings.push_back(timing);
  }
  const auto drain = Clock::now();
  for (auto& work : sends) work->Wait();
  result.wait_ms += std::chrono::duration<double, std::milli>(Clock::now() - drain).count();
  if (!in_flight.empty()) {
    return absl::InternalError(absl::StrCat("stage ", stage, ": ", in_flight.size(),
                                            " micro-batches still in flight after the schedule"));
  }
  result.total_ms = since_start();
  return result;
}

}  // namespace fulcrum::pipeline
