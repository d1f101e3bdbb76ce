#include "moe/assignment_cache.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "core/unit.h"

namespace fulcrum::moe {
namespace {

constexpr int64_t kHalf = int64_t{1} << 24;  // fp32 holds every integer below 2^24 exactly

// Integers [n] (int64, below 2^48) as exact fp32 halves [n, 2] (high, low), and back: the
// step state travels as fp32 in a migration.
at::Tensor ToHalves(const at::Tensor& values) {
  return at::stack({at::floor_divide(values, kHalf), at::remainder(values, kHalf)}, 1).to(at::kFloat);
}

at::Tensor FromHalves(const at::Tensor& halves) {
  at::Tensor h = halves.to(at::kLong);
  return h.select(1, 0) * kHalf + h.select(1, 1);
}

// Records [n, 1 + k] of (position, experts...) as fp32 [n, 2 + k] and back.
at::Tensor EncodeRecords(const at::Tensor& records) {
  return at::cat({ToHalves(records.select(1, 0)), records.narrow(1, 1, records.size(1) - 1).to(at::kFloat)},
                 1);
}

at::Tensor DecodeRecords(const at::Tensor& encoded) {
  return at::cat({FromHalves(encoded.narrow(1, 0, 2)).unsqueeze(1),
                  encoded.narrow(1, 2, encoded.size(1) - 2).to(at::kLong)},
                 1);
}

}  // namespace

AssignmentCache::AssignmentCache(int64_t positions, int64_t k, double threshold)
    : positions_(positions),
      k_(k),
      threshold_(threshold),
      table_(at::full({positions, k}, -1.0, at::kFloat)),
      state_(at::zeros({kSlots}, at::kFloat)) {
  TORCH_CHECK(positions > 0 && k > 0 && threshold > 0 && threshold <= 1,
              "assignment cache: ", positions, " positions, k=", k, ", threshold ", threshold);
  state_[kLastFraction] = -1.0;
}

void AssignmentCache::Register(Unit& unit, const std::string& prefix) {
  table_ = unit.AddBuffer(prefix + "assignment_cache", table_);
  state_ = unit.AddBuffer(prefix + "assignment_cache_state", state_);
}

int64_t AssignmentCache::Count(Slot high) const {
  const float* s = state_.data_ptr<float>();
  return static_cast<int64_t>(s[high]) * kHalf + static_cast<int64_t>(s[high + 1]);
}

void AssignmentCache::SetCount(Slot high, int64_t value) {
  TORCH_CHECK(value >= 0 && value < kHalf * kHalf, "assignment cache count ", value, " out of range");
  float* s = state_.data_ptr<float>();
  s[high] = static_cast<float>(value / kHalf);
  s[high + 1] = static_cast<float>(value % kHalf);
}

bool AssignmentCache::active() const { return state_.data_ptr<float>()[kActive] > 0.5f; }

double AssignmentCache::last_epoch_change_fraction() const {
  return state_.data_ptr<float>()[kLastFraction];
}

void AssignmentCache::BeginForward(int64_t epoch) {
  float* s = state_.data_ptr<float>();
  if (static_cast<int64_t>(s[kEpoch]) == epoch) return;
  TORCH_CHECK(epoch < kHalf, "assignment cache: epoch ", epoch, " out of range");
  // Epoch 0 meets tokens again only in a step that runs into epoch 1 (a step counts in the
  // epoch of its first sample): too few to judge, so epoch 1 never routes by the cache.
  const int64_t met = Count(kMetHigh);
  if (met > 0 && s[kEpoch] >= 1.0f) {
    const double fraction = static_cast<double>(Count(kChangedHigh)) / static_cast<double>(met);
    s[kLastFraction] = static_cast<float>(fraction);
    s[kActive] = fraction < threshold_ ? 1.0f : 0.0f;
  } else {
    s[kActive] = 0.0f;  // nothing met again: nothing to trust yet
  }
  SetCount(kChangedHigh, 0);
  SetCount(kMetHigh, 0);
  s[kEpoch] = static_cast<float>(epoch);
}

at::Tensor AssignmentCache::Lookup(const at::Tensor& positions) const {
  at::Tensor p = positions.to(at::kCPU, at::kLong).reshape({-1});
  TORCH_CHECK(p.numel() == 0 || (p.min().item<int64_t>() >= 0 && p.max().item<int64_t>() < positions_),
              "assignment cache: token positions outside [0, ", positions_,
              ") — the cache is sized for the training split");
  return table_.index_select(0, p).to(at::kLong);
}

void AssignmentCache::Record(const at::Tensor& positions, const at::Tensor& cached,
                             const at::Tensor& choice, bool routed_by_cache) {
  TORCH_CHECK(choice.defined() && choice.dim() == 2 && choice.size(1) == k_,
              "assignment cache: the router gave no per-token choice of k=", k_, " experts");
  at::Tensor own = choice.to(at::kCPU, at::kLong);
  at::Tensor p = positions.to(at::kCPU, at::kLong).reshape({-1, 1});
  at::Tensor met = cached.select(1, 0).ge(0);
  at::Tensor same = std::get<0>(own.sort(1)).eq(std::get<0>(cached.sort(1))).all(1);
  const int64_t met_count = met.sum().item<int64_t>();
  step_met_ += met_count;
  step_changed_ += (met & same.logical_not()).sum().item<int64_t>();
  if (routed_by_cache) step_cached_ += met_count;
  records_.push_back(at::cat({p, own}, 1));
}

void AssignmentCache::AfterOptimizerStep(parallel::Communicator* data,
                                         const std::vector<int64_t>& global_counts) {
  at::Tensor records = StepRecords();
  if (data != nullptr && data->size() > 1) {
    // Replicas may hold different numbers of records (a layer that moved mid-step brought
    // its own): pad to the largest with position −1.
    at::Tensor rows = at::tensor({records.size(0)}, at::kLong);
    at::Tensor all_rows = data->AllGather(rows);
    const int64_t most = all_rows.max().item<int64_t>();
    at::Tensor padded = at::full({most, 1 + k_}, -1, at::kLong);
    padded.narrow(0, 0, records.size(0)).copy_(records);
    records = data->AllGather(padded);
  }
  // Rank order, then micro-batch order; a token met twice in one step keeps its last choice.
  records = records.contiguous();
  const int64_t* r = records.data_ptr<int64_t>();
  float* table = table_.data_ptr<float>();
  for (int64_t i = 0; i < records.size(0); ++i, r += 1 + k_) {
    if (r[0] < 0) continue;
    TORCH_CHECK(r[0] < positions_, "assignment cache: record for position ", r[0], " of ",
                positions_);
    for (int64_t j = 0; j < k_; ++j) table[r[0] * k_ + j] = static_cast<float>(r[1 + j]);
  }
  TORCH_CHECK(global_counts.size() == 3, "assignment cache: expected 3 step counts");
  SetCount(kChangedHigh, Count(kChangedHigh) + global_counts[0]);
  SetCount(kMetHigh, Count(kMetHigh) + global_counts[1]);
  records_.clear();
  step_changed_ = step_met_ = step_cached_ = 0;
}

at::Tensor AssignmentCache::StepRecords() const {
  return records_.empty() ? at::zeros({0, 1 + k_}, at::kLong) : at::cat(records_, 0);
}

std::vector<std::pair<std::string, at::Tensor>> AssignmentCache::StepState() const {
  at::Tensor records = StepRecords();
  at::Tensor counts = at::tensor({step_changed_, step_met_, step_cached_}, at::kLong);
  return {{"cache_records", EncodeRecords(records)}, {"cache_counts", ToHalves(counts)}};
}

void AssignmentCache::LoadStepState(const std::vector<std::pair<std::string, at::Tensor>>& state) {
  for (const auto& [name, tensor] : state) {
    if (name == "cache_records") {
      TORCH_CHECK(tensor.dim() == 2 && tensor.size(1) == 2 + k_, "assignment cache records of shape ",
                  tensor.sizes(), ", expected [n, ", 2 + k_, "]");
      records_.assign(1, DecodeRecords(tensor));
    } else if (name == "cache_counts") {
      at::Tensor counts = FromHalves(tensor.reshape({3, 2}));
      step_changed_ = counts[0].item<int64_t>();
      step_met_ = counts[1].item<int64_t>();
      step_cached_ = counts[2].item<int64_t>();
    }
  }
}

}  // namespace fulcrum::moe
