// Runs one pipeline stage's action list for an iteration: F(mb) receives the activation
// from the previous stage (or embeds the tokens), runs this stage's layers and sends the
// output on (or computes the loss); B(mb) receives the output gradient (or starts from the
// loss), back-propagates with weight gradients deferred (NOTE [B/W split] in
// core/linear.h) and sends the input gradient back; W(mb) runs the deferred weight
// gradients; a fused BW(mb) (1F1B) does B and W at once. Sends are non-blocking; receives
// are posted ahead of the actions that need them (NOTE [pre-posted receives]) and block
// only when the message has not arrived (bounded by the communicator's timeout).
//
// Every action, every wait, and every layer's share of each F, B and W is timed (NOTE
// [per-layer timing]); the activation bytes the stage holds for micro-batches in flight are
// measured (NOTE [activation memory]). Layer moves planned for the iteration are carried out
// in its backward tail (NOTE [early migration]).
//
// With virtual pipeline stages (v model chunks per stage, NOTE [model chunks] in
// core/gpt_model.h) every action names its chunk: F of (mb, chunk c) takes its input from
// the virtual stage before c in model order (the embedding for virtual stage 0; an
// in-memory hand-over when that virtual stage is on this rank, as at ZB-V's turn) and sends
// its output to the one after (or computes the loss on the last); B/BW/W likewise in
// reverse. State, the activation meter's accounting and the per-layer times are per
// (micro-batch, chunk); messages get a queue and tags per (direction, chunk) (NOTE [chunk
// transport] in pipeline/internal/stage_transport.h). Layer moves between virtual stages:
// NOTE [early migration].
//
// Where the parts live: this file interprets the action list (F, B, W, BW); the transport
// (pipeline/internal/stage_transport.h), the activation meter
// (pipeline/internal/activation_meter.h) and the stage's part of the layer moves
// (pipeline/internal/stage_moves.h) are their own classes.
//
// Not thread-safe; one executor per stage process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/gpt_model.h"
#include "core/kernels/device_timer.h"
#include "core/linear.h"
#include "core/parallel_context.h"
#include "parallel/communicator.h"
#include "pipeline/migration.h"
#include "pipeline/rebalancer.h"
#include "pipeline/schedule.h"

namespace fulcrum::pipeline {

namespace internal {
class StageMoves;
}  // namespace internal

/// One executed action: what, and when (milliseconds from the start of the iteration; on a
/// GPU when the stream began and finished its work, NOTE [action times on the device]).
struct ActionTiming {
  ActionTiming() = default;
  ActionTiming(Action action, double start_ms, double end_ms, double wait_ms)
      : action(action), start_ms(start_ms), end_ms(end_ms), wait_ms(wait_ms) {}

  Action action;
  double start_ms = 0;
  double end_ms = 0;
  double wait_ms = 0;  // Part of [start, end) spent waiting for a receive (host clock).
  /// Part of [start, end) spent packing and posting layer migrations (NOTE [early
  /// migration]; host clock); neither compute nor wait.
  double migration_ms = 0;
  /// This action's time per global layer of the stage (F, B/BW or W by `action.kind`).
  std::vector<std::pair<int64_t, double>> layer_ms;
};

/// The layers of a stage, by global index, with a value each (a map: layers move).
using PerLayer = std::map<int64_t, double>;

/// One layer move of the iteration, as this stage took part in it.
struct MigrationTiming {
  int64_t layer = 0;
  int from_stage = 0;
  int to_stage = 0;
  bool sent = false;   // This stage sent it (else received it).
  bool early = false;  // Sent inside the backward tail, right after the layer's last W
                       // (every send is; kept for the timeline's record).
  double start_ms = 0;  // From the start of the iteration.
  double end_ms = 0;    // Released and posted (sends) or adopted (receives).
  double done_ms = 0;   // Transfer complete on this side (set by FinishMoves).
  int64_t bytes = 0;
};

struct StageRunResult {
  std::chrono::steady_clock::time_point start;  // When the run began (timings are relative).
  double loss_sum = 0;  // Σ token losses (the stage holding the head), else 0.
  int64_t tokens = 0;
  std::vector<ActionTiming> timings;
  // Per global layer, summed over micro-batches (NOTE [per-layer timing]).
  PerLayer layer_forward_ms;
  PerLayer layer_backward_ms;  // B, or the fused BW of 1F1B.
  PerLayer layer_weight_ms;    // W (split schedules only).
  /// Per global layer: the bytes its forward left allocated for one micro-batch (what its
  /// backward reads, and its output), the largest over the micro-batches (NOTE [activation
  /// memory]); training runs only.
  PerLayer layer_activation_bytes;
  double total_ms = 0;  // Until the last action ended and every activation/gradient send is done.
  double wait_ms = 0;   // Time blocked in receives and in the final wait for sends.
  /// After the run, waiting for the rest of the pipeline to finish (set by PipelineRunner,
  /// NOTE [bubble measurement] in pipeline/pipeline_runner.h); 0 from the executor.
  double tail_wait_ms = 0;
  /// The most activation bytes held at an action boundary for micro-batches in flight
  /// (NOTE [activation memory]); 0 for a forward-only run.
  int64_t peak_activation_bytes = 0;
  /// Layer moves, in plan order; receives and late sends are added by FinishMoves.
  std::vector<MigrationTiming> migrations;
  /// The device allocator's figures at the end of the run (allocated, reserved, peak) on a
  /// GPU; untracked on the CPU, where peak_activation_bytes is the stage's memory figure.
  kernels::DeviceMemory device_memory;
};

// NOTE [per-layer timing]
// F: each layer's forward is timed directly. B: during F, a gradient hook goes on each
// layer's input (and, on the last stage, on the head's input); on the CPU the autograd
// engine runs the nodes of a later layer before any of an earlier one, so the hook on layer
// l's input fires when layer l's backward is done, and layer l's B is the time between that
// and the previous boundary (the start of the backward on a stage that receives its output
// gradient). The hooks return nothing: gradients are untouched. W: the deferred GEMMs carry
// the layer as their tag (NOTE [weight-gradient tags] in core/linear.h) and are timed one by
// one. The embedding, the head and the loss are no layer's: the per-layer sums are the
// stage's F, B and W minus those, the receives and the sends. A fused BW (1F1B) counts as B.
// Every interval is one of a kernels::DeviceTimer made per run (NOTE [device timer] in
// core/kernels/device_timer.h): on the CPU the host clock (the wall time of the same
// intervals as ever), on a GPU events on the current stream, so the times are the work and
// not its launch. In B the hooks chain the intervals: a layer's hook stops its interval and
// starts the previous layer's (the autograd engine may call them from its device thread
// while the compute thread waits in backward()). The timer is collected once, at the end of
// the run (one synchronisation per iteration); only then are the actions' and the layers'
// times filled in. An action's start and end: NOTE [action times on the device].
//
// NOTE [action times on the device]
// Each action is also one interval of the run's timer (key "A/<index>"), and the timer's
// origin is marked when the run starts. With device events (a GPU), the one Collect gives
// each action's start_ms and end_ms as milliseconds since the origin on the stream: start
// is when the stream reached the action (the work queued before it done and the host at
// the action), end is when the stream finished the last work the action queued on it. So
// the timeline's slices are the work, not its launch; zero is the stream reaching the run's
// start (the host's run start when the stream was idle then, as after the previous
// iteration's Collect). Waits stay host times: wait_ms is the host blocked in a receive,
// during which the stream idles inside [start, end) (the slice still covers it, as on the
// CPU); migration_ms, the migrations' own times and the sends' final wait are host times
// too, and total_ms is the later of the host's end and the last action's device end. Sends
// and receives are no actions of their own: their transfers run off the compute stream.
// With the host clock (the CPU) start_ms and end_ms are the host times taken around each
// action, as ever; the timer's action intervals are then not read.
//
// NOTE [activation memory]
// During a training run a thread-local c10 memory reporter (the interface the PyTorch
// profiler uses) counts the bytes allocated and freed on the training thread (except while
// a layer is packed for migration, which frees tensors allocated before the run). A
// micro-batch's activations are the bytes its F allocated and still holds when it ends
// (what autograd saved for the backward, its output, the loss) plus its received input;
// after its B it holds only the operands its deferred weight GEMMs keep
// (WeightGradStore::held_bytes). The peak is the largest sum of these over the micro-batches
// in flight, taken at action boundaries; temporaries inside one action are not included.
// Each layer's share is the bytes still allocated after its forward that were not before
// (per micro-batch; the load model's per-layer activation memory). While it counts, the
// reporter replaces a running PyTorch profiler's memory events. With chunks each (micro-batch,
// chunk) pair is held on its own; an input handed over from the rank's own chunk (NOTE
// [chunk transport]) shares that chunk's output and is counted there only.
//
// NOTE [pre-posted receives]
// Gloo (like NCCL) moves a point-to-point message only once both ends have posted it; a
// receive posted when the action that needs it starts pays a round trip through both
// processes' transport threads after the data is ready, on the pipeline's critical path.
// The executor therefore posts the receives of each direction in the order its list
// consumes them, up to max_in_flight ahead (buffers the size of one activation each), and
// an action only waits for its own. With chunks each (direction, chunk) is its own queue,
// in the order the list consumes that queue (NOTE [chunk transport]).
//
// NOTE [early migration]
// The moves of an iteration are known before it starts: the rebalancer plans a placement
// from the previous iteration's loads (pipeline/rebalancer.h), and every layer whose stage
// changes goes straight from its old stage to its new one, any distance away. A stage sends
// its outgoing layers during its last action of their chunk (with one chunk, its last
// action), which holds every such layer's last weight gradient: it is the chunk's last W
// (or BW), since a W follows its own B and F, and every W flushes all layers of its
// (micro-batch, chunk). In that W each moving layer's queued GEMMs run
// first (WeightGradStore::FlushTag), then the layer is taken out and its state posted to
// its new stage, then the other layers' W runs (after a last fused BW, the layers leave at
// the end of the action). Its gradients are final then, so the new stage continues it
// bit-identically. A receiving stage posts the receive of the first incoming layer from
// each source when its run starts and completes every transfer in FinishMoves, after its
// own last action and before the optimizer step, inserting the layers; its layers are then
// the plan's range for it (checked). A stage that runs forward only (NOTE [forward-only
// stages] in schedule.h) sends after its last F: its frozen weights do not change.
//
// Under chunks (virtual pipeline stages) a move is between virtual stages, and a rank takes
// part by the ranks that hold them (PlannedMove::from_rank/to_rank). A move between two
// chunks of one rank is local: the layer stays in the rank's GptModel and nothing is sent;
// only the chunk ranges change, in FinishMoves (after the iteration, before the optimizer
// step: the layer's chunk is read only by F and B, all done by then). A remote move leaves
// right after the last W (or BW; the last F of a forward-only chunk) of the layer's own
// chunk, which under ZB-V may come well before the rank's last action (the chunk nearer
// the head finishes its backward first): a W flushes the layers of its own (micro-batch,
// chunk), so after the chunk's last W its layers' gradients are final, and the rank's
// other chunks never touch them. The transfer then overlaps the rest of the rank's list.
// FinishMoves then inserts the received layers, sets every chunk's range to the
// plan's and checks that the rank holds exactly those layers (GptModel::CheckChunkRanges);
// the runner also checks, before planning, that the gathered chunk ranges are the last
// plan's.

class StageExecutor {
 public:
  /// `model` is this stage's part; `pp` the pipeline communicator (rank = stage index).
  /// Activations are [seq_length, micro_batch_size, hidden] between stages
  /// (GptModel::local_sequence_length() rows under sequence parallelism).
  StageExecutor(parallel::Communicator* pp, int64_t micro_batch_size);
  ~StageExecutor();  // Out of line: StageMoves is complete only in the .cc.
  StageExecutor(const StageExecutor&) = delete;
  StageExecutor& operator=(const StageExecutor&) = delete;

  /// Runs `schedule` (its row for this stage) for `iteration`. Each micro-batch's summed
  /// token loss is multiplied by `loss_scale` before the backward. With `forward_only`,
  /// only the F actions run, without autograd (evaluation). `moves` (every stage passes the
  /// same list, MovesBetween the current placement and the plan's; ignored when
  /// forward_only) are this iteration's layer moves: this stage's sends happen inside the
  /// run; call FinishMoves before the optimizer step.
  absl::StatusOr<StageRunResult> Run(GptModel& model, const Schedule& schedule,
                                     int64_t iteration, const MicroBatchPlan& plan,
                                     double loss_scale, bool forward_only = false,
                                     const std::vector<PlannedMove>& moves = {});

  /// Completes the moves of the last Run (NOTE [early migration]): receives and inserts the
  /// layers coming to this stage and waits for every send; then the stage must hold `range`
  /// (its range in the plan; not checked when begin > end). Appends the timings (relative to
  /// that run's start) to `result.migrations`. No-op without moves.
  absl::Status FinishMoves(GptModel& model, StageRunResult& result,
                           std::pair<int64_t, int64_t> range = {1, 0});
  /// The same with chunks (NOTE [model chunks]): then sets the model's chunk ranges to
  /// `chunk_ranges` (this rank's chunks' ranges in the plan, chunk order) — local moves
  /// change only these — and checks that it holds exactly their layers.
  absl::Status FinishMoves(GptModel& model, StageRunResult& result,
                           std::vector<std::pair<int64_t, int64_t>> chunk_ranges);

  /// Makes the timer of each Run (NOTE [per-layer timing]); by default a
  /// kernels::DeviceTimer for the model's device. A test seam: a timer with known
  /// durations shows where the executor's per-layer times come from.
  using TimerFactory = std::function<std::unique_ptr<kernels::DeviceTimer>(c10::Device)>;
  void set_timer_factory(TimerFactory factory) { timer_factory_ = std::move(factory); }

  /// Whether Runs time each layer (NOTE [per-layer timing]; on by default). Off, only the
  /// actions are timed (NOTE [action times on the device]): no per-layer intervals, no
  /// gradient hooks, and the result's per-layer times stay empty (activation bytes are
  /// still measured). What a run that never balances may choose (fulcrum_train
  /// --layer_timing=false), and how the timing's own cost is measured.
  void set_layer_timing(bool on) { layer_timing_ = on; }
  bool layer_timing() const { return layer_timing_; }

 private:
  struct InFlight;
  struct RunContext;
  struct LayerInterval;

  absl::Status Forward(RunContext& run, int mb, int chunk, ActionTiming& timing);
  absl::Status Backward(RunContext& run, int mb, int chunk, bool split, bool last_action,
                        ActionTiming& timing);
  absl::Status Weight(RunContext& run, int mb, int chunk, bool last_action, ActionTiming& timing);
  /// Sends the outgoing layers of chunk `chunk` (NOTE [early migration]); `store` holds
  /// the deferred weight gradients of the action that ends the chunk's work (null after a
  /// fused BW or a forward-only chunk's last F).
  absl::Status SendOutgoingLayers(RunContext& run, WeightGradStore* store, int chunk,
                                  ActionTiming& timing);
  // At a chunk's last backward action: reports its units' gradients final to the plan's
  // gradients_final, first running `store`'s (the last W's) weight gradients one unit at a
  // time when given (NOTE [overlapped gradient reduction]). Nothing without the callback.
  absl::Status ReportFinalGradients(RunContext& run, WeightGradStore* store, int chunk);
  // Times slot `slot`'s backward from now (the backward reached its output).
  static void OpenBackwardInterval(RunContext& run, InFlight& state, size_t slot);
  // The run's one Collect: fills every action's and the result's per-layer times, and on
  // the device axis each action's start and end (NOTE [action times on the device]).
  static absl::Status CollectTimes(RunContext& run);
  double SinceRunStart() const;

  parallel::Communicator* pp_;
  int64_t micro_batch_size_;
  // This iteration's layer moves, from Run to FinishMoves. Behind a pointer so that this
  // public header needs no internal/ one.
  std::unique_ptr<internal::StageMoves> moves_;
  std::chrono::steady_clock::time_point run_start_;
  TimerFactory timer_factory_;
  bool layer_timing_ = true;
};

}  // namespace fulcrum::pipeline
