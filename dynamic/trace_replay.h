// Replaying a load trace (fulcrum_train --load_trace; format: NOTE [load trace lines] in
// pipeline/load_trace.h) in the simulator, and scaling it to a larger model.
//
// A trace line's loads are what the live run's rebalancer was given; the replay turns each
// line into the IterationCosts of the iteration it measured — per-layer F/B/W per
// micro-batch, the pinned embedding / head time as the stage totals minus their layers (NOTE
// [pinned time] in dynamic/load_model.h), parameters, state bytes, plugin loads — and keeps
// the loads themselves, so SimulateRun hands them verbatim to the same balancer (NOTE
// [simulated loads] in dynamic/simulation.h) and reaches the live run's decisions.
// With virtual pipeline stages (interleaved 1F1B, ZB-V) the placements have a range per
// virtual stage, and what is no layer's is taken per chunk (the chunk's action totals minus
// its layers): the embedding's from the first virtual stage's chunk, the head's and the
// loss's from the last one's — under ZB-V both on rank 0, which its rank totals alone could
// not split.
//
// NOTE [simulated hand-over]
// A replay models no transfer time unless asked (fulcrum_sim --p2p_bytes; its default for a
// trace is 0), because between two processes on one host the hand-over is already inside
// the measured action times: the producing action posts its send (the copy into the
// socket runs there), and the consumer's wait ends when that action ends — measured from
// the timelines of real pp=2 runs (tools/handover_latency.py: median −0.06 ms, 90th
// percentile +0.005 ms, within the ranks' clock offset). Charging a transfer on top, as
// the validation table did before 2026-11-27 (512 KiB at 1 GB/s + 300 µs, from the
// collectives' bandwidth), counted 0.8 ms of idle per hand-over that the run never waited: that was the
// bubble's over-prediction (+12% to +49%); without it the bubble is within 10% (−3% to
// +9%) on every run of tools/validate_sim.sh. Across hosts the transfer is real: give --p2p_* then.
//
// NOTE [trace scaling]
// ScaleTrace maps a trace of L layers and hidden size h onto a model of L' layers and hidden
// h' (same sequence length and micro-batch): layer l' takes the costs of recorded layer
// ⌊l'·L/L'⌋ (its pattern of dynamism: which layers are MoE, pruned, frozen), scaled by the
// FLOP ratio of a transformer layer, (24·h'² + 4·s·h') / (24·h² + 4·s·h) per token (Megatron's
// count, Narayanan et al. SC'21 §5.1: 24bsh² for the GEMMs, 4bs²h for attention); the pinned
// embedding / head costs scale by h'/h (their GEMM is s·h·V); parameters by (h'/h)², state
// bytes likewise. This keeps every layer's measured ratio to a dense layer — what the plugins
// change — and assumes the machine's speed per FLOP stays what it was (stated in the output).
//
// Thread-safe: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "dynamic/simulation.h"
#include "pipeline/rebalancer.h"

namespace fulcrum::dynamic {

/// One line of a load trace.
struct TraceLine {
  int64_t iteration = 0;      ///< The iteration measured.
  std::string schedule;
  int microbatches = 0;
  std::string rebalancer;
  Placement ran_on;           ///< What it ran on.
  Placement decision;         ///< What Plan(iteration + 1) chose.
  std::vector<pipeline::StageLoad> loads;
  std::vector<std::string> model_changed;
  /// Layers [0, frozen_prefix) were frozen in that iteration: the stages wholly inside ran
  /// forward only (NOTE [forward-only stages] in pipeline/schedule.h). 0 when absent.
  int64_t frozen_prefix = 0;
  double pipeline_ms = 0, bubble_ratio = 0, iteration_ms = 0;  ///< Measured.
  std::vector<double> stage_ms;
  /// Model chunks per rank (virtual pipeline stages): ran_on and decision then hold one
  /// range per virtual stage, and each load its chunks' ranges and action totals.
  int num_chunks = 1;
  int64_t num_layers = 0;  ///< Of the model.
  /// zbv only: the run built the V's order from measured costs ("zbv_order": "measured";
  /// NOTE [ZB-V at measured costs]). Traces without the field ran the unit order.
  bool measured_zbv_order = false;
};

/// A whole trace: its lines in iteration order.
struct LoadTrace {
  std::vector<TraceLine> lines;
  int num_stages() const { return lines.empty() ? 0 : static_cast<int>(lines[0].loads.size()); }
  int64_t num_layers() const { return lines.empty() ? 0 : lines[0].num_layers; }
  int num_chunks() const { return lines.empty() ? 1 : lines[0].num_chunks; }
};

/// Parses the text of a --load_trace file; `name` (the path) starts every message.
/// InvalidArgument naming the line for a line that is not a trace line (a missing or
/// mistyped field; ranges that are not a placement of the loads' layers over their stages;
/// per-layer times that are not one per layer; a negative or non-finite measured time; a
/// bubble ratio outside [0, 1]; fewer than one micro-batch; a frozen prefix that is not a
/// layer count of the model), lines out of order, a change of
/// stages, layers, schedule or micro-batches, or no lines at all. Never throws: any text is
/// either a LoadTrace that CostsFromTraceLine and ScenarioFromTrace can use, or an error.
absl::StatusOr<LoadTrace> ParseLoadTrace(std::string_view text, std::string_view name);

/// ParseLoadTrace of the file `path`; NotFound (naming it) when it cannot be read.
absl::StatusOr<LoadTrace> ReadLoadTrace(const std::string& path);

/// The costs of the iteration `line` measured (see the file comment).
IterationCosts CostsFromTraceLine(const TraceLine& line);

/// A scenario replaying `trace`: its schedule, stages, micro-batches and costs, iterations
/// 1..lines (trace line k is iteration k; a trace that starts later is shifted).
Scenario ScenarioFromTrace(const LoadTrace& trace, const std::string& name);

/// NOTE [trace scaling]: `costs` of a model with `layers` layers of hidden `hidden` mapped
/// onto `new_layers` layers of hidden `new_hidden`, sequence `seq_length`.
IterationCosts ScaleCosts(const IterationCosts& costs, int64_t hidden, int64_t new_layers,
                          int64_t new_hidden, int64_t seq_length);

}  // namespace fulcrum::dynamic
