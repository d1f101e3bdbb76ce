#include "pipeline/internal/stage_transport.h"

#include <chrono>

#include <c10/util/Exception.h>

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

// The tags of one direction of one chunk in the order `actions` consume them.
std::vector<int> ActivationTags(const std::vector<Action>& actions, int chunk, int num_chunks) {
  std::vector<int> tags;
  for (const Action& a : actions) {
    if (a.kind == ActionKind::kForward && a.chunk == chunk) {
      tags.push_back(ActivationTag(a.microbatch, chunk, num_chunks));
    }
  }
  return tags;
}

std::vector<int> GradientTags(const std::vector<Action>& actions, int chunk, int num_chunks) {
  std::vector<int> tags;
  for (const Action& a : actions) {
    if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) &&
        a.chunk == chunk) {
      tags.push_back(GradientTag(a.microbatch, chunk, num_chunks));
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

StageTransport::StageTransport(parallel::Communicator* pp,
                               const std::vector<ChunkId>& virtual_stages,
                               const std::vector<Action>& actions, std::vector<int64_t> shape,
                               at::TensorOptions options, size_t depth,
                               std::vector<bool> receive_gradients, int64_t carried_channels)
    : pp_(pp), stage_(pp->rank()), num_chunks_(static_cast<int>(receive_gradients.size())) {
  neighbours_.resize(num_chunks_);
  const int last = static_cast<int>(virtual_stages.size()) - 1;
  for (int k = 0; k <= last; ++k) {
    if (virtual_stages[k].stage != stage_) continue;
    const int c = virtual_stages[k].chunk;
    TORCH_CHECK(c >= 0 && c < num_chunks_, "virtual stage ", k, " is chunk ", c,
                " of a stage with ", num_chunks_);
    Neighbours& n = neighbours_[c];
    if (k > 0) {
      n.prev_rank = virtual_stages[k - 1].stage;
      n.prev_chunk = virtual_stages[k - 1].chunk;
    }
    if (k < last) {
      n.next_rank = virtual_stages[k + 1].stage;
      n.next_chunk = virtual_stages[k + 1].chunk;
    }
  }
  local_activations_.resize(num_chunks_);
  local_gradients_.resize(num_chunks_);
  // NOTE [pre-posted receives]: activations, then gradients (the order of before with one
  // chunk); a queue only for a neighbour on another rank.
  for (int c = 0; c < num_chunks_; ++c) {
    const Neighbours& n = neighbours_[c];
    const bool remote = n.prev_rank >= 0 && n.prev_rank != stage_;
    activations_.push_back(std::make_unique<ReceiveQueue>(
        pp, n.prev_rank, remote ? ActivationTags(actions, c, num_chunks_) : std::vector<int>{},
        WithCarried(shape, carried_channels), options, depth));
  }
  for (int c = 0; c < num_chunks_; ++c) {
    const Neighbours& n = neighbours_[c];
    const bool remote = n.next_rank >= 0 && n.next_rank != stage_ && receive_gradients[c];
    gradients_.push_back(std::make_unique<ReceiveQueue>(
        pp, n.next_rank, remote ? GradientTags(actions, c, num_chunks_) : std::vector<int>{},
        shape, options, depth));
  }
}

absl::StatusOr<at::Tensor> StageTransport::TakeLocal(std::map<int, at::Tensor>& local, int mb,
                                                     int chunk, const char* what) {
  auto it = local.find(mb);
  if (it == local.end()) {
    return absl::InternalError(absl::StrCat("stage ", stage_, ": chunk ", chunk, " needs the ",
                                            what, " of micro-batch ", mb, " from its own stage, ",
                                            "which has not produced it yet"));
  }
  at::Tensor t = std::move(it->second);
  local.erase(it);
  return t;
}

absl::StatusOr<at::Tensor> StageTransport::TakeActivation(int mb, int chunk, double* wait_ms) {
  if (neighbours_[chunk].prev_rank == stage_) {
    return TakeLocal(local_activations_[chunk], mb, chunk, "activation");
  }
  return activations_[chunk]->Take(ActivationTag(mb, chunk, num_chunks_), wait_ms);
}

absl::StatusOr<at::Tensor> StageTransport::TakeGradient(int mb, int chunk, double* wait_ms) {
  if (neighbours_[chunk].next_rank == stage_) {
    return TakeLocal(local_gradients_[chunk], mb, chunk, "output gradient");
  }
  return gradients_[chunk]->Take(GradientTag(mb, chunk, num_chunks_), wait_ms);
}

void StageTransport::SendActivation(const at::Tensor& t, int mb, int chunk) {
  const Neighbours& n = neighbours_[chunk];
  if (n.next_rank == stage_) {  // NOTE [chunk transport]: handed over, as received
    local_activations_[n.next_chunk][mb] = t.detach();
    return;
  }
  Send(t, n.next_rank, ActivationTag(mb, n.next_chunk, num_chunks_));
}

void StageTransport::SendGradient(const at::Tensor& t, int mb, int chunk) {
  const Neighbours& n = neighbours_[chunk];
  if (n.prev_rank == stage_) {
    local_gradients_[n.prev_chunk][mb] = t.detach();
    return;
  }
  Send(t, n.prev_rank, GradientTag(mb, n.prev_chunk, num_chunks_));
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
