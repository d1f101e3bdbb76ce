#include "pipeline/rebalancer.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status.h"

namespace fulcrum::pipeline {
namespace {

// FNV-1a over 64-bit words: stable across platforms and runs (std::hash is neither).
uint64_t Mix(uint64_t hash, uint64_t word) {
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= (word >> (8 * byte)) & 0xff;
    hash *= 1099511628211ULL;
  }
  return hash;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ScriptedRebalancer>> ScriptedRebalancer::Parse(
    const std::string& script) {
  auto bad = [&](absl::string_view part, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rebalance_script: '", std::string(part), "' ", why,
                     " (expected ITER:LAYER->STAGE,... or ITER:N0,N1,... separated by ';')"));
  };
  std::unique_ptr<ScriptedRebalancer> out(new ScriptedRebalancer());
  for (absl::string_view step : absl::StrSplit(script, ';', absl::SkipWhitespace())) {
    std::vector<absl::string_view> parts = absl::StrSplit(step, absl::MaxSplits(':', 1));
    int64_t iteration = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &iteration) || iteration < 1) {
      return bad(step, "has no iteration ≥ 1 before ':'");
    }
    if (out->steps_.count(iteration) > 0) return bad(step, "repeats its iteration");
    Step& parsed = out->steps_[iteration];
    const bool moves = absl::StrContains(parts[1], "->");
    for (absl::string_view item : absl::StrSplit(parts[1], ',', absl::SkipWhitespace())) {
      item = absl::StripAsciiWhitespace(item);
      if (moves) {
        std::vector<absl::string_view> ends = absl::StrSplit(item, "->");
        LayerMove m;
        if (ends.size() != 2 || !absl::SimpleAtoi(ends[0], &m.layer) ||
            !absl::SimpleAtoi(ends[1], &m.to_stage) || m.layer < 0 || m.to_stage < 0) {
          return bad(item, "is not LAYER->STAGE");
        }
        parsed.moves.push_back(m);
      } else {
        int64_t size = 0;
        if (!absl::SimpleAtoi(item, &size) || size < 1) {
          return bad(item, "is not a layer count ≥ 1 (every stage keeps a layer)");
        }
        parsed.sizes.push_back(size);
      }
    }
    if (parsed.moves.empty() && parsed.sizes.empty()) return bad(step, "says nothing");
  }
  return out;
}

namespace {

// The placement a script step leads to from `current`.
absl::StatusOr<LayerRanges> ApplyStep(const ScriptedRebalancer::Step& step,
                                      const LayerRanges& current) {
  if (!step.moves.empty()) return ApplyMoves(current, step.moves);
  const int64_t layers = current.empty() ? 0 : current.back().second;
  if (step.sizes.size() != current.size()) {
    return absl::FailedPreconditionError(absl::StrCat("gives ", step.sizes.size(),
                                                      " layer counts for ", current.size(),
                                                      " stages"));
  }
  LayerRanges target;
  int64_t begin = 0;
  for (int64_t size : step.sizes) {
    if (size > layers - begin) {  // Sizes are ≥ 1; their sum could overflow 64 bits.
      return absl::FailedPreconditionError(
          absl::StrCat("places more than the model's ", layers, " layers"));
    }
    target.emplace_back(begin, begin + size);
    begin += size;
  }
  if (begin != layers) {
    return absl::FailedPreconditionError(
        absl::StrCat("places ", begin, " layers; the model has ", layers));
  }
  return target;
}

}  // namespace

RebalanceDecision ScriptedRebalancer::Plan(int64_t iteration, const std::vector<StageLoad>& loads) {
  RebalanceDecision decision;
  auto it = steps_.find(iteration);
  if (it == steps_.end()) return decision;
  const LayerRanges current = CurrentRanges(loads);
  // Placements() played the script through before any work; the runner validates again.
  absl::StatusOr<LayerRanges> target = ApplyStep(it->second, current);
  if (target.ok() && *target != current) {
    decision.target = *target;
    decision.note = "scripted (--rebalance_script)";
  }
  return decision;
}

absl::StatusOr<std::map<int64_t, LayerRanges>> ScriptedRebalancer::Placements(
    const LayerRanges& initial) const {
  std::map<int64_t, LayerRanges> out;
  LayerRanges ranges = initial;
  for (const auto& [iteration, step] : steps_) {
    absl::StatusOr<LayerRanges> next = ApplyStep(step, ranges);
    if (!next.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--rebalance_script at iteration ", iteration, ": ", next.status().message()));
    }
    ranges = *next;
    out[iteration] = ranges;
  }
  return out;
}

absl::StatusOr<LayerRanges> ApplyMoves(LayerRanges ranges, const std::vector<LayerMove>& moves) {
  const int stages = static_cast<int>(ranges.size());
  for (const LayerMove& m : moves) {
    int from = -1;
    for (int s = 0; s < stages; ++s) {
      if (ranges[s].first <= m.layer && m.layer < ranges[s].second) from = s;
    }
    auto refuse = [&](const std::string& why) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot move layer ", m.layer, " to stage ", m.to_stage, ": ", why));
    };
    if (from < 0) return refuse("no stage holds it");
    if (m.to_stage < 0 || m.to_stage >= stages) return refuse("no such stage");
    if (m.to_stage == from + 1 && m.layer == ranges[from].second - 1) {
      --ranges[from].second;
      --ranges[m.to_stage].first;
    } else if (m.to_stage == from - 1 && m.layer == ranges[from].first) {
      ++ranges[from].first;
      ++ranges[m.to_stage].second;
    } else {
      return refuse(absl::StrCat("stage ", from, " holds [", ranges[from].first, ", ",
                                 ranges[from].second,
                                 "); only its first layer moves to the previous stage and its "
                                 "last to the next"));
    }
    if (ranges[from].first == ranges[from].second) return refuse("its stage would be empty");
  }
  return ranges;
}

absl::Status ValidateRanges(const LayerRanges& ranges, int64_t num_layers, int num_stages) {
  if (static_cast<int>(ranges.size()) != num_stages) {
    return absl::InvalidArgumentError(absl::StrCat("a placement of ", ranges.size(),
                                                   " ranges for ", num_stages, " stages"));
  }
  int64_t next = 0;
  for (int s = 0; s < num_stages; ++s) {
    const auto& [begin, end] = ranges[s];
    if (begin != next || end <= begin) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, " would hold [", begin, ", ", end, ") in ",
                       FormatRanges(ranges), ": stages hold contiguous, non-empty ranges in order"));
    }
    next = end;
  }
  if (next != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(FormatRanges(ranges), " places ", next,
                                                   " layers; the model has ", num_layers));
  }
  return absl::OkStatus();
}

std::string FormatRanges(const LayerRanges& ranges) {
  return absl::StrJoin(ranges, " ", [](std::string* out, const std::pair<int64_t, int64_t>& r) {
    absl::StrAppend(out, "[", r.first, ",", r.second, ")");
  });
}

std::vector<PlannedMove> MovesBetween(const LayerRanges& from, const LayerRanges& to,
                                      const std::vector<int>& stage_rank) {
  std::vector<PlannedMove> moves;
  auto owner = [](const LayerRanges& ranges, int64_t layer) {
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
      if (ranges[s].first <= layer && layer < ranges[s].second) return s;
    }
    return -1;
  };
  const int64_t layers = from.empty() ? 0 : from.back().second;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int a = owner(from, layer);
    const int b = owner(to, layer);
    if (a == b) continue;
    auto rank = [&](int stage) {
      return stage >= 0 && stage < static_cast<int>(stage_rank.size()) ? stage_rank[stage] : stage;
    };
    moves.push_back(PlannedMove{layer, a, b, rank(a), rank(b)});
  }
  return moves;
}

LayerRanges HeldRanges(const StageLoad& load) {
  if (!load.chunk_ranges.empty()) return load.chunk_ranges;
  return {{load.layer_begin, load.layer_end}};
}

int64_t NumLayersHeld(const std::vector<StageLoad>& loads) {
  int64_t layers = 0;
  for (const StageLoad& load : loads) {
    for (const auto& [begin, end] : HeldRanges(load)) layers = std::max(layers, end);
  }
  return layers;
}

LayerRanges CurrentRanges(const std::vector<StageLoad>& loads) {
  LayerRanges ranges;
  bool chunks = false;
  for (const StageLoad& load : loads) chunks = chunks || !load.chunk_ranges.empty();
  if (!chunks) {
    for (const StageLoad& load : loads) ranges.emplace_back(load.layer_begin, load.layer_end);
    return ranges;
  }
  for (const StageLoad& load : loads) {
    for (const auto& range : load.chunk_ranges) ranges.push_back(range);
  }
  std::stable_sort(ranges.begin(), ranges.end());
  return ranges;
}

std::vector<int> ChunkRanks(const std::vector<StageLoad>& loads) {
  std::vector<std::pair<std::pair<int64_t, int64_t>, int>> owned;
  for (const StageLoad& load : loads) {
    for (const auto& range : load.chunk_ranges) owned.push_back({range, load.stage});
  }
  if (owned.empty()) return {};
  std::stable_sort(owned.begin(), owned.end());
  std::vector<int> ranks;
  for (const auto& [range, rank] : owned) ranks.push_back(rank);
  return ranks;
}

uint64_t PlanHash(int64_t iteration, const LayerRanges& ranges) {
  uint64_t hash = 14695981039346656037ULL;
  hash = Mix(hash, static_cast<uint64_t>(iteration));
  hash = Mix(hash, ranges.size());
  for (const auto& [begin, end] : ranges) {
    hash = Mix(hash, static_cast<uint64_t>(begin));
    hash = Mix(hash, static_cast<uint64_t>(end));
  }
  return hash;
}

}  // namespace fulcrum::pipeline
