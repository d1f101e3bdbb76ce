// A timeline of a pipeline-parallel run (--timeline=PATH) in the Chrome trace-event JSON
// format, which https://ui.perfetto.dev and chrome://tracing open: one row (process) per
// world rank, labelled "rank R (stage S)", on which every executed action of every recorded
// iteration is a slice ("F3", "B3", "W3", "BW3") with the time it spent blocked in a
// receive as a nested "wait" slice. Iteration spans and free-form events (migrations,
// checkpoints) sit on rows of their own.
//
//   TimelineRecorder timeline(&world, "/tmp/run.json", stage);   // collective
//   for (...) {
//     FULCRUM_ASSIGN_OR_RETURN(StageRunResult run, executor.Run(...));
//     timeline.RecordIteration(iteration, run);
//   }
//   FULCRUM_RETURN_IF_ERROR(timeline.Flush());                    // collective
//
// NOTE [timeline clock] Ranks agree on a time origin once, in the constructor: a barrier
// over the world, then every rank reads its own steady_clock. The origins of two ranks
// therefore differ by at most the spread with which the ranks leave that barrier — one
// barrier's latency — and every timestamp of a rank inherits that offset. Measured over
// loopback Gloo on a busy 2-core host: 1-300 us for 2-4 ranks, but up to 0.7 ms on a
// communicator's first collective, so a warm-up barrier goes first. Across hosts it is
// the network's barrier latency; drift between hosts' clocks during the run is not
// corrected. Differences within one rank's row are exact.
//
// Memory is bounded: after TimelineOptions::max_iterations recorded iterations (and
// max_spans free-form events) further ones are dropped, with one log line.
//
// Not thread-safe: use a recorder from the training thread only (Flush is a collective on
// the world communicator, which has the same rule).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "parallel/communicator.h"
#include "pipeline/schedule.h"
#include "pipeline/stage_executor.h"

namespace fulcrum::pipeline {

/// Limits of a TimelineRecorder.
struct TimelineOptions {
  /// Iterations recorded; RecordIteration ignores later ones (logging once). About
  /// 2 × 3 × micro-batches events of ~100 bytes per iteration. Default: 200. Must be ≥ 0.
  int64_t max_iterations = 200;
  /// Free-form events recorded by RecordSpan; later ones are ignored (logging once).
  /// Default: 10000. Must be ≥ 0.
  int64_t max_spans = 10000;
};

class TimelineRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  /// Extra key/value pairs shown in a slice's details ("args" of the trace event).
  using Args = std::vector<std::pair<std::string, std::string>>;

  /// Collective over `world` (every rank constructs one, in the same order as its other
  /// collectives): agrees on the common time origin (NOTE [timeline clock]). `path` is
  /// where world rank 0 writes the file on Flush (its parent directory is created);
  /// `stage` is this rank's pipeline stage, shown in the row's name. `world` must outlive
  /// the recorder.
  TimelineRecorder(parallel::Communicator* world, std::string path, int stage,
                   TimelineOptions options = {});

  TimelineRecorder(const TimelineRecorder&) = delete;
  TimelineRecorder& operator=(const TimelineRecorder&) = delete;

  /// Records this rank's actions of one iteration: `run` is what StageExecutor::Run
  /// returned (its ActionTiming times are relative to run.start). Each action becomes a complete
  /// event named Action::ToString() ("F3", "B3", "W3", "BW3"; with model chunks every name
  /// shows its chunk: "F3.0", "F3.1"; category "compute") with args
  /// {microbatch, iteration, kind, chunk}; its wait_ms a nested "wait" event (category "wait") at
  /// the action's start; the final wait for outstanding sends, and the wait for the rest of
  /// the pipeline (run.tail_wait_ms), "wait" events after the last action; the whole Run
  /// an "iteration N" event on a row of its own. An action's per-layer times are args
  /// "layers.L ms". Not collective.
  void RecordIteration(int64_t iteration, const StageRunResult& run);

  /// Records a free-form event on this rank's "events" row, e.g. a migration
  /// ("move layers.3 -> stage 1", category "migration"). Times are milliseconds since the
  /// common origin (see NowMs / MillisecondsSinceOrigin); `end_ms` ≤ `start_ms` makes an
  /// instant event. Not collective.
  void RecordSpan(const std::string& name, const std::string& category, double start_ms,
                  double end_ms, const Args& args = {});

  /// Milliseconds from the common origin to `t` (negative before it).
  double MillisecondsSinceOrigin(Clock::time_point t) const;
  /// Milliseconds from the common origin to now.
  double NowMs() const { return MillisecondsSinceOrigin(Clock::now()); }

  /// Collective over `world`: gathers every rank's events to world rank 0, which replaces
  /// the file at `path` atomically (WriteFileAtomically) with everything recorded so far —
  /// so it may be called periodically and again at the end. Returns the write's status on
  /// rank 0 and OK elsewhere; communication failures throw parallel::CommError, as every
  /// collective does.
  absl::Status Flush();

  /// Iterations recorded so far (at most max_iterations).
  int64_t recorded_iterations() const { return recorded_iterations_; }
  /// Events held in memory on this rank (metadata excluded).
  size_t num_events() const { return events_.size(); }
  const std::string& path() const { return path_; }

 private:
  // One trace event, kept compact: the JSON is built only in Flush.
  struct Event {
    std::string name;
    std::string category;
    char phase = 'X';  // 'X' complete, 'i' instant.
    int tid = 0;
    double ts_us = 0;              // Since the common origin.
    double dur_us = 0;             // 'X' only.
    int64_t iteration = -1;        // ≥ 0: shown as args.iteration.
    std::optional<Action> action;  // Shown as args.microbatch, args.kind and args.chunk.
    std::vector<std::pair<std::string, std::variant<std::string, double>>> args;
  };

  // This rank's events (metadata first) as comma-separated JSON objects.
  std::string SerializeEvents() const;

  parallel::Communicator* world_;
  std::string path_;
  int stage_;
  TimelineOptions options_;
  Clock::time_point origin_;
  std::vector<Event> events_;
  int64_t recorded_iterations_ = 0;
  int64_t recorded_spans_ = 0;
  bool logged_iteration_limit_ = false;
  bool logged_span_limit_ = false;
};

}  // namespace fulcrum::pipeline
