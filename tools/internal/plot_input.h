// What fulcrum_plot draws, read from the files it is given: a fulcrum_train --metrics_file
// (any run: the training curves, and the per-stage pictures of a pipeline run), a --load_trace
// file, or fulcrum_sim --output (one series per simulated strategy).
//
// NOTE [plot input]
// Every line is a JSON object with an integer "iteration". A metrics line contributes
//   loss, valid_loss, lr, grad_norm, tokens_per_second   (numbers; null, which is how the
//                                                          writer spells NaN/inf, is a gap)
// and, on a pipeline run, stage_ranges, stage_ms, bubble_ratio and layers_moved (cumulative);
// with virtual pipeline stages, stage_ranges holds the p·v ranges in model order and
// stage_range_ranks the rank holding each (one integer per range, each below their count).
// A load-trace line (it has "loads" and "ran_on") contributes ran_on, the loads' F+B+W and
// the measured bubble ratio; a line with "source": "fulcrum_sim" its stage_ranges, stage_ms,
// bubble_ratio and layers_moved. A field of the wrong type, ranges that are not contiguous
// [begin, end) pairs from layer 0, negative or non-finite times, or a file with nothing to
// draw are errors naming the line. Points are kept in iteration order; when a resumed run
// appended an iteration again, the later line wins.
//
// Pure functions (no LibTorch, no files): the fuzz targets call ParsePlotInput on any text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace fulcrum::plot {

/// One iteration of a pipeline run: what the per-stage pictures show.
struct StagePoint {
  int64_t iteration = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  ///< The placement of the iteration.
  /// With virtual pipeline stages, the rank holding each range (ranges are then per virtual
  /// stage, in model order); empty when range k is rank k's.
  std::vector<int> ranks;
  std::vector<double> stage_ms;
  double bubble = 0;
  bool decision = false;  ///< Layers moved in this iteration.
  bool repack = false;    ///< The stage count changed.
};

/// One iteration of a training run: what the training curves show (absent: not recorded).
struct TrainingPoint {
  int64_t iteration = 0;
  std::optional<double> loss, valid_loss, lr, grad_norm, tokens_per_second;
};

/// A run (a file, or one strategy of a simulation).
struct Series {
  std::string name;
  std::vector<StagePoint> stages;      ///< Empty for a single-process run.
  std::vector<TrainingPoint> training;  ///< Empty for traces and simulations.
};

/// The series of one input file's `text` (NOTE [plot input]); `name` (its path) names the
/// series and starts every error message ("m.jsonl:3: ..."). InvalidArgument for anything
/// that is not such a file; never throws.
absl::StatusOr<std::vector<Series>> ParsePlotInput(std::string_view text, std::string_view name);

}  // namespace fulcrum::plot
