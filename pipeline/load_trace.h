// The load trace (fulcrum_train --load_trace=PATH): one JSON line per measured iteration,
// with what the pipeline runner handed its rebalancer from that measurement, so that
// fulcrum_sim can replay a real run's per-layer costs (dynamic/trace_replay.h).
//
// NOTE [load trace lines]
// Iteration i's measurement is gathered at the start of iteration i+1, for Plan(i+1) (NOTE
// [when the plan is made] in pipeline/rebalancer.h), so the line describing iteration i is
// written at the end of iteration i+1, and the last iteration of a run has no line. A line:
//   {"iteration": i, "plan_iteration": i+1, "schedule": "zbh1", "microbatches": m,
//    "zbv_order": "measured",            zbv only: the V's order (NOTE [ZB-V at measured
//                                        costs] in pipeline/measured_order.h)
//    "ran_on": [[0,4],[4,8]],            the placement iteration i ran on (with chunks, a
//                                        range per virtual stage, in model order)
//    "loads": [StageLoad...],            Plan(i+1)'s input verbatim (StageLoadToJson): the
//                                        ranges after i's moves, per-layer F/B/W ms summed
//                                        over the micro-batches, plugin loads (block_load),
//                                        parameters, state and activation bytes; with
//                                        chunks also each rank's chunk_ranges and its
//                                        chunks' F/B/W totals (chunk_forward_ms, ...)
//    "decision": [[0,3],[3,8]],          the placement Plan(i+1) chose
//    "model_changed": ["pruned to 52%"],  OnModelChanged(i) calls, when there were any
//    "frozen_prefix": 6,                 layers frozen front to back in iteration i, when
//                                        any (the stages wholly inside ran forward only)
//    "measured": {"pipeline_ms", "bubble_ratio", "stage_ms", "iteration_ms"}}  of iteration i
// Doubles are written shortest-round-trip (nlohmann), so a replay reads the same bits.
//
// Pure functions; thread-safe.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::pipeline {

/// Every field of `load` as a JSON object (names as in StageLoad).
nlohmann::json StageLoadToJson(const StageLoad& load);

/// The StageLoad of StageLoadToJson's object; InvalidArgument naming a missing or mistyped
/// field.
absl::StatusOr<StageLoad> StageLoadFromJson(const nlohmann::json& object);

/// [[begin, end], ...] of `ranges`.
nlohmann::json RangesToJson(const LayerRanges& ranges);

/// The ranges of RangesToJson's array; InvalidArgument otherwise.
absl::StatusOr<LayerRanges> RangesFromJson(const nlohmann::json& array);

}  // namespace fulcrum::pipeline
