#include "pipeline/internal/stage_transport.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace fulcrum::pipeline::internal {
namespace {

// The activation message's shape: the hidden state's and the carried token state's channels.
std::vector<int64_t> WithCarried(std::vector<int64_t> shape, int64_t carried_channels) {
  shape.back() += carried_channels;
  return shape;
}

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The tags of one direction in the order `actions` consume them.
std::vector<int> ActivationTags(const std::vector<Action>& actions) {
  std::vector<int> tags;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward) tags.push_back(ActivationTag(a.microbatch));
  }
  return tags;
}

std::vector<int> GradientTags(const std::vector<Action>& actions) {
  std::vector<int> tags;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
      tags.push_back(GradientTag(a.microbatch));
    }
  }
  return tags;
}

}  // namespace

ReceiveQueue::ReceiveQueue(parallel::Communicator* pp, int peer, std::vector<int> tags,
                           std::vector<int64_t> shape, at::TensorOptions options, size_t depth)
    : pp_(pp),
      peer_(peer),
      tags_(std::move(tags)),
      shape_(std::move(shape)),
      options_(options),
      depth_(depth) {
  Refill();
}

absl::StatusOr<at::Tensor> ReceiveQueue::Take(int tag, double* wait_ms) {
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

void ReceiveQueue::Refill() {
  while (posted_.size() < depth_ && next_ < tags_.size()) {
    Posted p{tags_[next_++], at::empty(shape_, options_), nullptr};
    p.work = pp_->IRecv(p.buffer, peer_, p.tag);
    posted_.push_back(std::move(p));
  }
}

StageTransport::StageTransport(parallel::Communicator* pp, const std::vector<Action>& actions,
                               std::vector<int64_t> shape, at::TensorOptions options,
                               size_t depth, bool receive_gradients, int64_t carried_channels)
    : pp_(pp),
      stage_(pp->rank()),
      activations_(pp, stage_ - 1, stage_ > 0 ? ActivationTags(actions) : std::vector<int>{},
                   WithCarried(shape, carried_channels), options, depth),
      gradients_(pp, stage_ + 1,
                 stage_ < pp->size() - 1 && receive_gradients ? GradientTags(actions)
                                                                : std::vector<int>{},
                 shape, options, depth) {}

absl::StatusOr<at::Tensor> StageTransport::TakeActivation(int mb, double* wait_ms) {
  return activations_.Take(ActivationTag(mb), wait_ms);
}

absl::StatusOr<at::Tensor> StageTransport::TakeGradient(int mb, double* wait_ms) {
  return gradients_.Take(GradientTag(mb), wait_ms);
}

void StageTransport::SendActivation(const at::Tensor& t, int mb) {
  Send(t, stage_ + 1, ActivationTag(mb));
}

void StageTransport::SendGradient(const at::Tensor& t, int mb) {
  Send(t, stage_ - 1, GradientTag(mb));
}

void StageTransport::Send(const at::Tensor& t, int peer, int tag) {
  send_buffers_.push_back(t.detach().contiguous());
  sends_.push_back(pp_->ISend(send_buffers_.back(), peer, tag));
}

double StageTransport::WaitForSends() {
  const auto start = Clock::now();
  for (auto& work : sends_) work->Wait();
  sends_.clear();
  send_buffers_.clear();
  return Ms(Clock::now() - start);
}

}  // namespace fulcrum::pipeline::internal
