// Reading fulcrum_plot's inputs; see plot_input.h.
#include "tools/internal/plot_input.h"

#include <algorithm>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fulcrum::plot {
namespace {

using nlohmann::json;
using Ranges = std::vector<std::pair<int64_t, int64_t>>;

absl::Status Bad(const std::string& why) { return absl::InvalidArgumentError(why); }

// `j[key]` as a number: nullopt when absent, null (how the writer spells NaN and inf) or
// non-finite; InvalidArgument for any other type.
absl::StatusOr<std::optional<double>> Number(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return Bad(absl::StrCat("'", key, "' is ", it->dump(), "; expected a number"));
  const double value = it->get<double>();
  if (!std::isfinite(value)) return std::optional<double>();
  return std::optional<double>(value);
}

// `j[key]` as a finite time >= 0 (`fallback` when absent).
absl::StatusOr<double> Time(const json& j, const char* key, double fallback = 0) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0) {
    return Bad(absl::StrCat("'", key, "' is ", it->dump(), "; expected a finite value >= 0"));
  }
  return it->get<double>();
}

// `j[key]`: [[begin, end], ...], contiguous from layer 0, each non-empty.
absl::StatusOr<Ranges> StageRanges(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array() || it->empty()) {
    return Bad(absl::StrCat("'", key, "' is missing or not a non-empty array of [begin, end]"));
  }
  Ranges out;
  for (const json& pair : *it) {
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() ||
        !pair[1].is_number_integer()) {
      return Bad(absl::StrCat("'", key, "' holds ", pair.dump(), "; expected [begin, end] layers"));
    }
    const int64_t begin = pair[0].get<int64_t>(), end = pair[1].get<int64_t>();
    const int64_t expected = out.empty() ? 0 : out.back().second;
    if (begin != expected || end <= begin) {
      return Bad(absl::StrCat("'", key, "' holds ", pair.dump(), "; expected [", expected,
                              ", end > ", expected, "] (contiguous ranges from layer 0)"));
    }
    out.emplace_back(begin, end);
  }
  return out;
}

// `j[key]`: per-stage times, each finite >= 0 (empty when absent).
absl::StatusOr<std::vector<double>> StageTimes(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return std::vector<double>();
  if (!it->is_array()) return Bad(absl::StrCat("'", key, "' is not an array"));
  std::vector<double> out;
  for (const json& v : *it) {
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
      return Bad(absl::StrCat("'", key, "' holds ", v.dump(), "; expected times >= 0"));
    }
    out.push_back(v.get<double>());
  }
  return out;
}

// `j["stage_range_ranks"]` (virtual pipeline stages): the rank holding each of `ranges`, as
// many as there are ranges, each in [0, ranges). Empty when absent (one range per rank).
absl::StatusOr<std::vector<int>> RangeRanks(const json& j, const Ranges& ranges) {
  const auto it = j.find("stage_range_ranks");
  if (it == j.end()) return std::vector<int>();
  if (!it->is_array() || it->size() != ranges.size()) {
    return Bad(absl::StrCat("'stage_range_ranks' is ", it->dump(), "; expected one rank per range (",
                            ranges.size(), ")"));
  }
  std::vector<int> out;
  for (const json& rank : *it) {
    if (!rank.is_number_integer() || rank.get<int64_t>() < 0 ||
        rank.get<int64_t>() >= static_cast<int64_t>(ranges.size())) {
      return Bad(absl::StrCat("'stage_range_ranks' holds ", rank.dump(), "; expected a rank in [0, ",
                              ranges.size(), ")"));
    }
    out.push_back(rank.get<int>());
  }
  return out;
}

absl::StatusOr<double> Bubble(const json& j) {
  const auto it = j.find("bubble_ratio");
  if (it == j.end()) return 0.0;
  if (!it->is_number() || !(it->get<double>() >= 0 && it->get<double>() <= 1)) {
    return Bad(absl::StrCat("'bubble_ratio' is ", it->dump(), "; expected a number in [0, 1]"));
  }
  return it->get<double>();
}

absl::StatusOr<int64_t> LayersMoved(const json& j) {
  const auto it = j.find("layers_moved");
  if (it == j.end()) return int64_t{0};
  if (!it->is_number_integer() || it->get<int64_t>() < 0) {
    return Bad(absl::StrCat("'layers_moved' is ", it->dump(), "; expected an integer >= 0"));
  }
  return it->get<int64_t>();
}

// A --load_trace line's point.
absl::StatusOr<StagePoint> TracePoint(const json& j) {
  StagePoint p;
  absl::StatusOr<Ranges> ran_on = StageRanges(j, "ran_on");
  if (!ran_on.ok()) return ran_on.status();
  p.ranges = *std::move(ran_on);
  if (j.contains("decision")) {
    absl::StatusOr<Ranges> decision = StageRanges(j, "decision");
    if (!decision.ok()) return decision.status();
    p.decision = *decision != p.ranges;
  }
  const json& loads = j.at("loads");
  if (!loads.is_array()) return Bad("'loads' is not an array");
  for (const json& load : loads) {
    if (!load.is_object()) return Bad(absl::StrCat("'loads' holds ", load.dump(), "; expected objects"));
    double sum = 0;
    for (const char* key : {"forward_ms", "backward_ms", "weight_ms"}) {
      absl::StatusOr<double> ms = Time(load, key);
      if (!ms.ok()) return Bad(absl::StrCat("a stage load's ", ms.status().message()));
      sum += *ms;
    }
    p.stage_ms.push_back(sum);
  }
  if (j.contains("measured")) {
    if (!j.at("measured").is_object()) return Bad("'measured' is not an object");
    absl::StatusOr<double> bubble = Bubble(j.at("measured"));
    if (!bubble.ok()) return bubble.status();
    p.bubble = *bubble;
  }
  return p;
}

// The stage point of a metrics or fulcrum_sim line (stage_ranges, stage_ms, bubble_ratio).
absl::StatusOr<StagePoint> RangesPoint(const json& j) {
  StagePoint p;
  absl::StatusOr<Ranges> ranges = StageRanges(j, "stage_ranges");
  if (!ranges.ok()) return ranges.status();
  p.ranges = *std::move(ranges);
  absl::StatusOr<std::vector<int>> ranks = RangeRanks(j, p.ranges);
  if (!ranks.ok()) return ranks.status();
  p.ranks = *std::move(ranks);
  absl::StatusOr<std::vector<double>> ms = StageTimes(j, "stage_ms");
  if (!ms.ok()) return ms.status();
  p.stage_ms = *std::move(ms);
  absl::StatusOr<double> bubble = Bubble(j);
  if (!bubble.ok()) return bubble.status();
  p.bubble = *bubble;
  return p;
}

// Iterations are x coordinates: doubles, exact up to 2^53 (and their differences stay far
// from overflowing int64).
constexpr int64_t kMaxIteration = int64_t{1} << 53;

constexpr const char* kTrainingKeys[] = {"loss", "valid_loss", "lr", "grad_norm",
                                         "tokens_per_second"};

absl::StatusOr<TrainingPoint> Training(const json& j) {
  TrainingPoint p;
  std::optional<double>* fields[] = {&p.loss, &p.valid_loss, &p.lr, &p.grad_norm,
                                     &p.tokens_per_second};
  for (size_t k = 0; k < std::size(kTrainingKeys); ++k) {
    absl::StatusOr<std::optional<double>> v = Number(j, kTrainingKeys[k]);
    if (!v.ok()) return v.status();
    *fields[k] = *v;
  }
  return p;
}

// Sorts `points` by iteration; of equal iterations the last (a resumed run's) stays.
template <typename Point>
void InIterationOrder(std::vector<Point>* points) {
  std::stable_sort(points->begin(), points->end(),
                   [](const Point& a, const Point& b) { return a.iteration < b.iteration; });
  std::vector<Point> kept;
  for (Point& p : *points) {
    if (!kept.empty() && kept.back().iteration == p.iteration) {
      kept.back() = std::move(p);
    } else {
      kept.push_back(std::move(p));
    }
  }
  *points = std::move(kept);
}

}  // namespace

absl::StatusOr<std::vector<Series>> ParsePlotInput(std::string_view text_view,
                                                   std::string_view name_view) {
  // This abseil's string_view is its own type, not std::string_view.
  const absl::string_view text(text_view.data(), text_view.size());
  const std::string name(name_view);
  std::vector<Series> out;
  std::map<std::string, size_t> by_name;
  std::map<std::string, int64_t> moved_before;  // Per series: metrics' cumulative moves.
  auto series = [&](const std::string& series_name) -> Series& {
    auto it = by_name.find(series_name);
    if (it == by_name.end()) {
      it = by_name.emplace(series_name, out.size()).first;
      out.push_back({series_name, {}, {}});
    }
    return out[it->second];
  };
  int number = 0;
  for (absl::string_view row : absl::StrSplit(text, '\n')) {
    ++number;
    if (absl::StripAsciiWhitespace(row).empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(name, ":", number, ": ", why));
    };
    const json j = json::parse(row.begin(), row.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
    if (!j.contains("iteration") || !j.at("iteration").is_number_integer()) {
      return bad("no integer 'iteration' (a metrics, load-trace or fulcrum_sim line has one)");
    }
    const int64_t iteration = j.at("iteration").get<int64_t>();
    if (iteration < 0 || iteration > kMaxIteration) {
      return bad(absl::StrCat("iteration ", j.at("iteration").dump(), "; expected 0 to 2^53"));
    }
    if (j.contains("loads") && j.contains("ran_on")) {  // --load_trace
      absl::StatusOr<StagePoint> p = TracePoint(j);
      if (!p.ok()) return bad(p.status().message());
      p->iteration = iteration;
      series(name).stages.push_back(*std::move(p));
    } else if (j.contains("source") && j.at("source") == "fulcrum_sim") {
      const auto scenario = j.find("scenario"), strategy = j.find("strategy");
      if (scenario == j.end() || !scenario->is_string() || strategy == j.end() ||
          !strategy->is_string()) {
        return bad("a fulcrum_sim line without a 'scenario' and 'strategy' string");
      }
      absl::StatusOr<StagePoint> p = RangesPoint(j);
      if (!p.ok()) return bad(p.status().message());
      absl::StatusOr<int64_t> moved = LayersMoved(j);
      if (!moved.ok()) return bad(moved.status().message());
      p->iteration = iteration;
      p->decision = *moved > 0;
      series(absl::StrCat(scenario->get<std::string>(), ": ", strategy->get<std::string>()))
          .stages.push_back(*std::move(p));
    } else {  // --metrics_file: stage_ranges after the iteration's moves, moves cumulative.
      const bool has_training = std::any_of(std::begin(kTrainingKeys), std::end(kTrainingKeys),
                                            [&](const char* key) { return j.contains(key); });
      if (!has_training && !j.contains("stage_ranges")) {
        return bad("neither a metrics line (loss, lr, grad_norm, tokens_per_second, stage_ranges), "
                   "a load-trace line nor a fulcrum_sim line");
      }
      Series& s = series(name);
      if (has_training) {
        absl::StatusOr<TrainingPoint> p = Training(j);
        if (!p.ok()) return bad(p.status().message());
        p->iteration = iteration;
        s.training.push_back(*p);
      }
      if (j.contains("stage_ranges")) {
        absl::StatusOr<StagePoint> p = RangesPoint(j);
        if (!p.ok()) return bad(p.status().message());
        absl::StatusOr<int64_t> moved = LayersMoved(j);
        if (!moved.ok()) return bad(moved.status().message());
        p->iteration = iteration;
        p->decision = *moved > moved_before[name];
        moved_before[name] = *moved;
        s.stages.push_back(*std::move(p));
      }
    }
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " holds no lines to draw (an empty file? a run writes one per iteration)"));
  }
  for (Series& s : out) {
    InIterationOrder(&s.stages);
    InIterationOrder(&s.training);
    for (size_t k = 1; k < s.stages.size(); ++k) {
      s.stages[k].repack = s.stages[k].ranges.size() != s.stages[k - 1].ranges.size();
    }
  }
  return out;
}

}  // namespace fulcrum::plot
