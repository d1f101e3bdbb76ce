// When to re-pack the pipeline onto fewer stages (DESIGN.md "Re-packing"): a forced script
// (--repack_script, for tests and demonstrations) or the automatic decision of repack.h on
// the per-layer costs the pipeline measured (--repack=auto, every --repack_interval
// iterations). The trigger only decides; carrying a decision out (through a checkpoint and
// a relaunch, recipes/repack_flags.h) is the caller's.
//
// Every rank calls Check with the same arguments (the loads are gathered over the pipeline
// and averaged over the replicas, pipeline/rebalancer.h) and so decides the same.
//
// Pure C++ (no LibTorch). Not thread-safe.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "dynamic/repack.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

/// A parsed --repack_script: the stage count to pack onto after each listed iteration.
using RepackScript = std::map<int64_t, int>;

/// Parses "ITER:STAGES[;ITER:STAGES...]", e.g. "15:2" (after iteration 15, two stages);
/// iterations ≥ 1 and increasing, stage counts ≥ 1 and decreasing. InvalidArgument naming
/// the bad step otherwise.
absl::StatusOr<RepackScript> ParseRepackScript(const std::string& script);

/// The re-packing problem from what the pipeline measured (one StageLoad per stage; times
/// summed over `num_microbatches` micro-batches become per-micro-batch costs): each layer's
/// F, B and W; what the first and last stage ran besides their layers (embedding; head and
/// loss); each layer's state and activation bytes, and the first and last stage's pinned
/// state. With chunks (loads carrying chunk_ranges, `num_chunks` > 1) the layers come from
/// every rank's chunks in model order and the pinned costs from the first and last chunk's
/// action times (a rank holding both, ZB-V's rank 0, counts its pinned state once).
/// InvalidArgument when the loads do not cover the layers 0..L-1 in order.
absl::StatusOr<RepackProblem> RepackProblemFromLoads(const std::vector<pipeline::StageLoad>& loads,
                                                     const std::string& schedule,
                                                     int num_microbatches, double memory_budget,
                                                     int num_chunks = 1);

struct RepackTriggerOptions {
  /// --repack=auto: decide every `interval` iterations from the measured loads.
  bool automatic = false;
  /// Default: 100. Must be ≥ 1.
  int64_t interval = 100;
  /// --repack_min_stages, --repack_max_slowdown.
  RepackOptions decision;
  /// --repack_script: forced re-packing (exclusive with `automatic`).
  RepackScript script;
  /// The schedule (--pipeline_schedule), micro-batches per iteration and replica, and the
  /// memory budget in bytes (--rebalance_memory_budget_mb; infinity: none).
  std::string schedule = "1f1b";
  /// --virtual_pipeline_model_parallel_size: with chunks a placement has a range per
  /// virtual stage and ranks merge chunk by chunk (NOTE [re-packing under chunks] in repack.h).
  int num_chunks = 1;
  /// --zbv_order=measured: ZB-V runs the order built at measured costs, and the decision
  /// predicts with it (RepackProblem::measured_zbv_order).
  bool measured_zbv_order = false;
  int num_microbatches = 1;
  double memory_budget = std::numeric_limits<double>::infinity();
};

// NOTE [overdue script step]
// A --repack_script step ITER:STAGES is due from the end of iteration ITER on, not only
// then: a run stopped in iteration ITER (a SIGTERM there saves that iteration and exits
// before the shrink), or saved past ITER by a run without the step, resumes on the old stage
// count from a checkpoint of iteration ≥ ITER and never sees ITER again. It re-packs after
// its first iteration instead, and says so; the losses are the same either way (re-packing
// never changes the math), only the ranks are released one iteration later.
class RepackTrigger {
 public:
  explicit RepackTrigger(RepackTriggerOptions options) : options_(std::move(options)) {}

  /// Whether to pack after `iteration`, whose placement (after its moves) is `current`;
  /// `loads` are what the pipeline gave its rebalancer at the start of the iteration (zero
  /// times before anything was measured: no automatic decision then). A script step whose
  /// stage count is not below the current one is already done (a relaunch after it) and is
  /// skipped; one still to do whose iteration has passed is done now (NOTE [overdue script
  /// step]). Returns the plan to carry out, or nullopt; errors from the decision.
  /// `frozen_prefix`: the model's frozen layers from layer 0 (RepackProblem::frozen_prefix).
  absl::StatusOr<std::optional<RepackPlan>> Check(int64_t iteration,
                                                  const pipeline::LayerRanges& current,
                                                  const std::vector<pipeline::StageLoad>& loads,
                                                  int64_t frozen_prefix = 0);

  /// The last Check's decision line ("repack: ..."), empty if none was made.
  const std::string& last_note() const { return last_note_; }

 private:
  RepackTriggerOptions options_;
  std::string last_note_;
};

}  // namespace fulcrum::dynamic
