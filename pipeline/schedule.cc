// Schedule generators, the schedule registry and the checker. The registrations live in
// this file, next to MakeSchedule, so that any user of MakeSchedule links this translation
// unit and with it the registrations (a static library drops unreferenced objects).
#include "pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <ostream>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace fulcrum::pipeline {

FULCRUM_REGISTER(ScheduleGenerator, 1f1b,
                 "one-forward-one-backward (PipeDream-Flush, Megatron-LM): fused backward, "
                 "≤ p micro-batches in flight, bubble (p-1)(F+B+W); interleaved with v > 1 "
                 "(bubble (p-1)(F+B+W)/v)",
                 OneFOneB);
FULCRUM_REGISTER(ScheduleGenerator, zbh1,
                 "zero-bubble ZB-H1 (Qi et al. 2024 §2.1): B/W split, W deferred to fill the "
                 "tail; 1F1B's memory, bubble (p-1)(F+B-W); interleaved with v > 1",
                 ZeroBubbleH1);
FULCRUM_REGISTER(ScheduleGenerator, zbv,
                 "ZB-V (Qi et al. 2024, controllable memory): 2 chunks per stage in a V, B/W "
                 "split, 1F1B's memory (2p half-stage micro-batches), near-zero bubble",
                 ZeroBubbleV);
FULCRUM_REGISTER(ScheduleGenerator, zbh2,
                 "zero-bubble ZB-H2 (Qi et al. 2024 §2.2): extra warm-up forwards, ≤ 2p-1 "
                 "micro-batches in flight, no idle time inside a stage when F=B=W and m ≥ 2p-1; "
                 "never slower than zbh1",
                 ZeroBubbleH2);

const char* ActionKindName(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return "F";
    case ActionKind::kBackward:
      return "BW";
    case ActionKind::kBackwardInput:
      return "B";
    case ActionKind::kBackwardWeight:
      return "W";
  }
  return "?";
}

std::string Action::ToString(bool with_chunk) const {
  if (with_chunk || chunk != 0) return absl::StrCat(ActionKindName(kind), microbatch, ".", chunk);
  return absl::StrCat(ActionKindName(kind), microbatch);
}

std::ostream& operator<<(std::ostream& out, const Action& action) {
  return out << action.ToString();
}

std::vector<ChunkId> VirtualStages(const Schedule& schedule) {
  if (!schedule.virtual_stages.empty()) return schedule.virtual_stages;
  std::vector<ChunkId> identity(std::max(schedule.num_stages, 0));
  for (int k = 0; k < static_cast<int>(identity.size()); ++k) identity[k] = {k, 0};
  return identity;
}

int VirtualStageOf(const Schedule& schedule, int stage, int chunk) {
  if (schedule.virtual_stages.empty()) {
    return chunk == 0 && stage >= 0 && stage < schedule.num_stages ? stage : -1;
  }
  const auto it = std::find(schedule.virtual_stages.begin(), schedule.virtual_stages.end(),
                            ChunkId{stage, chunk});
  return it == schedule.virtual_stages.end()
             ? -1
             : static_cast<int>(it - schedule.virtual_stages.begin());
}

std::vector<ChunkId> InterleavedChunks(int num_stages, int num_chunks) {
  if (num_stages < 1 || num_chunks < 1) {
    throw std::invalid_argument(absl::StrCat("InterleavedChunks: needs at least 1 stage and 1 "
                                             "chunk, got ",
                                             num_stages, " and ", num_chunks));
  }
  std::vector<ChunkId> chunks(num_stages * num_chunks);
  for (int k = 0; k < static_cast<int>(chunks.size()); ++k) {
    chunks[k] = {k % num_stages, k / num_stages};
  }
  return chunks;
}

std::vector<ChunkId> VShapeChunks(int num_stages) {
  if (num_stages < 1) {
    throw std::invalid_argument(
        absl::StrCat("VShapeChunks: needs at least 1 stage, got ", num_stages));
  }
  const int p = num_stages;
  std::vector<ChunkId> chunks(2 * p);
  for (int k = 0; k < 2 * p; ++k) chunks[k] = k < p ? ChunkId{k, 0} : ChunkId{2 * p - 1 - k, 1};
  return chunks;
}

namespace {

// Dependencies() of the action at model-order index `virtual_stage` on `stage`, for a
// layout given as chunk_at(k) -> ChunkId over `num_virtual` virtual stages. A template so
// that v = 1 (the identity) needs no table and the checker can pass its own lookup.
template <typename ChunkAt>
std::vector<StageAction> DependenciesOn(const ChunkAt& chunk_at, int num_virtual,
                                        int virtual_stage, int stage, const Action& action) {
  const int mb = action.microbatch;
  const int k = virtual_stage;
  std::vector<StageAction> deps;
  switch (action.kind) {
    case ActionKind::kForward:
      if (k > 0) {
        const ChunkId before = chunk_at(k - 1);
        deps.push_back({before.stage, {ActionKind::kForward, mb, before.chunk}});
      }
      break;
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
      deps.push_back({stage, {ActionKind::kForward, mb, action.chunk}});
      if (k + 1 < num_virtual) {
        const ChunkId after = chunk_at(k + 1);
        deps.push_back({after.stage, {action.kind, mb, after.chunk}});
      }
      break;
    case ActionKind::kBackwardWeight:
      deps.push_back({stage, {ActionKind::kBackwardInput, mb, action.chunk}});
      break;
  }
  return deps;
}

ChunkId IdentityChunk(int k) { return {k, 0}; }

}  // namespace

std::vector<StageAction> Dependencies(const Schedule& schedule, int stage, const Action& action) {
  const int k = VirtualStageOf(schedule, stage, action.chunk);
  if (k < 0) {
    throw std::out_of_range(absl::StrCat("Dependencies: schedule '", schedule.name,
                                         "' has no chunk ", action.chunk, " on stage ", stage));
  }
  if (schedule.virtual_stages.empty()) {
    return DependenciesOn(IdentityChunk, schedule.num_stages, k, stage, action);
  }
  const std::vector<ChunkId>& layout = schedule.virtual_stages;
  return DependenciesOn([&layout](int i) { return layout[i]; }, static_cast<int>(layout.size()),
                        k, stage, action);
}

bool UsesSplitBackward(const Schedule& schedule) {
  for (const auto& actions : schedule.stages) {
    for (const Action& action : actions) {
      if (action.kind == ActionKind::kBackwardInput || action.kind == ActionKind::kBackwardWeight) {
        return true;
      }
    }
  }
  return false;
}

// ---------------------------------------------------------------------------------------
// Generators
//
// NOTE [one shape for three schedules]
// 1F1B, ZB-H1 and ZB-H2 differ only in two numbers per stage s: how many forwards run
// before the first backward (warmup) and by how many micro-batches each W trails its B
// (lag). Stage s runs
//     F(0) .. F(warmup-1),
//     then for j = 0..m-1:  B(j),  W(j-lag) if j ≥ lag,  F(warmup+j) if any is left,
//     then the lag W's still owed, oldest first
// (fused BW(j) instead of B(j)+W(j) when lag is 0 and the schedule does not split).
// A micro-batch is held from its F to its W (or BW): the stage holds warmup + lag of them
// (at most m) after the first lag rounds, and never more, as every later F follows a W.
//
//              warmup(s)    lag(s)   held
//   1F1B       p - s        0 (BW)   p - s      (the usual "p-s-1 warm-up forwards, then
//                                                F BW pairs": the first pair's F is the
//                                                p-s-th forward)
//   ZB-H1      p - s        s        p          (Qi et al. §2.1)
//   ZB-H2      2(p-s) - 1   2s       2p - 1     (Qi et al. §2.2), for m ≥ 2p-1; below,
//                                                lag(s) = clamp(m - (2(p-s)-1), s, 2s)
//                                                (NOTE [ZB-H2 with few micro-batches])
//
// Why these numbers (costs F, B, W; "slot" = one action when F = B = W).
// - 1F1B: stage s gets micro-batch 0 at s·F, and its gradient comes back at
//   p·F + (p-1-s)(B+W), since every stage below runs the full BW before passing it on.
//   The p-s forwards cannot fill that wait; each stage idles (p-1)(F+B+W) in all.
// - ZB-H1 keeps 1F1B's order of F and B and moves only W. With W off the critical path
//   the gradient comes back at p·F + (p-1-s)·B, B+W earlier per stage below. At the end,
//   stages 0..s-1 still run their last B for s·B after stage s ran its own; the s W's that
//   stage s deferred fill that time. Each stage idles (p-1)(F+B-W) in all (the tests give the
//   exact form for any costs). The deferred W's keep their activations, so stage s holds
//   (p-s) + s = p micro-batches: 1F1B's stage-0 peak, reached on every stage (§2.1).
// - ZB-H2 also fills the head: stage s runs forwards until its first gradient arrives at
//   p·F + (p-1-s)·B, i.e. 2(p-s)-1 of them when F = B, then B, W, F in turn. To close the
//   parallelogram in which every stage works m(F+B+W) without a gap, starting s slots
//   after stage 0 and ending s slots after it, stage s must run its last B 2s+1 slots
//   before its end, where its last gradient arrives (p-1-s) slots after the last stage's;
//   W(m-1) and 2s deferred W's fill those slots (§2.2). It holds (2(p-s)-1) + 2s = 2p-1.
// The simulator (schedule_simulator.h) reproduces these bubbles; the tests pin them.
//
// NOTE [ZB-H2 with few micro-batches]
// The parallelogram above needs m ≥ 2p-1. With fewer micro-batches the paper's lag of 2s
// made ZB-H2 slower than ZB-H1 (p=4, m=4, F=B=W=1: makespan 16 against 15). The cause is
// the lag, not the warm-up: stage s runs its other F's in the first m - warmup(s) rounds j
// ("F-rounds"; warmup(s) = min(2(p-s)-1, m)), and the rest are its cool-down, where it only
// waits for gradients. Deferring W's past ZB-H1's s rounds pays off inside the F-rounds: a
// round that runs no W runs its B and F back to back, so the forwards, and with them the
// stages below and the B chain, move earlier. A round of the cool-down has no F to move;
// deferring its W only takes it out of the gap before the next B, where it ran while the
// stage waited anyway, and puts it into the tail after the last B, where it lengthens the
// iteration. On stage 1 of p=4, m=4 (no F-rounds):
//     lag 2 (paper):  B0 . B1 . B2 W0 B3 W1 W2 W3    ends at 16
//     lag 1:          B0 . B1 W0 B2 W1 B3 W2 W3      ends at 15 (ZB-H1's makespan)
// So ZB-H2 defers each W by as many rounds as stage s has F-rounds, at least ZB-H1's s (the
// tail needs them: stages 0..s-1 run their last B's after stage s ran its own) and at most
// the paper's 2s:
//     lag(s) = clamp(m - (2(p-s)-1), s, 2s),
// which is 2s for every stage once m ≥ 2p-1: the paper's schedule is unchanged there. The
// warm-up stays ZB-H2's, and the stage still holds min(2p-1, m) micro-batches. Capping the
// warm-up instead does not help: with ZB-H1's warm-up and ZB-H2's lag, p=4, m=4 still takes
// 16; with ZB-H2's warm-up and ZB-H1's lag it takes 15. An exhaustive search (m < 2p-1;
// every per-stage warm-up in [p-s, 2(p-s)-1] and lag in [s, 2s] for p ≤ 4, every lag with
// ZB-H2's warm-up for p ≤ 6; ten cost mixes) found no choice that is never slower than
// ZB-H1 on those mixes and gains more in total than this rule, and none at all faster than
// ZB-H1 when F=B=W. With unequal costs the rule keeps ZB-H2's gains (p=4, m=5, F=1, B=2,
// W=1: 25 against ZB-H1's 26), which falling back to ZB-H1's lists below 2p-1 would give
// up. That ZB-H2 is never slower than ZB-H1 is checked in the simulator for every p ≤ 8,
// m ≤ 24 and a set of cost mixes with and without transfer time
// (schedule_simulator_test.cc), not proven. With m ≥ 2p-1 and no transfer time it follows
// from the closed-form bubbles (schedule.h); there, a transfer time comparable to the
// compute costs with T_W above T_F + T_B can still make ZB-H2 the slower one.

namespace {

// The one-chunk generators refuse v > 1 rather than silently ignoring it.
void RequireOneChunk(const std::string& name, int num_chunks) {
  if (num_chunks != 1) {
    throw std::invalid_argument(absl::StrCat(
        name, " schedule: runs one model chunk per stage, got ", num_chunks,
        " chunks per stage (--virtual_pipeline_model_parallel_size); it has no interleaved form"));
  }
}

// The shape of NOTE [one shape for three schedules]; `split` selects B+W over fused BW.
Schedule BuildSchedule(std::string name, int num_stages, int num_microbatches, int max_in_flight,
                       bool split, const std::function<int(int)>& warmup,
                       const std::function<int(int)>& lag) {
  if (num_stages < 1 || num_microbatches < 1) {
    throw std::invalid_argument(absl::StrCat(name,
                                             " schedule: needs at least 1 stage and 1 "
                                             "micro-batch, got ",
                                             num_stages, " and ", num_microbatches));
  }
  const int m = num_microbatches;
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.num_stages = num_stages;
  schedule.num_microbatches = m;
  schedule.max_in_flight = max_in_flight;
  schedule.stages.resize(num_stages);
  for (int s = 0; s < num_stages; ++s) {
    std::vector<Action>& actions = schedule.stages[s];
    actions.reserve(split ? 3 * m : 2 * m);
    const int stage_warmup = std::min(warmup(s), m);
    const int stage_lag = lag(s);
    int next_forward = 0;
    int next_weight = 0;
    while (next_forward < stage_warmup) actions.push_back({ActionKind::kForward, next_forward++});
    for (int j = 0; j < m; ++j) {
      if (split) {
        actions.push_back({ActionKind::kBackwardInput, j});
        if (j >= stage_lag) actions.push_back({ActionKind::kBackwardWeight, next_weight++});
      } else {
        actions.push_back({ActionKind::kBackward, j});
      }
      if (next_forward < m) actions.push_back({ActionKind::kForward, next_forward++});
    }
    while (split && next_weight < m) {
      actions.push_back({ActionKind::kBackwardWeight, next_weight++});
    }
  }
  return schedule;
}

// NOTE [interleaved 1F1B]
// Narayanan et al., SC'21 §2.2, as Megatron-LM's forward_backward_pipelining_with_interleaving
// runs it (facts taken from its source, not its code). Stage s holds chunks c = 0..v-1,
// chunk c being virtual stage c·p + s (InterleavedChunks). Every stage walks the same
// sequence of T = m·v "virtual micro-batches" i = 0..T-1, taken in groups of p·v: within
// a group, p consecutive micro-batches of chunk 0, then the same p of chunk 1, ...:
//     forward i:   chunk (i mod pv) div p,          micro-batch (i div pv)·p + i mod p
//     backward i:  chunk v-1 - (i mod pv) div p,    the same micro-batch
// (backwards visit the chunks from the last, as the gradient comes back through the model
// in reverse). The list is Megatron's 1F1B over that sequence:
//     forwards 0 .. warmup-1, then for j = 0..T-warmup-1: forward warmup+j, BW j,
//     then the remaining BW's,
// with warmup(s) = min(2(p-s-1) + (v-1)p, T), or all T when m = p (Megatron runs all
// forwards first then: its steady phase would have nothing to interleave). The (v-1)p term
// lets every stage run the whole first group of chunks 0..v-2 before the first gradient
// can come back; 2(p-s-1) covers the round trip from stage s to the last stage and back
// through the last chunk. Megatron requires m % p == 0 (its groups of p micro-batches per
// chunk must be whole), and so do we. Stage s holds warmup(s) + 1 chunk micro-batches at
// the first BW (the steady phase runs its forward first), at most (v+1)p - 1 on stage 0
// (or all T = pv when m = p): max_in_flight = min(m·v, (v+1)p - 1) chunk micro-batches,
// p + (p-1)/v full ones against 1F1B's p — interleaving buys its smaller bubble with a
// little memory.
// Bubble (§2.2): each chunk costs 1/v of a stage, the warm-up and cool-down ramps are
// p-1 chunk-steps long, so each stage idles (p-1)(T_F + T_B + T_W)/v, 1/v of 1F1B's
// (schedule_simulator_test.cc pins it at m % p == 0).
//
// NOTE [interleaved ZB-H1]
// The same order with each BW split into B and W, and stage s's W's deferred by 2s
// backwards: after B(j) comes the W of backward j - 2s (the W's still owed end the list).
// As ZB-H1 does for one chunk (its lag s), the W's fill the tail where stage s waits for
// the last gradients, which come back later on the stages nearer the end of the model. The
// lag is the most that keeps stage s within stage 0's peak: it holds warmup(s) + 1 + lag,
// and warmup(s) + 2s = warmup(0) (warmup falls by 2 per stage), so every stage holds at
// most interleaved 1F1B's (v+1)p - 1 (max_in_flight unchanged). The simulator shows what
// it gains (chunked_schedule_test.cc compares it with interleaved 1F1B and ZB-H1).
Schedule BuildInterleaved(const std::string& name, int num_stages, int num_microbatches,
                          int num_chunks, bool split) {
  const int p = num_stages;
  const int m = num_microbatches;
  const int v = num_chunks;
  if (p < 1 || m < 1) {
    throw std::invalid_argument(absl::StrCat(
        name, " schedule: needs at least 1 stage and 1 micro-batch, got ", p, " and ", m));
  }
  if (m % p != 0) {
    throw std::invalid_argument(absl::StrCat(
        name, " schedule: interleaved ", split ? "ZB-H1" : "1F1B", " (", v,
        " chunks per stage, --virtual_pipeline_model_parallel_size) needs the micro-batch "
        "count (",
        m, ") to be a multiple of the pipeline stages (--pipeline_model_parallel_size=", p,
        "), as in Megatron-LM: it runs the micro-batches in groups of p per chunk"));
  }
  const int total = m * v;
  const int group = p * v;
  auto microbatch_of = [&](int i) { return (i / group) * p + i % p; };
  auto forward_at = [&](int i) {
    return Action{ActionKind::kForward, microbatch_of(i), (i % group) / p};
  };
  auto backward_at = [&](int i) {
    return Action{split ? ActionKind::kBackwardInput : ActionKind::kBackward, microbatch_of(i),
                  v - 1 - (i % group) / p};
  };
  Schedule schedule;
  schedule.name = name;
  schedule.num_stages = p;
  schedule.num_microbatches = m;
  schedule.num_chunks = v;
  schedule.max_in_flight = std::min(total, (v + 1) * p - 1);
  schedule.virtual_stages = InterleavedChunks(p, v);
  schedule.stages.resize(p);
  for (int s = 0; s < p; ++s) {
    const int warmup = m == p ? total : std::min(2 * (p - s - 1) + (v - 1) * p, total);
    std::vector<Action>& actions = schedule.stages[s];
    actions.reserve(3 * total);
    const int lag = 2 * s;  // NOTE [interleaved ZB-H1]
    int next_weight = 0;
    auto backward = [&](int j) {
      actions.push_back(backward_at(j));
      if (split && j >= lag) {
        Action weight = backward_at(next_weight++);
        weight.kind = ActionKind::kBackwardWeight;
        actions.push_back(weight);
      }
    };
    for (int i = 0; i < warmup; ++i) actions.push_back(forward_at(i));
    for (int j = 0; j + warmup < total; ++j) {
      actions.push_back(forward_at(warmup + j));
      backward(j);
    }
    for (int j = std::max(total - warmup, 0); j < total; ++j) backward(j);
    while (split && next_weight < total) {
      Action weight = backward_at(next_weight++);
      weight.kind = ActionKind::kBackwardWeight;
      actions.push_back(weight);
    }
  }
  return schedule;
}

Schedule InterleavedOneFOneB(int num_stages, int num_microbatches, int num_chunks) {
  return BuildInterleaved("1f1b", num_stages, num_microbatches, num_chunks, /*split=*/false);
}

}  // namespace

Schedule OneFOneB(int num_stages, int num_microbatches, int num_chunks) {
  if (num_chunks > 1) return InterleavedOneFOneB(num_stages, num_microbatches, num_chunks);
  if (num_chunks < 1) {
    throw std::invalid_argument(
        absl::StrCat("1f1b schedule: needs at least 1 chunk per stage, got ", num_chunks));
  }
  const int p = num_stages;
  return BuildSchedule(
      "1f1b", p, num_microbatches, /*max_in_flight=*/p, /*split=*/false,
      [p](int s) { return p - s; }, [](int) { return 0; });
}

Schedule ZeroBubbleH1(int num_stages, int num_microbatches, int num_chunks) {
  if (num_chunks > 1) {
    return BuildInterleaved("zbh1", num_stages, num_microbatches, num_chunks, /*split=*/true);
  }
  if (num_chunks < 1) {
    throw std::invalid_argument(
        absl::StrCat("zbh1 schedule: needs at least 1 chunk per stage, got ", num_chunks));
  }
  const int p = num_stages;
  return BuildSchedule(
      "zbh1", p, num_microbatches, /*max_in_flight=*/p, /*split=*/true,
      [p](int s) { return p - s; }, [](int s) { return s; });
}

Schedule ZeroBubbleH2(int num_stages, int num_microbatches, int num_chunks) {
  RequireOneChunk("zbh2", num_chunks);
  const int p = num_stages;
  const int m = num_microbatches;
  // NOTE [ZB-H2 with few micro-batches]: defer W only as far as the F-rounds reach.
  return BuildSchedule(
      "zbh2", p, m, /*max_in_flight=*/2 * p - 1, /*split=*/true,
      [p](int s) { return 2 * (p - s) - 1; },
      [p, m](int s) { return std::clamp(m - (2 * (p - s) - 1), s, 2 * s); });
}


// NOTE [ZB-V]
// Qi et al., "Pipeline Parallelism with Controllable Memory" (2024), and the V schedule of
// the zero-bubble authors' repository (sail-sg/zero-bubble-pipeline-parallelism). Two
// chunks per stage in a V (VShapeChunks): chunk 0 runs down the stages 0 -> p-1, chunk 1
// back up p-1 -> 0, so stage 0 holds both the embedding and the head and the turn on
// stage p-1 is local. Backward is split (B, W) as in ZB-H1. Each of the 2p chunks holds
// 1/2 of a one-chunk stage's layers, so the limit of 2p chunk micro-batches per stage is
// 1F1B's p full ones.
//
// The authors build the order with a greedy list scheduler over simulated time. We do the
// same, with our own rules, by default at unit cost per chunk action (F = B = W = 1, no
// transfer time; ZeroBubbleVAt takes other costs): at every step t each stage that is free
// starts at most one action, seeing only what finished (and, from another stage, arrived)
// by t — so the stages' choices at one step do not depend on each other; a stage with
// nothing to run waits for the next end or arrival — chosen in this order:
//   1. a B whose gradient and own F are done — the older micro-batch first, B1 before B0
//      of the same one. B's gate the stages upstream in the model and hold no extra
//      memory, so they never wait.
//   2. an F1 (up the V) whose input is done, if the stage holds fewer than 2p pairs: it
//      moves the oldest micro-batch towards its first B.
//   3. an F0 (down the V) whose input is done, if the stage has room for it.
//      Without more, a stage could fill its 2p pairs with F0's and have no room for the F1
//      that the oldest of them waits for: a deadlock. It happens for none of p ≤ 24,
//      m ≤ 4p, but nothing proves it never does, so a run that deadlocks (a step at which
//      no stage can start anything) is redone with a reserve: an F0 only while one pair of
//      room stays free for an F1 the stage owes. With the reserve the oldest micro-batch
//      whose F1 is missing can always take it on every stage, then runs its B's (which
//      need no memory), then its W's free room again — it cannot deadlock. The reserve is
//      not the default because it is slower: it meets the bound below at fewer (p, m)
//      (at p = 8, m = 16 it takes 105 steps against 103).
//   4. the oldest W owed (W's fill the gaps; deferred W's keep their activations, which the
//      2p limit counts).
// The lists are the order in which the stages ran their actions. ValidateSchedule checks
// the result for every size the tests try; the simulator gives its makespan.
// Chunk micro-batches held: at most 2p (max_in_flight = 2p; when m is small, 2m).

namespace {

// NOTE [ZB-V on a grid]
// The greedy compares the instants at which actions end and arrive, and two paths to one
// instant (F + B + F against F + F + B) can differ in the last bit of a double: two orders
// built at costs that differ only in rounding could then differ (a test found two V's 3%
// apart in makespan, built from mean costs 1e-16 apart — the runner's from its loads, the
// re-packing decision's from its problem). So ZeroBubbleVAt first rounds F, B, W and the
// transfer time to whole multiples of a grid, 1/kVGridSteps of the mean action
// ((F + B + W) / 3; F, B and W at least one step), and the greedy runs on those whole
// numbers, where every sum is exact: the order depends on the costs to within ~0.1% of an
// action, never on their rounding. Unit costs are whole already (1024 steps each), so the
// unit-cost order is the one it always was.
constexpr double kVGridSteps = 1024;

// What one chunk action costs while the ZB-V order is built (NOTE [ZB-V]), in grid steps.
struct VCosts {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  double p2p = 0;
};

// The order in which a free stage tries the four rules of NOTE [ZB-V].
enum class VOrder {
  kBackwardFirst,            // 1 2 3 4: the default, and the only one at unit costs
  kForwardUpFirst,           // 2 1 3 4
  kWeightBeforeForwardDown,  // 1 2 4 3
};

// One stage's progress while the ZB-V order is built.
struct VStage {
  int forwards[2] = {0, 0};   // F's started, per chunk (each chunk's F's go in micro-batch order)
  int backwards[2] = {0, 0};  // B's started, per chunk
  std::vector<Action> owed_weights;  // B's whose W has not run, oldest first
  size_t next_weight = 0;
  int held = 0;
};

// NOTE [ZB-V]'s greedy; `reserve` keeps rule 3's room for an owed F1. False when the
// rules deadlock (a step at which no stage can start anything: nothing will change after).
bool BuildZeroBubbleV(int p, int m, const VCosts& cost, bool reserve, VOrder order,
                      Schedule& schedule, double& makespan) {
  const int limit = 2 * p;
  schedule = Schedule{};
  schedule.name = "zbv";
  schedule.num_stages = p;
  schedule.num_microbatches = m;
  schedule.num_chunks = 2;
  schedule.max_in_flight = std::min(limit, 2 * m);
  schedule.virtual_stages = VShapeChunks(p);
  schedule.stages.resize(p);

  // finish[stage][kind][chunk·m + mb]: when an action ends, -1 before it was placed.
  std::vector<std::vector<std::vector<double>>> finish(
      p, std::vector<std::vector<double>>(4 /* action kinds */, std::vector<double>(2 * m, -1)));
  // Time t sees what ended by t, plus a transfer from another stage.
  double t = 0;
  int s = 0;  // the stage deciding
  auto done_by = [&](int stage, ActionKind kind, int chunk, int mb, double now) {
    const double end = finish[stage][static_cast<int>(kind)][chunk * m + mb];
    return end >= 0 && end + (stage == s ? 0 : cost.p2p) <= now;
  };
  auto duration = [&](ActionKind kind) {
    return kind == ActionKind::kForward         ? cost.forward
           : kind == ActionKind::kBackwardInput ? cost.backward_input
                                                : cost.backward_weight;
  };
  std::vector<VStage> stages(p);
  std::vector<double> free_at(p, 0.0);
  std::vector<int> left(p, 6 * m);
  std::set<double> events;  // when an action ends or its output arrives elsewhere
  int remaining = p * 6 * m;
  while (remaining > 0) {
    // A round: every stage free at the earliest time t decides at once, seeing only what
    // ended (and arrived) by t — at unit costs, one step of the description above.
    t = std::numeric_limits<double>::infinity();
    for (int i = 0; i < p; ++i) {
      if (left[i] > 0) t = std::min(t, free_at[i]);
    }
    std::vector<Action> chosen(p);
    std::vector<bool> runs(p, false);
    std::vector<bool> deciding(p, false);
    for (s = 0; s < p; ++s) {
      if (left[s] == 0 || free_at[s] != t) continue;
      deciding[s] = true;
      VStage& st = stages[s];
      auto b_ready = [&](int chunk) {
        const int j = st.backwards[chunk];
        if (j >= st.forwards[chunk] || !done_by(s, ActionKind::kForward, chunk, j, t)) return false;
        if (chunk == 1) {
          return s == 0 || done_by(s - 1, ActionKind::kBackwardInput, 1, j, t);
        }
        return s == p - 1 ? done_by(s, ActionKind::kBackwardInput, 1, j, t)
                          : done_by(s + 1, ActionKind::kBackwardInput, 0, j, t);
      };
      // 1. A B: the older micro-batch first; B1(j) comes before B0(j) anyway.
      auto try_b = [&]() {
        const bool b0 = b_ready(0);
        const bool b1 = b_ready(1);
        if (!b0 && !b1) return false;
        const int chunk = b0 && (!b1 || st.backwards[0] < st.backwards[1]) ? 0 : 1;
        chosen[s] = {ActionKind::kBackwardInput, st.backwards[chunk], chunk};
        return true;
      };
      // 2. F1, up the V.
      auto try_f1 = [&]() {
        const int j1 = st.forwards[1];
        if (j1 < st.forwards[0] && st.held < limit &&
            (s == p - 1 ? done_by(s, ActionKind::kForward, 0, j1, t)
                        : done_by(s + 1, ActionKind::kForward, 1, j1, t))) {
          chosen[s] = {ActionKind::kForward, j1, 1};
          return true;
        }
        return false;
      };
      // 3. F0, down the V, keeping room for an F1 owed.
      auto try_f0 = [&]() {
        const int j0 = st.forwards[0];
        const bool owes_f1 = st.forwards[1] < st.forwards[0];
        if (j0 < m && st.held + 1 + (reserve && owes_f1 ? 1 : 0) <= limit &&
            (s == 0 || done_by(s - 1, ActionKind::kForward, 0, j0, t))) {
          chosen[s] = {ActionKind::kForward, j0, 0};
          return true;
        }
        return false;
      };
      // 4. The oldest W owed.
      auto try_w = [&]() {
        if (st.next_weight < st.owed_weights.size()) {
          const Action& b = st.owed_weights[st.next_weight];
          chosen[s] = {ActionKind::kBackwardWeight, b.microbatch, b.chunk};
          return true;
        }
        return false;
      };
      switch (order) {
        case VOrder::kBackwardFirst:
          runs[s] = try_b() || try_f1() || try_f0() || try_w();
          break;
        case VOrder::kForwardUpFirst:
          runs[s] = try_f1() || try_b() || try_f0() || try_w();
          break;
        case VOrder::kWeightBeforeForwardDown:
          runs[s] = try_b() || try_f1() || try_w() || try_f0();
          break;
      }
    }
    for (s = 0; s < p; ++s) {
      if (!runs[s]) continue;
      VStage& st = stages[s];
      const Action& action = chosen[s];
      const double end = t + duration(action.kind);
      finish[s][static_cast<int>(action.kind)][action.chunk * m + action.microbatch] = end;
      events.insert(end);
      events.insert(end + cost.p2p);
      free_at[s] = end;
      schedule.stages[s].push_back(action);
      --left[s];
      --remaining;
      switch (action.kind) {
        case ActionKind::kForward:
          ++st.forwards[action.chunk];
          ++st.held;
          break;
        case ActionKind::kBackwardInput:
          ++st.backwards[action.chunk];
          st.owed_weights.push_back(action);
          break;
        case ActionKind::kBackwardWeight:
          ++st.next_weight;
          --st.held;
          break;
        case ActionKind::kBackward:
          break;
      }
    }
    // A stage that found nothing to run waits for the next end or arrival; with none to
    // come, nothing will ever change: the rules deadlocked.
    const auto next = events.upper_bound(t);
    for (s = 0; s < p; ++s) {
      if (!deciding[s] || runs[s]) continue;
      if (next == events.end()) return false;
      free_at[s] = *next;
    }
  }
  makespan = *std::max_element(free_at.begin(), free_at.end());
  return true;
}

}  // namespace

Schedule ZeroBubbleV(int num_stages, int num_microbatches, int num_chunks) {
  const int p = num_stages;
  const int m = num_microbatches;
  if (num_chunks != 1 && num_chunks != 2) {
    throw std::invalid_argument(absl::StrCat(
        "zbv schedule: ZB-V runs exactly 2 chunks per stage (a V), got ", num_chunks,
        " (--virtual_pipeline_model_parallel_size must be 1 or 2 with zbv)"));
  }
  if (p < 1 || m < 1) {
    throw std::invalid_argument(absl::StrCat(
        "zbv schedule: needs at least 1 stage and 1 micro-batch, got ", p, " and ", m));
  }
  return ZeroBubbleVAt(p, m, 1, 1, 1, 0);
}

namespace {

// The greedy's orders at these costs with their own makespans (NOTE [ZB-V]).
std::vector<std::pair<Schedule, double>> BuildVOrders(int p, int m, double forward,
                                                      double backward_input,
                                                      double backward_weight, double p2p) {
  if (p < 1 || m < 1) {
    throw std::invalid_argument(absl::StrCat(
        "zbv schedule: needs at least 1 stage and 1 micro-batch, got ", p, " and ", m));
  }
  for (double c : {forward, backward_input, backward_weight}) {
    if (!std::isfinite(c) || c <= 0) {
      throw std::invalid_argument(absl::StrCat(
          "zbv schedule: action costs must be finite and > 0, got F=", forward,
          " B=", backward_input, " W=", backward_weight));
    }
  }
  if (!std::isfinite(p2p) || p2p < 0) {
    throw std::invalid_argument(
        absl::StrCat("zbv schedule: the transfer time must be finite and ≥ 0, got ", p2p));
  }
  // NOTE [ZB-V on a grid]: the greedy runs on whole multiples of 1/kVGridSteps of the mean
  // action, where every sum of times is exact.
  const double grid = (forward + backward_input + backward_weight) / 3 / kVGridSteps;
  auto on_grid = [grid](double c) { return std::max(1.0, std::round(c / grid)); };
  const VCosts cost{on_grid(forward), on_grid(backward_input), on_grid(backward_weight),
                    std::round(p2p / grid)};
  const bool unit = cost.forward == cost.backward_input &&
                    cost.backward_input == cost.backward_weight && cost.p2p == 0;
  // NOTE [ZB-V]: at other than unit costs the rules are also tried in two other orders, as
  // the authors try a few variants of their greedy; the reserve only when none finishes.
  std::vector<VOrder> orders = {VOrder::kBackwardFirst};
  if (!unit) {
    orders.push_back(VOrder::kForwardUpFirst);
    orders.push_back(VOrder::kWeightBeforeForwardDown);
  }
  std::vector<std::pair<Schedule, double>> built;
  for (bool reserve : {false, true}) {
    for (VOrder order : orders) {
      Schedule schedule;
      double makespan = 0;
      if (BuildZeroBubbleV(p, m, cost, reserve, order, schedule, makespan)) {
        built.emplace_back(std::move(schedule), makespan);
      }
    }
    if (!built.empty()) return built;
  }
  throw std::logic_error(absl::StrCat("zbv schedule: the greedy order deadlocked for p=", p,
                                      ", m=", m, " even with the reserve"));
}

}  // namespace

Schedule ZeroBubbleVAt(int num_stages, int num_microbatches, double forward,
                       double backward_input, double backward_weight, double p2p) {
  std::vector<std::pair<Schedule, double>> built =
      BuildVOrders(num_stages, num_microbatches, forward, backward_input, backward_weight, p2p);
  // The order whose own timeline ends first (ties: the earlier rule order).
  size_t best = 0;
  for (size_t k = 1; k < built.size(); ++k) {
    if (built[k].second < built[best].second) best = k;
  }
  return std::move(built[best].first);
}

std::vector<Schedule> ZeroBubbleVOrdersAt(int num_stages, int num_microbatches, double forward,
                                          double backward_input, double backward_weight,
                                          double p2p) {
  std::vector<Schedule> out;
  for (auto& [schedule, makespan] :
       BuildVOrders(num_stages, num_microbatches, forward, backward_input, backward_weight, p2p)) {
    out.push_back(std::move(schedule));
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Registry

absl::StatusOr<Schedule> MakeSchedule(const std::string& name, int num_stages,
                                      int num_microbatches, int num_chunks) {
  const ScheduleRegistry::Entry* entry = ScheduleRegistry::Global().Find(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("--pipeline_schedule=", name,
                                            " is not a known schedule; known: ", ScheduleNames()));
  }
  if (num_stages < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--pipeline_model_parallel_size=", num_stages,
                                                   " must be ≥ 1 (pipeline stages)"));
  }
  if (num_microbatches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the micro-batch count per iteration is ", num_microbatches,
        "; it must be ≥ 1 (it is --global_batch_size / (--micro_batch_size × data-parallel "
        "size))"));
  }
  if (num_chunks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--virtual_pipeline_model_parallel_size=", num_chunks,
                     " must be ≥ 1 (model chunks per pipeline stage; 1 = no virtual stages)"));
  }
  try {
    return entry->value(num_stages, num_microbatches, num_chunks);
  } catch (const std::invalid_argument& e) {
    // A generator that cannot build this (p, m, v) says why.
    return absl::InvalidArgumentError(e.what());
  }
}

Schedule WithForwardOnlyPrefix(Schedule schedule, int count) {
  const int virtual_stages = schedule.num_stages * schedule.num_chunks;
  if (count < 0 || count >= virtual_stages) {
    throw std::invalid_argument(absl::StrCat(
        "schedule '", schedule.name, "': ", count, " forward-only virtual stages of ",
        virtual_stages, "; the last one (the head) always runs a backward"));
  }
  if (schedule.forward_only != 0) {
    throw std::invalid_argument(absl::StrCat("schedule '", schedule.name,
                                             "' already has forward-only virtual stages"));
  }
  schedule.forward_only = count;
  if (count == 0) return schedule;
  const std::vector<ChunkId> layout = VirtualStages(schedule);
  std::vector<std::vector<bool>> forward_only(schedule.num_stages,
                                              std::vector<bool>(schedule.num_chunks, false));
  for (int k = 0; k < count; ++k) forward_only[layout[k].stage][layout[k].chunk] = true;
  for (int s = 0; s < schedule.num_stages; ++s) {
    std::vector<Action>& actions = schedule.stages[s];
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [&](const Action& a) {
                                   return a.kind != ActionKind::kForward &&
                                          forward_only[s][a.chunk];
                                 }),
                  actions.end());
  }
  return schedule;
}

int ForwardOnlyVirtualStages(const std::vector<std::pair<int64_t, int64_t>>& ranges,
                             int64_t frozen_prefix) {
  if (frozen_prefix <= 0) return 0;
  int count = 0;
  while (count + 1 < static_cast<int>(ranges.size()) && ranges[count].second <= frozen_prefix) {
    ++count;
  }
  return count;
}

std::string ScheduleNames() { return ScheduleRegistry::Global().Names(); }

std::string ScheduleHelp() {
  std::string out;
  for (const ScheduleRegistry::Entry* entry : ScheduleRegistry::Global().List()) {
    absl::StrAppendFormat(&out, "  %-6s %s\n", entry->name, entry->help);
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Checker

namespace {

// Tables indexed by [KindIndex(kind)][chunk · m + micro-batch].

// +1 for a (micro-batch, chunk) pair that starts being held, -1 for one that is released,
// 0 otherwise (PeakInFlight's definition).
int InFlightDelta(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return 1;
    case ActionKind::kBackward:
    case ActionKind::kBackwardWeight:
      return -1;
    case ActionKind::kBackwardInput:
      return 0;
  }
  return 0;
}

std::string Prefix(const Schedule& schedule) {
  return absl::StrCat("schedule '", schedule.name, "': ");
}

absl::Status StageError(const Schedule& schedule, int stage, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(Prefix(schedule), "stage ", stage, ": ", message));
}

// The checker's view of a schedule whose shape (counts, layout) passed: the layout and its
// inverse, looked up once; actions named with their chunk when there are several.
class Checked {
 public:
  explicit Checked(const Schedule& schedule)
      : schedule_(schedule),
        layout_(VirtualStages(schedule)),
        virtual_of_(schedule.num_stages, std::vector<int>(schedule.num_chunks, -1)) {
    for (int k = 0; k < static_cast<int>(layout_.size()); ++k) {
      virtual_of_[layout_[k].stage][layout_[k].chunk] = k;
    }
  }

  const Schedule& schedule() const { return schedule_; }
  int num_pairs() const { return schedule_.num_chunks * schedule_.num_microbatches; }
  // Index of (chunk, micro-batch) in the tables.
  int Pair(const Action& action) const {
    return action.chunk * schedule_.num_microbatches + action.microbatch;
  }
  std::string Name(const Action& action) const {
    return action.ToString(schedule_.num_chunks > 1);
  }
  // NOTE [forward-only stages]: chunk `chunk` of `stage` runs forward only.
  bool ForwardOnly(int stage, int chunk) const {
    return virtual_of_[stage][chunk] < schedule_.forward_only;
  }
  int VirtualOf(int stage, int chunk) const { return virtual_of_[stage][chunk]; }
  std::vector<StageAction> Deps(int stage, const Action& action) const {
    return DependenciesOn([this](int k) { return layout_[k]; }, static_cast<int>(layout_.size()),
                          virtual_of_[stage][action.chunk], stage, action);
  }

 private:
  const Schedule& schedule_;
  std::vector<ChunkId> layout_;
  std::vector<std::vector<int>> virtual_of_;  // [stage][chunk] -> k
};

// virtual_stages: empty (v = 1 only) or every (stage, chunk) pair exactly once.
absl::Status ValidateLayout(const Schedule& schedule) {
  const int p = schedule.num_stages;
  const int v = schedule.num_chunks;
  if (schedule.virtual_stages.empty()) {
    if (v == 1) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        Prefix(schedule), "has ", v, " chunks per stage but no virtual_stages (model order)"));
  }
  if (static_cast<int>(schedule.virtual_stages.size()) != p * v) {
    return absl::InvalidArgumentError(
        absl::StrCat(Prefix(schedule), "has ", schedule.virtual_stages.size(),
                     " virtual stages for ", p, " stages × ", v, " chunks"));
  }
  std::vector<std::vector<int>> seen(p, std::vector<int>(v, -1));
  for (int k = 0; k < p * v; ++k) {
    const ChunkId& id = schedule.virtual_stages[k];
    if (id.stage < 0 || id.stage >= p || id.chunk < 0 || id.chunk >= v) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%svirtual stage %d is stage %d chunk %d, outside stages 0..%d, chunks 0..%d",
          Prefix(schedule), k, id.stage, id.chunk, p - 1, v - 1));
    }
    if (seen[id.stage][id.chunk] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%svirtual stages %d and %d are both stage %d chunk %d", Prefix(schedule),
                          seen[id.stage][id.chunk], k, id.stage, id.chunk));
    }
    seen[id.stage][id.chunk] = k;
  }
  return absl::OkStatus();
}

// Which backward form the schedule uses, fixed by its first backward action in stage
// order, so that a mix is reported at the first action that breaks the pattern.
struct BackwardForm {
  bool split = false;
  int stage = 0;
  Action first;
};

BackwardForm FindBackwardForm(const Schedule& schedule) {
  for (int s = 0; s < static_cast<int>(schedule.stages.size()); ++s) {
    for (const Action& action : schedule.stages[s]) {
      if (action.kind != ActionKind::kForward) {
        return {action.kind != ActionKind::kBackward, s, action};
      }
    }
  }
  return {};  // no backward at all: every BW will be reported missing
}

// Everything that can be checked on one stage's list alone: range, form, completeness,
// order within the stage and the in-flight limit.
absl::Status ValidateStage(const Checked& checked, int stage, const BackwardForm& form) {
  const Schedule& schedule = checked.schedule();
  const int m = schedule.num_microbatches;
  const int v = schedule.num_chunks;
  const std::vector<Action>& actions = schedule.stages[stage];
  // seen[kind][pair]: how often the action occurs; filled first so that a missing action is
  // reported as missing rather than as "out of order".
  std::vector<std::vector<int>> seen(kNumActionKinds, std::vector<int>(checked.num_pairs(), 0));
  for (const Action& action : actions) {
    if (action.microbatch < 0 || action.microbatch >= m) {
      return StageError(schedule, stage,
                        absl::StrCat(checked.Name(action), " names micro-batch ",
                                     action.microbatch, ", outside 0..", m - 1));
    }
    if (action.chunk < 0 || action.chunk >= v) {
      return StageError(schedule, stage,
                        absl::StrCat(checked.Name(action), " names chunk ", action.chunk,
                                     ", outside 0..", v - 1, " (", v, " chunks per stage)"));
    }
    if (action.kind != ActionKind::kForward) {
      const bool split = action.kind != ActionKind::kBackward;
      if (split != form.split) {
        return StageError(
            schedule, stage,
            absl::StrCat(checked.Name(action), " mixes ", split ? "split B/W" : "fused BW",
                         " backward into a schedule whose backward is ",
                         form.split ? "split into B and W" : "fused BW", " (stage ", form.stage,
                         ": ", checked.Name(form.first), ")"));
      }
    }
    if (++seen[KindIndex(action.kind)][checked.Pair(action)] == 2) {
      return StageError(schedule, stage, absl::StrCat(checked.Name(action), " appears twice"));
    }
  }
  std::vector<ActionKind> required = {ActionKind::kForward};
  if (form.split) {
    required.push_back(ActionKind::kBackwardInput);
    required.push_back(ActionKind::kBackwardWeight);
  } else {
    required.push_back(ActionKind::kBackward);
  }
  for (ActionKind kind : required) {
    for (int chunk = 0; chunk < v; ++chunk) {
      for (int mb = 0; mb < m; ++mb) {
        const Action action{kind, mb, chunk};
        const bool wanted = kind == ActionKind::kForward || !checked.ForwardOnly(stage, chunk);
        const int count = seen[KindIndex(kind)][checked.Pair(action)];
        if (wanted && count == 0) {
          return StageError(schedule, stage, absl::StrCat(checked.Name(action), " is missing"));
        }
        if (!wanted && count > 0) {
          return StageError(
              schedule, stage,
              absl::StrCat(checked.Name(action), " on virtual stage ",
                           checked.VirtualOf(stage, chunk), ", which runs forward only (",
                           schedule.forward_only, " forward-only virtual stages)"));
        }
      }
    }
  }

  // Order within the stage, and the pairs held.
  std::vector<std::vector<bool>> done(kNumActionKinds,
                                      std::vector<bool>(checked.num_pairs(), false));
  int held = 0;
  for (const Action& action : actions) {
    for (const StageAction& dep : checked.Deps(stage, action)) {
      if (dep.stage == stage && !done[KindIndex(dep.action.kind)][checked.Pair(dep.action)]) {
        return StageError(schedule, stage,
                          absl::StrCat(checked.Name(action), " before its ",
                                       checked.Name(dep.action)));
      }
    }
    done[KindIndex(action.kind)][checked.Pair(action)] = true;
    if (!checked.ForwardOnly(stage, action.chunk)) held += InFlightDelta(action.kind);
    if (held > schedule.max_in_flight) {
      return StageError(schedule, stage,
                        absl::StrFormat("%s holds %d %s in flight, above the "
                                        "schedule's limit of %d",
                                        checked.Name(action), held,
                                        v > 1 ? "chunk micro-batches" : "micro-batches",
                                        schedule.max_in_flight));
    }
  }
  return absl::OkStatus();
}

// Runs every stage's list strictly in order, an action only once its dependencies on other
// stages finished, until nothing can move; durations do not matter for whether this
// terminates. Reports every stage that is stuck, with what it waits for.
absl::Status CheckRunsToCompletion(const Checked& checked) {
  const Schedule& schedule = checked.schedule();
  const int p = schedule.num_stages;
  // finished[stage][kind][pair]
  std::vector<std::vector<std::vector<bool>>> finished(
      p, std::vector<std::vector<bool>>(kNumActionKinds,
                                        std::vector<bool>(checked.num_pairs(), false)));
  auto is_finished = [&](const StageAction& node) {
    return finished[node.stage][KindIndex(node.action.kind)][checked.Pair(node.action)];
  };
  const std::vector<size_t> next = WalkInListOrder(schedule, [&](int s, const Action& action) {
    const std::vector<StageAction> deps = checked.Deps(s, action);
    if (!std::all_of(deps.begin(), deps.end(), is_finished)) return false;
    finished[s][KindIndex(action.kind)][checked.Pair(action)] = true;
    return true;
  });
  std::vector<std::string> stuck;
  for (int s = 0; s < p; ++s) {
    if (next[s] == schedule.stages[s].size()) continue;
    const Action& action = schedule.stages[s][next[s]];
    for (const StageAction& dep : checked.Deps(s, action)) {
      if (is_finished(dep)) continue;
      stuck.push_back(absl::StrCat("stage ", s, " is stuck at ", checked.Name(action),
                                   " waiting for ", checked.Name(dep.action), " on stage ",
                                   dep.stage));
      break;
    }
  }
  if (stuck.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Prefix(schedule), "deadlock: ", absl::StrJoin(stuck, "; ")));
}

}  // namespace

std::vector<size_t> WalkInListOrder(const Schedule& schedule,
                                    const std::function<bool(int stage, const Action&)>& try_run) {
  const int p = static_cast<int>(schedule.stages.size());
  std::vector<size_t> next(p, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < p; ++s) {
      const std::vector<Action>& actions = schedule.stages[s];
      while (next[s] < actions.size() && try_run(s, actions[next[s]])) {
        ++next[s];
        moved = true;
      }
    }
  }
  return next;
}

absl::Status ValidateSchedule(const Schedule& schedule) {
  if (schedule.num_stages < 1 || schedule.num_microbatches < 1 || schedule.max_in_flight < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(Prefix(schedule), "num_stages=", schedule.num_stages,
                     ", num_microbatches=", schedule.num_microbatches,
                     ", max_in_flight=", schedule.max_in_flight, "; each must be ≥ 1"));
  }
  if (schedule.num_chunks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        Prefix(schedule), "num_chunks=", schedule.num_chunks, "; it must be ≥ 1"));
  }
  if (static_cast<int>(schedule.stages.size()) != schedule.num_stages) {
    return absl::InvalidArgumentError(
        absl::StrCat(Prefix(schedule), "has ", schedule.stages.size(),
                     " stage lists for num_stages=", schedule.num_stages));
  }
  if (absl::Status status = ValidateLayout(schedule); !status.ok()) return status;
  if (schedule.forward_only < 0 || schedule.forward_only >= schedule.num_stages * schedule.num_chunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        Prefix(schedule), "forward_only=", schedule.forward_only, " outside 0..",
        schedule.num_stages * schedule.num_chunks - 1,
        " (the last virtual stage holds the head and always runs a backward)"));
  }
  const Checked checked(schedule);
  const BackwardForm form = FindBackwardForm(schedule);
  for (int s = 0; s < schedule.num_stages; ++s) {
    if (absl::Status status = ValidateStage(checked, s, form); !status.ok()) return status;
  }
  return CheckRunsToCompletion(checked);
}

bool RunsForwardOnly(const Schedule& schedule, int stage, int chunk) {
  if (schedule.forward_only <= 0) return false;
  const int k = VirtualStageOf(schedule, stage, chunk);
  return k >= 0 && k < schedule.forward_only;
}

int PeakInFlight(const Schedule& schedule, int stage) {
  int held = 0;
  int peak = 0;
  for (const Action& action : schedule.stages.at(stage)) {
    // NOTE [forward-only stages]: such a forward holds nothing.
    if (RunsForwardOnly(schedule, stage, action.chunk)) continue;
    held += InFlightDelta(action.kind);
    peak = std::max(peak, held);
  }
  return peak;
}

double PeakHeldBytes(const Schedule& schedule, int stage, const std::vector<double>& chunk_bytes) {
  double held = 0;
  double peak = 0;
  for (const Action& action : schedule.stages.at(stage)) {
    if (RunsForwardOnly(schedule, stage, action.chunk)) continue;
    held += InFlightDelta(action.kind) * chunk_bytes.at(action.chunk);
    peak = std::max(peak, held);
  }
  return peak;
}

std::string OneStageScheduleName(const std::string& name) { return name == "zbv" ? "zbh1" : name; }

std::string FormatSchedule(const Schedule& schedule) {
  const bool chunks = schedule.num_chunks > 1;
  std::string out;
  if (!chunks) {
    out = absl::StrFormat("%s: %d stages, %d micro-batches, at most %d in flight", schedule.name,
                          schedule.num_stages, schedule.num_microbatches,
                          schedule.max_in_flight);
  } else {
    out = absl::StrFormat("%s: %d stages, %d micro-batches, %d chunks per stage, at most %d in "
                          "flight",
                          schedule.name, schedule.num_stages, schedule.num_microbatches,
                          schedule.num_chunks, schedule.max_in_flight);
    absl::StrAppend(&out, "\nvirtual stages:");
    for (const ChunkId& id : schedule.virtual_stages) {
      absl::StrAppend(&out, " ", id.stage, ".", id.chunk);
    }
  }
  if (schedule.forward_only > 0) {
    absl::StrAppend(&out, "\nforward only: virtual stages 0..", schedule.forward_only - 1);
  }
  // Pad the stage numbers so that the lists of a deep pipeline line up.
  const size_t last_stage = schedule.stages.empty() ? 0 : schedule.stages.size() - 1;
  const int width = static_cast<int>(std::to_string(last_stage).size());
  for (size_t s = 0; s < schedule.stages.size(); ++s) {
    absl::StrAppendFormat(&out, "\nstage %*d:", width, s);
    for (const Action& action : schedule.stages[s]) {
      absl::StrAppend(&out, " ", action.ToString(chunks));
    }
  }
  return out;
}

}  // namespace fulcrum::pipeline
