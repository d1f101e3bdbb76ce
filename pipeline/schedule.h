// Pipeline schedules as data. A schedule says, for every pipeline stage, the ordered list
// of compute actions that stage runs in one iteration: F (forward of one micro-batch),
// B (its input gradient), W (its weight gradient), or BW (B and W fused, as in 1F1B),
// each for one of the stage's model chunks. With v chunks per stage the model is cut into
// p·v contiguous virtual stages, each held by one (stage, chunk) (Schedule::virtual_stages).
// Generators build 1F1B, interleaved 1F1B (v > 1), the zero-bubble schedules ZB-H1 and
// ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2) and ZB-V (two
// chunks in a V); MakeSchedule finds them by their --pipeline_schedule name;
// ValidateSchedule checks any schedule — hand-written ones included — before an executor
// runs it.
//
// Point-to-point transfers are not listed: they follow from the dependencies (NOTE
// [pipeline dependencies]). A chunk sends its F output to the next virtual stage and its
// B/BW input gradient to the previous one, and receives what its own F and B/BW wait for;
// between two chunks of one stage nothing is sent.
//
// Everything here is a pure function of its arguments and safe to call from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/registry.h"

namespace fulcrum::pipeline {

/// What one action of a stage computes for one micro-batch.
enum class ActionKind : uint8_t {
  kForward,         ///< F: forward; keeps the activations the backward needs.
  kBackward,        ///< BW: input and weight gradients in one action (1F1B).
  kBackwardInput,   ///< B: input gradient only; the weight-gradient GEMMs are queued.
  kBackwardWeight,  ///< W: the queued weight gradients of this micro-batch.
};

/// How many ActionKinds there are, and a kind's index in tables indexed by kind.
inline constexpr int kNumActionKinds = 4;
constexpr int KindIndex(ActionKind kind) { return static_cast<int>(kind); }

/// "F", "BW", "B" or "W".
const char* ActionKindName(ActionKind kind);

/// One entry of a stage's action list.
struct Action {
  ActionKind kind = ActionKind::kForward;
  int microbatch = 0;
  int chunk = 0;  ///< Which of this stage's model chunks the action runs (0 when v = 1).

  /// "F3", "BW3", "B3", "W3" for chunk 0; "F3.1" for micro-batch 3 of chunk 1. A chunk
  /// other than 0 is always shown; `with_chunk` shows chunk 0 too ("F3.0"), which schedules
  /// with several chunks use so that every action names its chunk.
  std::string ToString(bool with_chunk = false) const;

  friend bool operator==(const Action& a, const Action& b) {
    return a.kind == b.kind && a.microbatch == b.microbatch && a.chunk == b.chunk;
  }
  friend bool operator!=(const Action& a, const Action& b) { return !(a == b); }
};

/// Prints Action::ToString() (for test failure messages).
std::ostream& operator<<(std::ostream& out, const Action& action);

/// One model chunk: chunk `chunk` (0..v-1) of pipeline stage (= pp rank) `stage`.
struct ChunkId {
  int stage = 0;
  int chunk = 0;

  friend bool operator==(const ChunkId& a, const ChunkId& b) {
    return a.stage == b.stage && a.chunk == b.chunk;
  }
  friend bool operator!=(const ChunkId& a, const ChunkId& b) { return !(a == b); }
};

/// The per-stage action lists of one training iteration.
struct Schedule {
  std::string name;          ///< Registry name: "1f1b", "zbh1", "zbh2", "zbv"; free-form otherwise.
  int num_stages = 0;        ///< Pipeline stages p (ranks); stages.size() must equal it.
  int num_microbatches = 0;  ///< Micro-batches m per iteration, numbered 0..m-1.
  /// The schedule's activation-memory limit, in chunk micro-batches: a (micro-batch, chunk)
  /// pair is held from its F to its BW or W, and a stage holds at most this many pairs
  /// (see PeakInFlight; with v chunks each pair is ~1/v of a one-chunk stage's
  /// activations). ValidateSchedule enforces it.
  int max_in_flight = 0;
  int num_chunks = 1;  ///< Model chunks v per stage, numbered 0..v-1.
  /// The p·v virtual stages in model order: virtual_stages[k] is the chunk that holds the
  /// k-th contiguous piece of the model (k = 0 has the embedding, k = p·v-1 the head).
  /// Empty means v = 1 and virtual stage k is stage k, chunk 0.
  std::vector<ChunkId> virtual_stages;
  /// Virtual stages 0..forward_only-1 (model order) run forward only: no B, BW or W
  /// (NOTE [forward-only stages]). 0 for a generator's schedule; WithForwardOnlyPrefix
  /// sets it.
  int forward_only = 0;
  std::vector<std::vector<Action>> stages;  ///< stages[s]: what stage s runs, in order.
};

// NOTE [forward-only stages]
// When the embedding and layers [0, k) are frozen front to back (NOTE [frozen prefix] in
// core/gpt_model.h), a virtual stage whose layers all lie in that prefix has nothing to
// differentiate: nothing before it trains, so no gradient flows into it or out of it. Its
// B/BW/W would do no work, but in a generator's list they still stand between its
// forwards, each waiting for the next stage's backward of the same micro-batch — so a
// cheap frozen stage would idle on zero-cost steps, paced by the trainable stages after
// it, and its forwards would be held to the in-flight limit although it holds no
// activations. WithForwardOnlyPrefix removes those actions: the forward-only stages run
// their forwards back to back, as fast as their inputs come, and hold nothing (their
// forwards build no graph); the first trainable virtual stage sends no input gradient. The
// dependencies are unchanged (nothing depends on a removed action), so the checker, the
// simulator and the executor need no other rule; the checker requires exactly the F's of
// a forward-only stage and does not count them as held.

/// virtual_stages, or the identity (k -> stage k, chunk 0) when it is empty: always
/// num_stages·num_chunks entries for a valid schedule.
std::vector<ChunkId> VirtualStages(const Schedule& schedule);

/// The model-order index of (stage, chunk); -1 when the schedule has no such chunk.
int VirtualStageOf(const Schedule& schedule, int stage, int chunk);
/// Whether `stage`'s chunk `chunk` lies in the schedule's forward-only prefix (its virtual
/// stage < schedule.forward_only: NOTE [forward-only stages]); false for a chunk the stage
/// does not hold.
bool RunsForwardOnly(const Schedule& schedule, int stage, int chunk);

/// Megatron's interleaved layout (Narayanan et al. 2021 §2.2): the model is cut into p·v
/// pieces dealt round-robin, virtual stage k on stage k % p as its chunk k / p.
std::vector<ChunkId> InterleavedChunks(int num_stages, int num_chunks);

/// ZB-V's layout (v = 2; Qi et al., "Pipeline Parallelism with Controllable Memory"):
/// virtual k < p is (k, 0), k ≥ p is (2p-1-k, 1). Stage 0 holds the first and the last
/// piece (embedding and head); the turn p-1 -> p stays on stage p-1, so it costs no transfer.
std::vector<ChunkId> VShapeChunks(int num_stages);

/// An action on a given stage: a node of the schedule's dependency graph.
struct StageAction {
  int stage = 0;
  Action action;
};

// NOTE [pipeline dependencies]
// The model is cut into p·v contiguous pieces, the virtual stages k = 0..p·v-1 in model
// order; virtual stage k runs on the chunk VirtualStages(schedule)[k] (with v = 1 virtual
// stage k is stage k). An action of chunk c on stage s belongs to k = VirtualStageOf(s, c)
// and may start once these finished:
//   F(mb) of k > 0:    F(mb) of k-1            (its input activation)
//   B(mb)/BW(mb) of k: F(mb) of k              (its stored activations), and
//                      the same kind of k+1    (its output gradient), if k < p·v-1
//   W(mb) of k:        B(mb) of k              (B queued W's GEMMs; their inputs are
//                                               the stored activations of F(mb))
// k-1 and k+1 may live on the same stage (ZB-V's turn at the bottom of the V): the
// dependency then orders two actions of one list and costs no transfer.
// B and BW never meet in one schedule (ValidateSchedule rejects the mix), so "the same
// kind of k+1" is always the action that produced the gradient. Dependencies() is the one
// implementation; the checker, the simulator and the executor all follow it.

/// The actions that must finish before `action` (whose .chunk names the chunk) may start on
/// `stage` of `schedule` (NOTE [pipeline dependencies]); at most two. Each names the stage
/// that runs it and, in its action's .chunk, the chunk. Throws std::out_of_range when the
/// schedule has no chunk `action.chunk` on `stage`.
std::vector<StageAction> Dependencies(const Schedule& schedule, int stage, const Action& action);

/// The one walk of a schedule in list order, which the checker (does every list run to
/// completion?) and the simulator (when does each action run?) share: visits the stages
/// round-robin and, on each, offers its next actions in list order to `try_run`, which
/// either runs one (returns true; its dependencies must have run) or says it cannot yet
/// (false: the stage waits). Stops when no stage can move; returns how many actions of each
/// stage ran (all of them unless the schedule deadlocks). Readiness only grows as actions
/// run, so the order of visits cannot change which actions run; and a `try_run` that takes
/// start = max(its dependencies' ends, the stage's previous end) gets the times a
/// time-ordered event queue would, since a start depends on nothing else.
std::vector<size_t> WalkInListOrder(const Schedule& schedule,
                                    const std::function<bool(int stage, const Action&)>& try_run);

/// True when the schedule splits backward into B and W (it has a B or W action); false
/// for fused BW schedules. The executor keeps a weight-gradient store only when true.
bool UsesSplitBackward(const Schedule& schedule);

// Generators. Each takes p = num_stages ≥ 1, m = num_microbatches ≥ 1 (any m; the
// bubble figures in the comments hold for m ≥ p, and for ZB-H2 m ≥ 2p-1) and
// v = num_chunks, the model chunks per stage, and throws std::invalid_argument otherwise,
// naming the schedule and what it cannot do — MakeSchedule checks p and m first and
// returns a Status. ZB-H2 runs one chunk (v = 1) only. The one-chunk schedules
// 1F1B, ZB-H1 and ZB-H2 share one shape
// (schedule.cc says why): stage s runs warmup(s) forwards, then for j = 0..m-1 the
// backward of micro-batch j, the W that lags it by lag(s) micro-batches, and the next
// forward; the W's still owed close the list. Stage s therefore holds at most
// warmup(s) + lag(s) micro-batches.

/// 1F1B (PipeDream-Flush; Narayanan et al., SC'21 §2.2.1): stage s runs min(p-s-1, m)
/// warm-up forwards, then alternates F and fused BW. Holds ≤ p-s micro-batches
/// (max_in_flight = p). Bubble per stage (p-1)(T_F + T_B + T_W).
/// With num_chunks = v > 1: interleaved 1F1B (§2.2) in Megatron-LM's order (NOTE
/// [interleaved 1F1B] in schedule.cc) on InterleavedChunks(p, v); m must be a multiple of
/// p (Megatron's rule). Holds ≤ min(m·v, (v+1)p - 1) chunk micro-batches; bubble per
/// stage (p-1)(T_F + T_B + T_W)/v with T the whole stage's costs.
Schedule OneFOneB(int num_stages, int num_microbatches, int num_chunks = 1);

/// ZB-H1 (Qi et al. 2024, §2.1): 1F1B's order of F and B, with W split off and run on
/// stage s right after the B that is s micro-batches later; the s W's still owed end the
/// list. Every stage holds ≤ p micro-batches, 1F1B's peak (max_in_flight = p). Bubble
/// per stage (p-1)·max(T_F, T_B, T_F + T_B - T_W): the paper's (p-1)(T_F + T_B - T_W)
/// whenever T_W ≤ min(T_F, T_B). The other two terms bind every schedule that holds ≤ p:
/// the last stage waits (p-1)T_F for its first input, and stage 0, full after p forwards,
/// waits (p-1)T_B for the first gradient.
/// With num_chunks = v > 1: interleaved ZB-H1 (NOTE [interleaved ZB-H1] in schedule.cc),
/// interleaved 1F1B's order with B/W split and stage s's W's 2s backwards late; m must be
/// a multiple of p; interleaved 1F1B's memory. Never slower than interleaved 1F1B in the
/// tests, and at the bound (p-1)T_F/v for p ≤ 4, m ≥ 2p without transfer time.
Schedule ZeroBubbleH1(int num_stages, int num_microbatches, int num_chunks = 1);

/// ZB-H2 (Qi et al. 2024, §2.2): stage s runs 2(p-s)-1 warm-up forwards so the first
/// backward finds it busy, then B, the W that lags it by 2s micro-batches, and F; the 2s
/// W's still owed end the list. Every stage holds ≤ 2p-1 micro-batches
/// (max_in_flight = 2p-1). With m ≥ 2p-1 the idle time inside each stage's own span is
/// (p-1)·max(0, T_B - T_F, T_F + T_B - 2T_W) — zero when F, B and W cost the same, the
/// paper's parallelogram; the bubble up to the end of the whole pipeline is
/// (p-1)·max(T_F, T_B - T_F, T_F + T_B - 2T_W) (at least the (p-1)T_F of the last stage
/// waiting for its first input), never more than ZB-H1's without transfer time.
///
/// With m < 2p-1 the parallelogram cannot form (§2.2 needs 2p-1 micro-batches in flight):
/// the warm-up is cut to m forwards, and the W lag to the rounds that still run a forward,
/// lag(s) = clamp(m - (2(p-s)-1), s, 2s) — between ZB-H1's s and the paper's 2s, and 2s
/// again from m = 2p-1 on. The paper's 2s there would defer W's past the last forward into
/// the tail, where each one lengthens the iteration (p=4, m=4, F=B=W=1: makespan 16 against
/// ZB-H1's 15; NOTE [ZB-H2 with few micro-batches] in schedule.cc). With this lag ZB-H2 is
/// never slower than ZB-H1 in the simulator for p ≤ 8, m ≤ 24 and the tested cost mixes:
/// as fast when F=B=W without transfer time, faster for some other costs (p=4, m=5, F=1,
/// B=2, W=1: 25 against 26). Stages still hold min(2p-1, m) micro-batches.
Schedule ZeroBubbleH2(int num_stages, int num_microbatches, int num_chunks = 1);

/// ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; the zero-bubble
/// authors' V schedule): two chunks per stage laid out as a V (VShapeChunks), B/W split,
/// at most 2p chunk micro-batches per stage — 1F1B's p full ones. The order comes from a
/// greedy list scheduler at unit costs (NOTE [ZB-V] in schedule.cc): B's first, then the
/// forward up the V, then the one down it while the stage has room, W's in the gaps. At
/// unit chunk costs its makespan is the lower bound 6m + p - 1 for p ∈ {2, 4, 8},
/// m ∈ {p, 2p, 4p} (tests). num_chunks must be 2, or 1 for "not set" (the V sets its own).
Schedule ZeroBubbleV(int num_stages, int num_microbatches, int num_chunks = 2);

/// ZB-V's greedy run at the given costs of one chunk action (F, B, W, all > 0) and transfer
/// time between stages, as the zero-bubble authors build theirs from profiled costs: the
/// rules are ZeroBubbleV's, a stage deciding whenever it is free from what has ended and
/// arrived by then; at other than unit costs the rules are also tried in two other orders
/// and the order whose timeline ends first is kept. The costs are first rounded to
/// 1/1024 of the mean action (NOTE [ZB-V on a grid] in schedule.cc), so costs that differ
/// by rounding noise build one order. ZeroBubbleV is
/// ZeroBubbleVAt(p, m, 1, 1, 1, 0). The unit-cost order
/// loses much of its lead once B costs more than F (p = 8, m = 32, F = 1.33, B = 1.67,
/// W = 1: bubble 21% against ZB-H1's 10%); the order built at those costs keeps it (tests).
/// Throws std::invalid_argument for bad sizes or costs.
Schedule ZeroBubbleVAt(int num_stages, int num_microbatches, double forward,
                       double backward_input, double backward_weight, double p2p);

/// Every order ZeroBubbleVAt's greedy builds at these costs — one per rule order tried, in
/// that order (one at unit costs) — of which ZeroBubbleVAt keeps the one whose own timeline
/// ends first. The greedy sees only one cost per action kind; a caller that knows each
/// virtual stage's own costs picks among these by simulating them (MeasuredVOrder,
/// pipeline/measured_order.h). Throws as ZeroBubbleVAt.
std::vector<Schedule> ZeroBubbleVOrdersAt(int num_stages, int num_microbatches, double forward,
                                          double backward_input, double backward_weight,
                                          double p2p);

/// `schedule` with its first `count` virtual stages forward-only (NOTE [forward-only
/// stages]): their B, BW and W actions removed, every other action in its place, and
/// max_in_flight unchanged. Precondition: 0 ≤ count < p·v (the last virtual stage holds the
/// head and the loss) and schedule.forward_only = 0; std::invalid_argument otherwise.
Schedule WithForwardOnlyPrefix(Schedule schedule, int count);

/// How many virtual stages run forward only when layers [0, frozen_prefix) are frozen:
/// the leading ones whose range (`ranges`: one [begin, end) per virtual stage, in model
/// order) ends at or before the prefix, never the last one (the head). 0 when
/// frozen_prefix is 0: the embedding then trains, even on an empty first stage.
int ForwardOnlyVirtualStages(const std::vector<std::pair<int64_t, int64_t>>& ranges,
                             int64_t frozen_prefix);

/// Builds a schedule from (num_stages, num_microbatches, num_chunks); registered by name.
using ScheduleGenerator =
    std::function<Schedule(int num_stages, int num_microbatches, int num_chunks)>;
using ScheduleRegistry = Registry<ScheduleGenerator>;

/// The schedule registered as `name` (--pipeline_schedule) for `num_stages`
/// (--pipeline_model_parallel_size) and `num_microbatches` (the micro-batch count
/// --global_batch_size / (--micro_batch_size × data-parallel size)) with `num_chunks`
/// model chunks per stage (--virtual_pipeline_model_parallel_size; 1 = no virtual
/// stages). InvalidArgument naming the flag for a count below 1 or a chunk count the
/// schedule cannot run (the generator's reason), NotFound listing the schedules for an
/// unknown name.
absl::StatusOr<Schedule> MakeSchedule(const std::string& name, int num_stages,
                                      int num_microbatches, int num_chunks = 1);

/// "1f1b, zbh1, zbh2" (for error messages).
std::string ScheduleNames();

/// One line per schedule, "  name  help", for --help.
std::string ScheduleHelp();

/// Checks everything an executor relies on: the shape (num_stages lists, counts ≥ 1,
/// virtual_stages empty with v = 1 or a permutation of all p·v (stage, chunk) pairs,
/// 0 ≤ forward_only < p·v); then stage by stage: micro-batch and chunk numbers in range,
/// fused BW and split B/W not mixed, every (micro-batch, chunk) pair exactly once per
/// action kind (F only on a forward-only virtual stage), each action after
/// its dependencies on the same stage (B/BW after its own F, W after its own B, and with a
/// V the F/B that turns on this stage after its partner), at most max_in_flight pairs
/// held; and last, that running every stage's list strictly in order, each action waiting
/// for its dependencies on other stages, finishes (no deadlock). InvalidArgument naming
/// the stage and the action otherwise, e.g. "schedule 'zbh1': stage 2: B5 before its F5"
/// (with v > 1 actions name their chunk: "B5.1").
absl::Status ValidateSchedule(const Schedule& schedule);

/// The most (micro-batch, chunk) pairs `stage` holds at once: a pair is held from its F
/// until its BW, or until its W in split schedules (W still reads the stored activations);
/// the F of a forward-only virtual stage holds nothing (NOTE [forward-only stages]).
/// With v = 1 this is the micro-batches held.
/// Precondition: 0 ≤ stage < schedule.stages.size() (std::out_of_range otherwise).
int PeakInFlight(const Schedule& schedule, int stage);

/// The most activation bytes `stage` holds at once when every held (micro-batch, chunk)
/// pair of chunk c holds chunk_bytes[c] (PeakInFlight's rule of what is held, weighted):
/// with chunks of unequal size a V's or a round-robin rank peaks below
/// PeakInFlight × its largest chunk. Precondition: chunk_bytes has num_chunks entries.
double PeakHeldBytes(const Schedule& schedule, int stage, const std::vector<double>& chunk_bytes);

/// The schedule a pipeline packed onto ONE stage runs for --pipeline_schedule=`name`:
/// `name` itself, but "zbv" (two chunks by construction) becomes "zbh1", its one-chunk form
/// with the same B/W split. One stage has nothing to interleave, so it runs one chunk.
std::string OneStageScheduleName(const std::string& name);

/// A header line and one line per stage, for logs, tests and debugging:
///   1f1b: 2 stages, 3 micro-batches, at most 2 in flight
///   stage 0: F0 F1 BW0 F2 BW1 BW2
///   stage 1: F0 BW0 F1 BW1 F2 BW2
/// With v > 1 the header names the chunks, a line gives the virtual stages in model order
/// as stage.chunk, and every action names its chunk:
///   1f1b: 2 stages, 2 micro-batches, 2 chunks per stage, at most 4 in flight
///   virtual stages: 0.0 1.0 0.1 1.1
///   stage 0: F0.0 F1.0 F0.1 ...
std::string FormatSchedule(const Schedule& schedule);

}  // namespace fulcrum::pipeline
