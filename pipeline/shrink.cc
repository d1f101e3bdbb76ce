#include "pipeline/shrink.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace fulcrum::pipeline {
namespace {

// Tags of the three messages of one transfer; transfers run one at a time, so one set.
constexpr int kShrinkHeaderTag = 7 << 20;
constexpr int kShrinkNamesTag = kShrinkHeaderTag + 1;
constexpr int kShrinkPayloadTag = kShrinkHeaderTag + 2;

int OwnerStage(const LayerRanges& ranges, int64_t layer) {
  for (size_t s = 0; s < ranges.size(); ++s) {
    if (layer >= ranges[s].first && layer < ranges[s].second) return static_cast<int>(s);
  }
  return -1;
}

const Unit* FindUnit(const GptModel& model, const std::string& name) {
  for (const Unit* unit : model.Units()) {
    if (unit->name() == name) return unit;
  }
  return nullptr;
}

// "name|dtype|d0,d1,..." per tensor and the bytes of every tensor, concatenated.
void Send(parallel::Communicator& world, int dst, const NamedTensors& tensors) {
  std::string names;
  std::vector<at::Tensor> bytes;
  for (const auto& [name, tensor] : tensors) {
    // On the host, as a migration's payload (NOTE [migration payload on the host] in
    // migration.cc): the receiver's buffer is a host one, and the pieces may live apart.
    const at::Tensor flat = tensor.detach().to(at::kCPU).contiguous().reshape({-1});
    absl::StrAppend(&names, name, "|", static_cast<int>(flat.scalar_type()), "|",
                    absl::StrJoin(tensor.sizes(), ","), "\n");
    if (flat.numel() > 0) bytes.push_back(flat.view(at::kByte));
  }
  at::Tensor payload = bytes.empty() ? at::empty({0}, at::kByte) : at::cat(bytes);
  at::Tensor header =
      at::tensor({static_cast<int64_t>(names.size()), payload.numel()}, at::kLong);
  at::Tensor blob = at::empty({static_cast<int64_t>(names.size())}, at::kByte);
  if (!names.empty()) std::memcpy(blob.data_ptr<uint8_t>(), names.data(), names.size());
  world.Send(header, dst, kShrinkHeaderTag);
  if (blob.numel() > 0) world.Send(blob, dst, kShrinkNamesTag);
  if (payload.numel() > 0) world.Send(payload, dst, kShrinkPayloadTag);
}

absl::Status Receive(parallel::Communicator& world, int src,
                     std::map<std::string, at::Tensor>* out) {
  at::Tensor header = at::empty({2}, at::kLong);
  world.Recv(header, src, kShrinkHeaderTag);
  const int64_t names_bytes = header[0].item<int64_t>();
  const int64_t payload_bytes = header[1].item<int64_t>();
  at::Tensor blob = at::empty({names_bytes}, at::kByte);
  if (names_bytes > 0) world.Recv(blob, src, kShrinkNamesTag);
  at::Tensor payload = at::empty({payload_bytes}, at::kByte);
  if (payload_bytes > 0) world.Recv(payload, src, kShrinkPayloadTag);
  const std::string names(reinterpret_cast<const char*>(blob.data_ptr<uint8_t>()),
                          static_cast<size_t>(names_bytes));
  int64_t offset = 0;
  for (absl::string_view line : absl::StrSplit(names, '\n', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(line, '|');
    int dtype = 0;
    std::vector<int64_t> sizes;
    bool ok = parts.size() == 3 && absl::SimpleAtoi(parts[1], &dtype);
    for (absl::string_view d : absl::StrSplit(parts.size() == 3 ? parts[2] : "", ',',
                                              absl::SkipEmpty())) {
      int64_t size = 0;
      ok = ok && absl::SimpleAtoi(d, &size);
      sizes.push_back(size);
    }
    if (!ok) {
      return absl::DataLossError(absl::StrCat("shrink: bad tensor entry '", line, "' from rank ", src));
    }
    const auto scalar_type = static_cast<at::ScalarType>(dtype);
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const int64_t size_bytes = numel * static_cast<int64_t>(c10::elementSize(scalar_type));
    if (offset + size_bytes > payload_bytes) {
      return absl::DataLossError(absl::StrCat("shrink: tensor ", parts[0], " from rank ", src,
                                              " runs past the payload"));
    }
    at::Tensor tensor = at::empty(sizes, at::TensorOptions().dtype(scalar_type));
    if (size_bytes > 0) {
      std::memcpy(tensor.data_ptr(), payload.data_ptr<uint8_t>() + offset,
                  static_cast<size_t>(size_bytes));
    }
    offset += size_bytes;
    (*out)[std::string(parts[0])] = tensor;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateShrinkPlan(const ShrinkPlan& plan) {
  const parallel::ParallelConfig& c = plan.old_config;
  FULCRUM_RETURN_IF_ERROR(c.Validate());
  for (const auto& [owner, ranges, what] :
       {std::tuple{&plan.old_owner, &plan.old_ranges, "old"},
        std::tuple{&plan.new_owner, &plan.new_ranges, "new"}}) {
    if (!owner->empty() && owner->size() != ranges->size()) {
      return absl::InvalidArgumentError(absl::StrCat("shrink: ", owner->size(), " ", what,
                                                     " owners for ", ranges->size(), " ranges"));
    }
    for (int stage : *owner) {
      if (stage < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("shrink: ", what, " owner ", stage, " is no stage"));
      }
    }
  }
  if (plan.old_stages() != c.pp) {
    return absl::InvalidArgumentError(absl::StrCat("shrink: ", plan.old_stages(),
                                                   " old stages for pp=", c.pp));
  }
  if (plan.new_stages() < 1 || plan.new_stages() >= plan.old_stages()) {
    return absl::InvalidArgumentError(absl::StrCat("shrink: ", plan.old_stages(), " → ",
                                                   plan.new_stages(), " stages is no shrink"));
  }
  if (plan.old_ranges.empty() || plan.new_ranges.empty()) {
    return absl::InvalidArgumentError("shrink: an empty placement");
  }
  const int64_t layers = plan.old_ranges.back().second;
  FULCRUM_RETURN_IF_ERROR(
      ValidateRanges(plan.old_ranges, layers, static_cast<int>(plan.old_ranges.size())));
  FULCRUM_RETURN_IF_ERROR(
      ValidateRanges(plan.new_ranges, layers, static_cast<int>(plan.new_ranges.size())));
  for (const auto& [begin, end] : plan.new_ranges) {
    if (OwnerStage(plan.old_ranges, begin) < 0 ||
        plan.old_ranges[OwnerStage(plan.old_ranges, begin)].first != begin) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shrink: ", FormatRanges(plan.new_ranges), " is not a coarsening of ",
          FormatRanges(plan.old_ranges), " (stage boundaries may only disappear)"));
    }
  }
  // Each old stage gives its ranges to one new stage (NOTE [re-packing under chunks]).
  std::vector<int> taken_by(plan.old_stages(), -1);
  for (int k = 0; k < static_cast<int>(plan.new_ranges.size()); ++k) {
    const int j = plan.NewStageOf(k);
    for (int o = OwnerStage(plan.old_ranges, plan.new_ranges[k].first);
         o < static_cast<int>(plan.old_ranges.size()) &&
         plan.old_ranges[o].second <= plan.new_ranges[k].second;
         ++o) {
      int& taker = taken_by[plan.OldStageOf(o)];
      if (taker >= 0 && taker != j) {
        return absl::InvalidArgumentError(absl::StrCat(
            "shrink: old stage ", plan.OldStageOf(o), "'s ranges go to new stages ", taker,
            " and ", j, "; a stage merges whole"));
      }
      taker = j;
    }
  }
  const std::vector<int> survivors = SurvivingStages(plan);
  for (size_t j = 0; j < survivors.size(); ++j) {
    if (survivors[j] < 0 || (j == 0 && survivors[j] != 0) || (j > 0 && survivors[j] <= survivors[j - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shrink: the new stages' first old stages are ", absl::StrJoin(survivors, ","),
          "; they must rise from 0 (groups of consecutive stages)"));
    }
  }
  return absl::OkStatus();
}

std::vector<int> SurvivingStages(const ShrinkPlan& plan) {
  std::vector<int> out(plan.new_stages(), -1);
  for (int k = 0; k < static_cast<int>(plan.new_ranges.size()); ++k) {
    const int j = plan.NewStageOf(k);
    for (int o = OwnerStage(plan.old_ranges, plan.new_ranges[k].first);
         o >= 0 && o < static_cast<int>(plan.old_ranges.size()) &&
         plan.old_ranges[o].second <= plan.new_ranges[k].second;
         ++o) {
      const int stage = plan.OldStageOf(o);
      if (out[j] < 0 || stage < out[j]) out[j] = stage;
    }
  }
  return out;
}

parallel::ParallelConfig ShrunkConfig(const ShrinkPlan& plan) {
  parallel::ParallelConfig c = plan.old_config;
  c.world_size = c.world_size / c.pp * plan.new_stages();
  c.pp = plan.new_stages();
  return c;
}

std::vector<int> SurvivingRanks(const ShrinkPlan& plan) {
  const parallel::ParallelConfig& c = plan.old_config;
  std::vector<int> out;
  for (int stage : SurvivingStages(plan)) {
    for (int d = 0; d < c.dp(); ++d) {
      for (int t = 0; t < c.tp; ++t) out.push_back(c.Rank(t, d, stage));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

int NewRank(const ShrinkPlan& plan, int rank) {
  const std::vector<int> survivors = SurvivingRanks(plan);
  auto it = std::lower_bound(survivors.begin(), survivors.end(), rank);
  return it != survivors.end() && *it == rank ? static_cast<int>(it - survivors.begin()) : -1;
}

std::vector<ShrinkTransfer> ShrinkTransfers(const ShrinkPlan& plan) {
  const parallel::ParallelConfig& c = plan.old_config;
  const std::vector<int> survivors = SurvivingStages(plan);
  const int q = plan.new_stages();
  const int old_head = plan.OldStageOf(static_cast<int>(plan.old_ranges.size()) - 1);
  const int new_head = plan.NewStageOf(static_cast<int>(plan.new_ranges.size()) - 1);
  std::vector<ShrinkTransfer> out;
  for (int d = 0; d < c.dp(); ++d) {
    for (int t = 0; t < c.tp; ++t) {
      // Shards move between ranks of the same (t, d) only: NOTE [live shrink].
      for (int j = 0; j < q; ++j) {
        const int dst = c.Rank(t, d, survivors[j]);
        auto add = [&](int src_stage, std::string unit) {
          out.push_back({c.Rank(t, d, src_stage), dst, std::move(unit)});
        };
        // The embedding: on the first stage, and on the head's as the source of the tied
        // output weight's mirror when that is another stage (ZB-V's head is on stage 0).
        if (j == 0 || (j == new_head && plan.tie_embeddings)) add(0, "embedding");
        // Its layers in model order, chunk after chunk.
        for (int k = 0; k < static_cast<int>(plan.new_ranges.size()); ++k) {
          if (plan.NewStageOf(k) != j) continue;
          for (int64_t l = plan.new_ranges[k].first; l < plan.new_ranges[k].second; ++l) {
            add(plan.OldStageOf(OwnerStage(plan.old_ranges, l)), absl::StrCat("layers.", l));
          }
        }
        if (j == new_head) add(old_head, "head");
      }
    }
  }
  return out;
}

absl::Status ExchangeState(parallel::Communicator& world, const ShrinkPlan& plan,
                           const GptModel& old_model, GptModel* new_model) {
  FULCRUM_RETURN_IF_ERROR(ValidateShrinkPlan(plan));
  const int me = world.rank();
  std::map<std::string, at::Tensor> received;
  for (const ShrinkTransfer& t : ShrinkTransfers(plan)) {
    if (t.src != me && t.dst != me) continue;
    NamedTensors state;
    if (t.src == me) {
      const Unit* unit = FindUnit(old_model, t.unit);
      if (unit == nullptr) {
        return absl::InternalError(absl::StrCat("shrink: rank ", me, " should hold ", t.unit,
                                                " but does not"));
      }
      // What a layer migration moves (shards as they are, NOTE [live shrink]); gradients
      // are undefined between iterations, so none travel.
      state = unit->MigrationTensors();
    }
    if (t.src == me && t.dst == me) {
      for (auto& [name, tensor] : state) received[name] = tensor.clone();
    } else if (t.src == me) {
      Send(world, t.dst, state);
    } else {
      FULCRUM_RETURN_IF_ERROR(Receive(world, t.src, &received));
    }
  }
  if (new_model == nullptr) return absl::OkStatus();
  for (Unit* unit : new_model->Units()) {
    // A mirror (the tied output weight on a last stage of its own) is not state of its
    // own: it takes its source's value and moments, which came with the embedding.
    for (const Parameter& p : unit->parameters()) {
      if (p.sharding.Saved()) continue;  // not a mirror (NOTE [parameter sharding])
      const std::string name = unit->GlobalName(p.name);
      if (auto value = received.find(p.sharding.mirror_of); value != received.end()) {
        received[name] = value->second;
      }
      // Every slot of the source's optimizer state.
      for (auto& [slot, tensor] : OptimizerSlotsIn(received, p.sharding.mirror_of)) {
        received[OptimizerStatePrefix(name) + slot] = tensor;
      }
    }
    if (absl::Status s = unit->LoadMigrationTensors(received); !s.ok()) {
      return absl::DataLossError(absl::StrCat("shrink: loading ", unit->name(), ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum::pipeline
