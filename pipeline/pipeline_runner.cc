#include "pipeline/pipeline_runner.h"

#include <chrono>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "core/status.h"
#include "pipeline/load_trace.h"

namespace fulcrum::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Columns of a stage's record in GatherLoads: fixed fields, then kPerLayer per global layer.
enum Column : int64_t {
  kBegin,
  kEnd,
  kForward,
  kBackward,
  kWeight,
  kWait,
  kTotal,
  kParameterBytes,
  kGradientBytes,
  kOptimizerBytes,
  kPeakActivationBytes,
  kPinnedParameters,
  kFixedColumns,
};
enum LayerColumn : int64_t {
  kLayerForward,
  kLayerBackward,
  kLayerWeight,
  kLayerState,
  kLayerBlockLoad,
  kLayerParameters,
  kLayerActivation,
  kPerLayer
};

// What a unit keeps between iterations (StageLoad's state bytes).
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
};

StateBytes UnitStateBytes(const Unit& unit) {
  StateBytes out;
  for (const Parameter& p : unit.parameters()) {
    const int64_t bytes = p.value.numel() * static_cast<int64_t>(p.value.element_size());
    out.parameters += bytes;
    if (!p.value.requires_grad()) continue;
    out.gradients += bytes;                                      // same dtype as the value
    out.optimizer += 2 * p.value.numel() * static_cast<int64_t>(sizeof(float));  // AdamW m, v
  }
  for (const auto& [name, buffer] : unit.buffers()) {
    out.parameters += buffer.numel() * static_cast<int64_t>(buffer.element_size());
  }
  return out;
}

// Trainable scalars of a unit (the parameter measure of the load model).
double TrainableParameters(const Unit& unit) {
  double n = 0;
  for (const Parameter& p : unit.parameters()) {
    if (p.value.requires_grad()) n += static_cast<double>(p.value.numel());
  }
  return n;
}

}  // namespace

std::vector<std::pair<int, int>> VirtualOwners(const Schedule& schedule) {
  std::vector<std::pair<int, int>> owners;
  for (const ChunkId& id : VirtualStages(schedule)) owners.emplace_back(id.stage, id.chunk);
  return owners;
}

LayerRanges EvenVirtualRanges(int64_t num_layers, int virtual_stages) {
  LayerRanges ranges;
  for (int k = 0; k < virtual_stages; ++k) {
    const StageSpec spec = EvenStage(num_layers, virtual_stages, k);
    ranges.emplace_back(spec.layer_begin, spec.layer_end);
  }
  return ranges;
}

StageSpec ChunkedStage(const Schedule& schedule, const LayerRanges& ranges, int stage) {
  return StageOfChunks(ranges, VirtualOwners(schedule), stage);
}

PipelineRunner::PipelineRunner(parallel::Communicator* pp, std::string schedule_name,
                               int64_t micro_batch_size, std::unique_ptr<Rebalancer> rebalancer,
                               std::vector<parallel::Communicator*> replica_groups,
                               int num_chunks)
    : pp_(pp),
      schedule_name_(std::move(schedule_name)),
      num_chunks_(num_chunks),
      executor_(pp, micro_batch_size),
      rebalancer_(rebalancer ? std::move(rebalancer) : std::make_unique<NoOpRebalancer>()),
      replica_groups_(std::move(replica_groups)) {}

std::vector<StageLoad> PipelineRunner::GatherLoads(const GptModel& stage, const Schedule& schedule) {
  // One fixed-size record per stage: range, action totals and memory, then per global layer
  // its F, B, W times and activation bytes (measured where the layer ran last iteration)
  // and its state, block load and parameters (where it is now); zero elsewhere, so the
  // column sums over stages are the per-layer values.
  const int64_t layers = stage.options().num_layers;
  // With chunks, three more columns per chunk after the layers': its F, B and W totals.
  const int64_t chunks = schedule.num_chunks > 1 ? schedule.num_chunks : 0;
  const int64_t width = kFixedColumns + kPerLayer * layers + 3 * chunks;
  at::Tensor mine = at::zeros({width}, at::kDouble);
  double* m = mine.data_ptr<double>();
  auto layer_column = [&](int64_t layer, LayerColumn c) { return kFixedColumns + c * layers + layer; };
  // kind 0: F, 1: B (or fused BW), 2: W.
  auto chunk_column = [&](int64_t chunk, int kind) {
    return kFixedColumns + kPerLayer * layers + 3 * chunk + kind;
  };
  m[kBegin] = static_cast<double>(stage.layer_begin());
  m[kEnd] = static_cast<double>(stage.layer_end());
  if (has_run_) {
    for (const ActionTiming& t : last_run_.timings) {
      const double ms = t.end_ms - t.start_ms - t.wait_ms - t.migration_ms;
      int kind = 0;
      switch (t.action.kind) {
        case ActionKind::kForward: m[kForward] += ms; kind = 0; break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput: m[kBackward] += ms; kind = 1; break;
        case ActionKind::kBackwardWeight: m[kWeight] += ms; kind = 2; break;
      }
      if (chunks > 0) m[chunk_column(t.action.chunk, kind)] += ms;
    }
    m[kWait] = last_run_.wait_ms;
    m[kTotal] = last_run_.total_ms;
    m[kPeakActivationBytes] = static_cast<double>(last_run_.peak_activation_bytes);
    for (const auto& [layer, ms] : last_run_.layer_forward_ms) m[layer_column(layer, kLayerForward)] = ms;
    for (const auto& [layer, ms] : last_run_.layer_backward_ms) m[layer_column(layer, kLayerBackward)] = ms;
    for (const auto& [layer, ms] : last_run_.layer_weight_ms) m[layer_column(layer, kLayerWeight)] = ms;
    for (const auto& [layer, bytes] : last_run_.layer_activation_bytes) {
      m[layer_column(layer, kLayerActivation)] = bytes;
    }
  }
  for (const Unit* unit : stage.Units()) {
    const StateBytes bytes = UnitStateBytes(*unit);
    m[kParameterBytes] += static_cast<double>(bytes.parameters);
    m[kGradientBytes] += static_cast<double>(bytes.gradients);
    m[kOptimizerBytes] += static_cast<double>(bytes.optimizer);
  }
  // NOTE [tied head on the embedding's rank]: the head's own gradient of the embeddings.
  m[kGradientBytes] += static_cast<double>(stage.TiedHeadGradientBytes());
  if (stage.embedding() != nullptr) m[kPinnedParameters] += TrainableParameters(*stage.embedding());
  if (stage.head() != nullptr) m[kPinnedParameters] += TrainableParameters(*stage.head());
  for (const auto& [layer, unit] : stage.layers()) {
    const StateBytes bytes = UnitStateBytes(*unit);
    m[layer_column(layer, kLayerState)] =
        static_cast<double>(bytes.parameters + bytes.gradients + bytes.optimizer);
    m[layer_column(layer, kLayerParameters)] = TrainableParameters(*unit);
    // The layer's own load (an MoE layer: expert rows of its last completed step; a plugin's
    // prediction); it travels with the layer, so it is reported where the layer is now.
    m[layer_column(layer, kLayerBlockLoad)] = unit->Load();
  }
  at::Tensor all = pp_->AllGather(mine.unsqueeze(0));  // [stages, width]
  // Replicas measured different times: every one takes the mean, summed in rank order, so
  // all hold the same bits (NOTE [when the plan is made]).
  for (parallel::Communicator* group : replica_groups_) {
    if (group == nullptr || group->size() == 1) continue;
    const at::Tensor each = group->AllGather(all.unsqueeze(0));  // [replicas, stages, width]
    at::Tensor sum = each[0].clone();
    for (int r = 1; r < group->size(); ++r) sum += each[r];
    all = sum / static_cast<double>(group->size());
  }
  all = all.contiguous();
  std::vector<double> per_layer(kPerLayer * layers, 0.0);  // Column sums over the stages.
  for (int s = 0; s < schedule.num_stages; ++s) {
    const double* r = all[s].data_ptr<double>();
    for (int64_t i = 0; i < kPerLayer * layers; ++i) per_layer[i] += r[kFixedColumns + i];
  }
  // NOTE [model chunks]: with chunks a rank's span has gaps; its load carries its chunks'
  // ranges (chunk order) and its per-layer values follow those chunks' layers.
  const LayerRanges virtual_ranges =
      schedule.num_chunks > 1 ? GatherVirtualRanges(stage, schedule) : LayerRanges{};
  std::vector<StageLoad> loads(schedule.num_stages);
  for (int s = 0; s < schedule.num_stages; ++s) {
    const double* r = all[s].data_ptr<double>();
    StageLoad& load = loads[s];
    load.stage = s;
    load.layer_begin = static_cast<int64_t>(r[kBegin]);
    load.layer_end = static_cast<int64_t>(r[kEnd]);
    load.forward_ms = r[kForward];
    load.backward_ms = r[kBackward];
    load.weight_ms = r[kWeight];
    load.wait_ms = r[kWait];
    load.total_ms = r[kTotal];
    load.parameter_bytes = static_cast<int64_t>(r[kParameterBytes]);
    load.gradient_bytes = static_cast<int64_t>(r[kGradientBytes]);
    load.optimizer_bytes = static_cast<int64_t>(r[kOptimizerBytes]);
    load.peak_activation_bytes = static_cast<int64_t>(r[kPeakActivationBytes]);
    load.pinned_parameters = r[kPinnedParameters];
    load.peak_in_flight = PeakInFlight(schedule, s);
    auto column = [&](LayerColumn c, int64_t l) { return per_layer[c * layers + l]; };
    std::vector<std::pair<int64_t, int64_t>> held = {{load.layer_begin, load.layer_end}};
    if (schedule.num_chunks > 1) {
      for (int c = 0; c < schedule.num_chunks; ++c) {
        load.chunk_ranges.push_back(virtual_ranges[VirtualStageOf(schedule, s, c)]);
      }
      held = load.chunk_ranges;
      for (int c = 0; c < schedule.num_chunks; ++c) {
        load.chunk_forward_ms.push_back(r[chunk_column(c, 0)]);
        load.chunk_backward_ms.push_back(r[chunk_column(c, 1)]);
        load.chunk_weight_ms.push_back(r[chunk_column(c, 2)]);
      }
    }
    for (const auto& [held_begin, held_end] : held) {
      for (int64_t l = held_begin; l < held_end; ++l) {
        load.layer_forward_ms.push_back(column(kLayerForward, l));
        load.layer_backward_ms.push_back(column(kLayerBackward, l));
        load.layer_weight_ms.push_back(column(kLayerWeight, l));
        load.layer_state_bytes.push_back(static_cast<int64_t>(column(kLayerState, l)));
        load.layer_block_load.push_back(column(kLayerBlockLoad, l));
        load.layer_parameters.push_back(column(kLayerParameters, l));
        load.layer_activation_bytes.push_back(static_cast<int64_t>(column(kLayerActivation, l)));
      }
    }
  }
  return loads;
}

absl::Status PipelineRunner::CheckSamePlan(parallel::Communicator* group, uint64_t hash,
                                           const char* what, int64_t iteration) {
  if (group == nullptr || group->size() == 1) return absl::OkStatus();
  // The hash travels as two exact 32-bit halves (doubles hold them exactly).
  at::Tensor mine = at::tensor({static_cast<double>(hash >> 32), static_cast<double>(hash & 0xffffffffu)},
                               at::kDouble);
  const at::Tensor all = group->AllGather(mine.unsqueeze(0));  // [ranks, 2]
  std::vector<std::string> differ;
  for (int r = 0; r < group->size(); ++r) {
    if (!at::equal(all[r], all[0])) differ.push_back(std::to_string(r));
  }
  if (differ.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "iteration ", iteration, ": the ", what, " ranks do not agree on the rebalancer's plan: ",
      "ranks ", absl::StrJoin(differ, ", "), " of that group planned otherwise than its rank 0 ",
      "(a rebalancer must decide from the agreed loads alone)"));
}

absl::StatusOr<std::vector<PlannedMove>> PipelineRunner::PlanMoves(const GptModel& stage,
                                                                   const Schedule& schedule,
                                                                   int64_t iteration) {
  const auto start = Clock::now();
  last_loads_ = GatherLoads(stage, schedule);
  const int virtual_stages = schedule.num_stages * schedule.num_chunks;
  // With chunks: one range per virtual stage in model order (the loads' chunk ranges), and
  // the rank of each (a move between two virtual stages of one rank is local).
  LayerRanges current;
  std::vector<int> stage_rank;
  if (schedule.num_chunks > 1) {
    for (const ChunkId& id : VirtualStages(schedule)) {
      current.push_back(last_loads_[id.stage].chunk_ranges[id.chunk]);
      stage_rank.push_back(id.stage);
    }
    // The model's chunks must be where the last plan put them (FinishMoves sets them):
    // a rank that kept its old chunk ranges after a local move would otherwise go on
    // unnoticed, each chunk running other layers than the plan says.
    if (!ranges_.empty() && current != ranges_) {
      return absl::InternalError(absl::StrCat(
          "iteration ", iteration, ": the stages' chunks hold ", FormatRanges(current),
          " but the last plan placed ", FormatRanges(ranges_)));
    }
  } else {
    for (const StageLoad& load : last_loads_) current.emplace_back(load.layer_begin, load.layer_end);
  }
  last_decision_ = rebalancer_->Plan(iteration, last_loads_);
  if (!last_decision_.error.ok()) return last_decision_.error;
  const LayerRanges& target = last_decision_.target;
  // Validated on the gathered ranges: every rank refuses a bad plan alike.
  if (!target.empty()) {
    if (absl::Status valid = ValidateRanges(target, stage.options().num_layers, virtual_stages);
        !valid.ok()) {
      return absl::InternalError(absl::StrCat("iteration ", iteration, ": rebalancer '",
                                              rebalancer_->name(), "' planned an invalid placement: ",
                                              valid.message()));
    }
  }
  // Every replica and every stage must carry out the same plan (NOTE [when the plan is made]).
  const uint64_t hash = PlanHash(iteration, target.empty() ? current : target);
  FULCRUM_RETURN_IF_ERROR(CheckSamePlan(pp_, hash, "pipeline", iteration));
  for (parallel::Communicator* group : replica_groups_) {
    FULCRUM_RETURN_IF_ERROR(CheckSamePlan(group, hash, "replica", iteration));
  }
  plan_ms_ = MsSince(start);
  ran_on_ = current;
  ranges_ = target.empty() ? current : target;
  return target.empty() ? std::vector<PlannedMove>{} : MovesBetween(current, target, stage_rank);
}

LayerRanges PipelineRunner::GatherVirtualRanges(const GptModel& stage, const Schedule& schedule) {
  const std::vector<LayerRanges> chunks =
      GatherChunkRanges(stage, schedule.num_chunks,
                        [this](const at::Tensor& row) { return pp_->AllGather(row.unsqueeze(0)); });
  LayerRanges ranges;
  for (const ChunkId& id : VirtualStages(schedule)) ranges.push_back(chunks[id.stage][id.chunk]);
  return ranges;
}

void PipelineRunner::RecordMoves(int64_t iteration) {
  bool log = pp_->rank() == 0;  // One line per job: the first stage of the first replica.
  for (parallel::Communicator* group : replica_groups_) {
    if (group != nullptr && group->rank() != 0) log = false;
  }
  // Every decision that moves layers is logged; of those that keep the placement, only the
  // first after a move (a balancer may consider one every iteration).
  const bool moves = !last_decision_.target.empty();
  if (log && !last_decision_.note.empty() && (moves || logged_move_)) {
    FULCRUM_LOG(INFO) << "iteration " << iteration << ": " << last_decision_.note;
  }
  if (!last_decision_.note.empty()) logged_move_ = moves;
  for (const PlannedMove& move : last_moves_) {
    if (log) {
      // With chunks the stages are virtual; the ranks say whether anything was sent.
      const std::string ranks =
          num_chunks_ == 1 ? std::string()
          : move.local()   ? absl::StrCat(", both on rank ", move.from_rank, ": local")
                           : absl::StrCat(", rank ", move.from_rank, " to ", move.to_rank);
      FULCRUM_LOG(INFO) << "iteration " << iteration << ": moved layer " << move.layer
                        << " from stage " << move.from_stage << " to stage " << move.to_stage
                        << ranks << " (" << rebalancer_->name() << ")";
    }
  }
  if (timeline_ == nullptr) return;
  const double base_ms = timeline_->MillisecondsSinceOrigin(last_run_.start);
  if (!last_moves_.empty()) {
    timeline_->RecordSpan(absl::StrCat("rebalance ", FormatRanges(ran_on_), " -> ", FormatRanges(ranges_)),
                          "rebalance", base_ms - plan_ms_, base_ms,
                          {{"iteration", std::to_string(iteration)},
                           {"rebalancer", rebalancer_->name()},
                           {"note", last_decision_.note},
                           {"layers_moved", std::to_string(last_moves_.size())}});
  }
  for (const MigrationTiming& m : last_run_.migrations) {
    timeline_->RecordSpan(
        absl::StrCat(m.sent ? "send" : "receive", " layers.", m.layer, " ", m.from_stage, "->",
                     m.to_stage),
        "migration", base_ms + m.start_ms, base_ms + std::max(m.end_ms, m.done_ms),
        {{"iteration", std::to_string(iteration)},
         {"layer", std::to_string(m.layer)},
         {"from_stage", std::to_string(m.from_stage)},
         {"to_stage", std::to_string(m.to_stage)},
         {"early", m.early ? "true" : "false"},
         {"posted_ms", std::to_string(m.end_ms - m.start_ms)},
         {"bytes", std::to_string(m.bytes)}});
  }
}

absl::StatusOr<const Schedule*> PipelineRunner::ScheduleFor(const std::string& name,
                                                            int microbatches, int forward_only) {
  auto key = std::make_tuple(name, microbatches, forward_only);
  auto it = schedules_.find(key);
  if (it == schedules_.end()) {
    FULCRUM_ASSIGN_OR_RETURN(Schedule schedule,
                             MakeSchedule(name, pp_->size(), microbatches, num_chunks_));
    // NOTE [forward-only stages]: the frozen prefix's stages run no backward. NOTE [ZB-V at
    // measured costs]: the V's order from the measured costs, once there are, chosen as it
    // runs with that prefix.
    if (name == "zbv" && measured_zbv_order_) {
      schedule = zbv_order_.Build(pp_->size(), microbatches, forward_only);
    } else {
      schedule = WithForwardOnlyPrefix(std::move(schedule), forward_only);
    }
    FULCRUM_RETURN_IF_ERROR(ValidateSchedule(schedule));
    it = schedules_.emplace(key, std::move(schedule)).first;
  }
  return &it->second;
}

std::pair<double, int64_t> PipelineRunner::ShareLoss(const StageRunResult& run) {
  at::Tensor t = at::tensor({run.loss_sum, static_cast<double>(run.tokens)}, at::kDouble);
  pp_->AllReduce(t, parallel::ReduceOp::kSum);
  return {t[0].item<double>(), static_cast<int64_t>(t[1].item<double>())};
}

absl::StatusOr<std::pair<double, int64_t>> PipelineRunner::Run(GptModel& stage, int64_t iteration,
                                                               const MicroBatchPlan& plan,
                                                               double loss_scale) {
  // NOTE [forward-only stages]: every rank has the same ranges and frozen prefix, so the
  // same schedule.
  const int forward_only = ForwardOnlyVirtualStages(ranges_, stage.frozen_prefix());
  FULCRUM_ASSIGN_OR_RETURN(const Schedule* schedule,
                           ScheduleFor(schedule_name_, plan.count, forward_only));
  // What the previous Run ran on and measured, for its load-trace line.
  metrics_.StartRun(ran_on_, plan.count, frozen_prefix_);
  frozen_prefix_ = stage.frozen_prefix();
  FULCRUM_ASSIGN_OR_RETURN(last_moves_, PlanMoves(stage, *schedule, iteration));
  // NOTE [ZB-V at measured costs]: the loads just gathered (the same on every rank) may
  // move the V's costs; then this iteration already runs the order built at the new ones.
  if (schedule_name_ == "zbv" && measured_zbv_order_ &&
      zbv_order_.Observe(last_loads_, plan.count)) {
    const std::vector<std::vector<Action>> before = schedule->stages;
    for (auto it = schedules_.begin(); it != schedules_.end();) {
      it = std::get<0>(it->first) == "zbv" ? schedules_.erase(it) : std::next(it);
    }
    FULCRUM_ASSIGN_OR_RETURN(schedule, ScheduleFor(schedule_name_, plan.count, forward_only));
    // Logged when the order changes, not at every rebuild (costs move past the hysteresis
    // often on a busy machine, mostly to the same lists).
    if (pp_->rank() == 0 && schedule->stages != before) {
      const ActionCosts& c = *zbv_order_.costs();
      const bool unit =
          schedule->stages ==
          WithForwardOnlyPrefix(ZeroBubbleV(pp_->size(), plan.count), forward_only).stages;
      FULCRUM_LOG(INFO) << "iteration " << iteration << ": zbv order rebuilt at the measured "
                        << "chunk costs F " << c.forward << " ms, B " << c.backward_input
                        << " ms, W " << c.backward_weight << " ms: "
                        << (unit ? "the unit-cost order's lists (kept, or the same)"
                                 : "an order other than the unit-cost one");
    }
  }
  // Every rank sees the same plan, so every rank runs the hook when the placement changes
  // (this stage may send and receive nothing).
  if (before_moves_ && ranges_ != ran_on_) FULCRUM_RETURN_IF_ERROR(before_moves_());
  last_iteration_ = iteration;
  FULCRUM_ASSIGN_OR_RETURN(last_run_, executor_.Run(stage, *schedule, iteration, plan, loss_scale,
                                                    /*forward_only=*/false, last_moves_));
  has_run_ = true;
  // NOTE [bubble measurement]: the loss is summed once every stage is done, so the time in
  // that reduction is this stage's wait for the slowest one.
  const auto tail_start = Clock::now();
  auto loss = ShareLoss(last_run_);
  last_run_.tail_wait_ms = MsSince(tail_start);
  // The moved layers arrive now, before the optimizer step (NOTE [early migration]); with
  // chunks every chunk then takes its virtual stage's range in the plan.
  if (schedule->num_chunks > 1) {
    std::vector<std::pair<int64_t, int64_t>> chunks;
    for (int c = 0; c < schedule->num_chunks; ++c) {
      chunks.push_back(ranges_[VirtualStageOf(*schedule, pp_->rank(), c)]);
    }
    FULCRUM_RETURN_IF_ERROR(executor_.FinishMoves(stage, last_run_, std::move(chunks)));
  } else {
    FULCRUM_RETURN_IF_ERROR(executor_.FinishMoves(stage, last_run_, ranges_[pp_->rank()]));
  }
  if (timeline_ != nullptr) timeline_->RecordIteration(iteration, last_run_);
  RecordMoves(iteration);
  const at::Tensor rows = pp_->AllGather(PipelineMetrics::StageRow(last_run_).unsqueeze(0));
  const std::string after_moves = metrics_.EndRun(iteration, last_run_, rows,
                                                  static_cast<int64_t>(last_moves_.size()));
  if (!after_moves.empty() && pp_->rank() == 0) FULCRUM_LOG(INFO) << after_moves;
  if (timeline_ != nullptr && flush_every_ > 0 && iteration % flush_every_ == 0) {
    FULCRUM_RETURN_IF_ERROR(timeline_->Flush());
  }
  return loss;
}

void PipelineRunner::Metrics(nlohmann::json* record, std::string* log_line) const {
  metrics_.Write(record, log_line);
  nlohmann::json& r = *record;
  nlohmann::json ranges = nlohmann::json::array();
  for (const auto& [begin, end] : ranges_) ranges.push_back({begin, end});
  r["stage_ranges"] = ranges;
  if (num_chunks_ > 1 && !schedules_.empty()) {  // The rank of each range (any m: same layout).
    nlohmann::json ranks = nlohmann::json::array();
    for (const ChunkId& id : VirtualStages(schedules_.begin()->second)) ranks.push_back(id.stage);
    r["stage_range_ranks"] = ranks;
  }
  for (const auto& [name, value] : rebalancer_->Metrics()) r[name] = value;
}

void PipelineRunner::LoadTrace(nlohmann::json* record) const {
  // NOTE [load trace lines]: last_loads_ are what the previous Run measured.
  if (!metrics_.has_previous() || last_loads_.empty()) return;
  nlohmann::json loads = nlohmann::json::array();
  for (const StageLoad& load : last_loads_) loads.push_back(StageLoadToJson(load));
  nlohmann::json& r = *record;
  r["iteration"] = last_iteration_ - 1;
  r["plan_iteration"] = last_iteration_;
  r["schedule"] = schedule_name_;
  if (schedule_name_ == "zbv") r["zbv_order"] = measured_zbv_order_ ? "measured" : "unit";
  r["rebalancer"] = rebalancer_->name();
  r["loads"] = std::move(loads);
  r["decision"] = RangesToJson(ranges_);
  for (const auto& [iteration, reason] : model_changes_) {
    if (iteration == last_iteration_ - 1) r["model_changed"].push_back(reason);
  }
  metrics_.WritePrevious(record);  // microbatches, ran_on, measured
}

absl::Status PipelineRunner::Finish() {
  return timeline_ != nullptr ? timeline_->Flush() : absl::OkStatus();
}

absl::StatusOr<std::pair<double, int64_t>> PipelineRunner::Evaluate(GptModel& stage,
                                                                    const MicroBatchPlan& plan) {
  // Any schedule's F actions form a valid forward-only order; 1F1B's is the simplest. With
  // chunks the training schedule's: its layout is the one the model is cut by.
  FULCRUM_ASSIGN_OR_RETURN(const Schedule* schedule,
                           ScheduleFor(num_chunks_ > 1 ? schedule_name_ : "1f1b", plan.count));
  FULCRUM_ASSIGN_OR_RETURN(StageRunResult run,
                           executor_.Run(stage, *schedule, /*iteration=*/0, plan, 1.0,
                                         /*forward_only=*/true));
  return ShareLoss(run);
}

}  // namespace fulcrum::pipeline
