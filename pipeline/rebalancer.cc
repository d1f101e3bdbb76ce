#include "pipeline/rebalancer.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace fulcrum::pipeline {

absl::StatusOr<std::unique_ptr<ScriptedRebalancer>> ScriptedRebalancer::Parse(
    const std::string& script) {
  auto bad = [&](absl::string_view part, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--rebalance_script: '", std::string(part),
                                                   "' ", why, " (expected ITER:LAYER->STAGE,...;...)"));
  };
  std::unique_ptr<ScriptedRebalancer> out(new ScriptedRebalancer());
  for (absl::string_view step : absl::StrSplit(script, ';', absl::SkipWhitespace())) {
    std::vector<absl::string_view> parts = absl::StrSplit(step, absl::MaxSplits(':', 1));
    int64_t iteration = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &iteration) || iteration < 1) {
      return bad(step, "has no iteration ≥ 1 before ':'");
    }
    for (absl::string_view move : absl::StrSplit(parts[1], ',', absl::SkipWhitespace())) {
      std::vector<absl::string_view> ends = absl::StrSplit(move, "->");
      LayerMove m;
      if (ends.size() != 2 || !absl::SimpleAtoi(ends[0], &m.layer) ||
          !absl::SimpleAtoi(ends[1], &m.to_stage) || m.layer < 0 || m.to_stage < 0) {
        return bad(move, "is not LAYER->STAGE");
      }
      out->moves_[iteration].push_back(m);
    }
  }
  return out;
}

std::vector<LayerMove> ScriptedRebalancer::Plan(int64_t iteration, const std::vector<StageLoad>&) {
  auto it = moves_.find(iteration);
  return it == moves_.end() ? std::vector<LayerMove>{} : it->second;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> ApplyMoves(
    std::vector<std::pair<int64_t, int64_t>> ranges, const std::vector<LayerMove>& moves) {
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

}  // namespace fulcrum::pipeline
