// A hand-written load-trace line (pipeline/load_trace.h, NOTE [load trace lines]) whose
// costs the trace tests work out by hand; the CLI tests break it one field at a time.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "pipeline/load_trace.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

// Stage 0 holds layers [0,1), stage 1 [1,3); m = 2; per-layer F/B/W summed over the
// micro-batches; stage 0's totals carry 2 ms of embedding forward, stage 1's 6 ms of head
// forward and 4 ms of head backward.
inline nlohmann::json HandTraceLine(int64_t iteration, const std::string& ranges = "[[0,1],[1,3]]") {
  pipeline::StageLoad a;
  a.stage = 0;
  a.layer_begin = 0;
  a.layer_end = 1;
  a.layer_forward_ms = {4};
  a.layer_backward_ms = {8};
  a.layer_weight_ms = {6};
  a.layer_parameters = {100};
  a.layer_state_bytes = {1600};
  a.layer_block_load = {0};
  a.forward_ms = 6;
  a.backward_ms = 8;
  a.weight_ms = 6;
  a.pinned_parameters = 50;
  pipeline::StageLoad b;
  b.stage = 1;
  b.layer_begin = 1;
  b.layer_end = 3;
  b.layer_forward_ms = {2, 4};
  b.layer_backward_ms = {4, 8};
  b.layer_weight_ms = {2, 4};
  b.layer_parameters = {100, 100};
  b.layer_state_bytes = {1600, 1600};
  b.layer_block_load = {0, 7};
  b.forward_ms = 12;
  b.backward_ms = 16;
  b.weight_ms = 6;
  b.pinned_parameters = 60;
  return {{"iteration", iteration},
          {"plan_iteration", iteration + 1},
          {"schedule", "zbh1"},
          {"microbatches", 2},
          {"rebalancer", "partition"},
          {"ran_on", nlohmann::json::parse(ranges)},
          {"loads", {pipeline::StageLoadToJson(a), pipeline::StageLoadToJson(b)}},
          {"decision", nlohmann::json::parse(ranges)},
          {"measured", {{"pipeline_ms", 30.0}, {"bubble_ratio", 0.25}, {"iteration_ms", 33.0}}}};
}

// The same under ZB-V (two chunks per rank in a V): 4 layers on the virtual stages
// [0,1) [1,2) [2,3) [3,4), so rank 0 holds chunks [0,1) and [3,4) — the embedding and the
// head — and rank 1 [1,2) and [2,3); m = 2. Rank 0's chunk 0 carries 2 ms of embedding
// forward, its chunk 1 6 ms of head forward and 4 ms of head backward; rank 1's chunks
// carry nothing but their layers. Only the chunk totals can split rank 0's pinned time.
inline nlohmann::json HandChunkTraceLine(int64_t iteration) {
  pipeline::StageLoad a;
  a.stage = 0;
  a.layer_begin = 0;
  a.layer_end = 4;
  a.chunk_ranges = {{0, 1}, {3, 4}};
  a.layer_forward_ms = {4, 2};  // layers 0 and 3
  a.layer_backward_ms = {8, 4};
  a.layer_weight_ms = {6, 2};
  a.layer_parameters = {100, 100};
  a.layer_state_bytes = {1600, 1600};
  a.layer_block_load = {0, 0};
  a.chunk_forward_ms = {6, 8};
  a.chunk_backward_ms = {8, 8};
  a.chunk_weight_ms = {6, 2};
  a.forward_ms = 14;
  a.backward_ms = 16;
  a.weight_ms = 8;
  a.pinned_parameters = 110;  // the embedding and the head
  pipeline::StageLoad b;
  b.stage = 1;
  b.layer_begin = 1;
  b.layer_end = 3;
  b.chunk_ranges = {{1, 2}, {2, 3}};
  b.layer_forward_ms = {2, 4};
  b.layer_backward_ms = {4, 8};
  b.layer_weight_ms = {2, 4};
  b.layer_parameters = {100, 100};
  b.layer_state_bytes = {1600, 1600};
  b.layer_block_load = {0, 7};
  b.chunk_forward_ms = {2, 4};
  b.chunk_backward_ms = {4, 8};
  b.chunk_weight_ms = {2, 4};
  b.forward_ms = 6;
  b.backward_ms = 12;
  b.weight_ms = 6;
  const char* ranges = "[[0,1],[1,2],[2,3],[3,4]]";
  return {{"iteration", iteration},
          {"plan_iteration", iteration + 1},
          {"schedule", "zbv"},
          {"microbatches", 2},
          {"rebalancer", "none"},
          {"ran_on", nlohmann::json::parse(ranges)},
          {"loads", {pipeline::StageLoadToJson(a), pipeline::StageLoadToJson(b)}},
          {"decision", nlohmann::json::parse(ranges)},
          {"measured", {{"pipeline_ms", 40.0}, {"bubble_ratio", 0.2}, {"iteration_ms", 43.0}}}};
}

}  // namespace fulcrum::dynamic
