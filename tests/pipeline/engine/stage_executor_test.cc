// StageExecutor (pipeline/stage_executor.h) on a one-stage pipeline (a one-process Gloo
// world): per-layer F/B/W times cover the stage's actions, the gradients of the split,
// tagged, hooked backward are bit-identical to a plain backward, and the measured
// activation memory grows with the micro-batches a schedule holds in flight.
#include "pipeline/stage_executor.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "core/kernels/device_timer.h"
#include "gtest/gtest.h"
#include "parallel/world_communicator.h"
#include "pipeline/timeline.h"
#include "tests/pipeline/engine/engine_test_util.h"
#include "tests/temp_dir.h"

namespace fulcrum::pipeline {
namespace {

using testing::EngineModel;
using testing::RandomPlan;
using testing::OneProcessWorld;
using testing::kMicroBatchSize;

Schedule MustMake(const std::string& name, int microbatches) {
  absl::StatusOr<Schedule> schedule = MakeSchedule(name, 1, microbatches);
  EXPECT_TRUE(schedule.ok()) << schedule.status();
  return *schedule;
}

// Σ over the actions of `kind` of their time without waits.
double ActionMs(const StageRunResult& run, std::initializer_list<ActionKind> kinds) {
  double ms = 0;
  for (const ActionTiming& t : run.timings) {
    for (ActionKind kind : kinds) {
      if (t.action.kind == kind) ms += t.end_ms - t.start_ms - t.wait_ms - t.migration_ms;
    }
  }
  return ms;
}

double Sum(const std::map<int64_t, double>& by_layer) {
  double sum = 0;
  for (const auto& [layer, ms] : by_layer) sum += ms;
  return sum;
}

class PipelineExecutorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = OneProcessWorld();
    ASSERT_NE(world_, nullptr);
  }
  absl::StatusOr<StageRunResult> RunSchedule(GptModel& model, const Schedule& schedule) {
    StageExecutor executor(world_.get(), kMicroBatchSize);
    return executor.Run(model, schedule, /*iteration=*/1,
                        RandomPlan(model.options(), schedule.num_microbatches, kMicroBatchSize),
                        /*loss_scale=*/1e-3);
  }
  std::unique_ptr<parallel::Communicator> world_;
};

// Every parameter of `a` has a gradient, bit for bit that of the same parameter of `b`
// (and there are more than 40 of them: the comparison covers the model).
void ExpectSameGradients(const GptModel& a_model, const GptModel& b_model) {
  const std::vector<Unit*> a = a_model.Units(), b = b_model.Units();
  ASSERT_EQ(a.size(), b.size());
  int compared = 0;
  for (size_t u = 0; u < a.size(); ++u) {
    for (size_t p = 0; p < a[u]->parameters().size(); ++p) {
      const at::Tensor& ga = a[u]->parameters()[p].value.grad();
      const at::Tensor& gb = b[u]->parameters()[p].value.grad();
      ASSERT_TRUE(ga.defined() && gb.defined()) << a[u]->parameters()[p].name;
      EXPECT_TRUE(at::equal(ga, gb)) << a[u]->GlobalName(a[u]->parameters()[p].name);
      ++compared;
    }
  }
  EXPECT_GT(compared, 40);
}

// NOTE [per-layer timing]: every layer gets F, B and W time in a ZB-H1 run; per action and
// per layer they add up; the per-layer sums stay within the stage's F, B and W (the
// embedding, head and loss are no layer's) and make up most of them.
TEST_F(PipelineExecutorTest, PerLayerForwardBackwardAndWeightTimesCoverTheStage) {
  GptModel model(EngineModel());
  constexpr int kMicroBatches = 4;
  // A first run takes the one-time costs (first-touch allocations, kernel set-up) that
  // would otherwise land outside the layers of a stage whose whole forward is a few ms.
  ASSERT_TRUE(RunSchedule(model, MustMake("zbh1", kMicroBatches)).ok());
  absl::StatusOr<StageRunResult> run = RunSchedule(model, MustMake("zbh1", kMicroBatches));
  ASSERT_TRUE(run.ok()) << run.status();
  for (const auto* by_layer : {&run->layer_forward_ms, &run->layer_backward_ms, &run->layer_weight_ms}) {
    ASSERT_EQ(by_layer->size(), 4u);
    for (const auto& [layer, ms] : *by_layer) EXPECT_GT(ms, 0.0) << "layer " << layer;
  }
  // Each action's per-layer times add up to the per-layer totals.
  std::map<ActionKind, std::map<int64_t, double>> from_actions;
  for (const ActionTiming& t : run->timings) {
    for (const auto& [layer, ms] : t.layer_ms) from_actions[t.action.kind][layer] += ms;
    EXPECT_EQ(t.layer_ms.size(), 4u) << t.action.ToString();
  }
  for (int64_t layer = 0; layer < 4; ++layer) {
    EXPECT_NEAR(from_actions[ActionKind::kForward][layer], run->layer_forward_ms.at(layer), 1e-9);
    EXPECT_NEAR(from_actions[ActionKind::kBackwardInput][layer], run->layer_backward_ms.at(layer), 1e-9);
    EXPECT_NEAR(from_actions[ActionKind::kBackwardWeight][layer], run->layer_weight_ms.at(layer), 1e-9);
  }
  const double f = ActionMs(*run, {ActionKind::kForward});
  const double b = ActionMs(*run, {ActionKind::kBackwardInput});
  const double w = ActionMs(*run, {ActionKind::kBackwardWeight});
  std::cout << "stage F/B/W " << f << " / " << b << " / " << w << " ms; per-layer sums "
            << Sum(run->layer_forward_ms) << " / " << Sum(run->layer_backward_ms) << " / "
            << Sum(run->layer_weight_ms) << " ms" << std::endl;
  EXPECT_LE(Sum(run->layer_forward_ms), f);
  EXPECT_LE(Sum(run->layer_backward_ms), b);
  EXPECT_LE(Sum(run->layer_weight_ms), w);
  // Four layers against an embedding and a 96-word head: the layers dominate. A stage's
  // actions take a few ms, so a preemption outside the layers (the machine is shared with
  // other tests) can lower one run's share; it cannot raise it. So the best share of three
  // runs is what is compared: a per-layer timing that missed most of the layers' work fails
  // in every run.
  double best[3] = {Sum(run->layer_forward_ms) / f, Sum(run->layer_backward_ms) / b,
                    Sum(run->layer_weight_ms) / w};
  for (int again = 0; again < 2 && std::min({best[0], best[1], best[2]}) < 0.5; ++again) {
    absl::StatusOr<StageRunResult> more = RunSchedule(model, MustMake("zbh1", kMicroBatches));
    ASSERT_TRUE(more.ok()) << more.status();
    best[0] = std::max(best[0], Sum(more->layer_forward_ms) / ActionMs(*more, {ActionKind::kForward}));
    best[1] = std::max(best[1], Sum(more->layer_backward_ms) /
                                    ActionMs(*more, {ActionKind::kBackwardInput}));
    best[2] = std::max(best[2], Sum(more->layer_weight_ms) /
                                    ActionMs(*more, {ActionKind::kBackwardWeight}));
  }
  EXPECT_GE(best[0], 0.5) << "F";
  EXPECT_GE(best[1], 0.5) << "B";
  EXPECT_GE(best[2], 0.5) << "W";
}

// The timeline shows each action's per-layer times as args "layers.L ms".
TEST_F(PipelineExecutorTest, TimelineShowsPerLayerTimes) {
  GptModel model(EngineModel());
  absl::StatusOr<StageRunResult> run = RunSchedule(model, MustMake("zbh1", 2));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string dir = fulcrum::testing::MakeTempDir("engine");
  const std::string path = dir + "/t.json";
  TimelineRecorder timeline(world_.get(), path, /*stage=*/0);
  timeline.RecordIteration(1, *run);
  ASSERT_TRUE(timeline.Flush().ok());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json trace = nlohmann::json::parse(text.str());
  std::map<std::string, int> slices_with_layers;  // kind -> slices carrying all four layers
  for (const auto& event : trace["traceEvents"]) {
    if (event.value("cat", "") != "compute") continue;
    int layers = 0;
    for (int l = 0; l < 4; ++l) {
      const std::string key = "layers." + std::to_string(l) + " ms";
      if (event["args"].contains(key) && event["args"][key].get<double>() > 0) ++layers;
    }
    if (layers == 4) ++slices_with_layers[event["args"]["kind"].get<std::string>()];
  }
  EXPECT_EQ(slices_with_layers["F"], 2);
  EXPECT_EQ(slices_with_layers["B"], 2);
  EXPECT_EQ(slices_with_layers["W"], 2);
}

// 1F1B's fused BW counts as B per layer; there is no W.
TEST_F(PipelineExecutorTest, FusedBackwardCountsAsBackwardPerLayer) {
  GptModel model(EngineModel());
  absl::StatusOr<StageRunResult> run = RunSchedule(model, MustMake("1f1b", 3));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->layer_backward_ms.size(), 4u);
  for (const auto& [layer, ms] : run->layer_backward_ms) EXPECT_GT(ms, 0.0) << "layer " << layer;
  EXPECT_TRUE(run->layer_weight_ms.empty());
  EXPECT_LE(Sum(run->layer_backward_ms), ActionMs(*run, {ActionKind::kBackward}));
}

// The hooks, tags and the split leave the arithmetic alone: the gradients equal those of a
// plain backward of the same micro-batches in the same order, bit for bit.
TEST_F(PipelineExecutorTest, GradientsAreBitIdenticalToAPlainBackward) {
  const ModelOptions options = EngineModel();
  constexpr int kMicroBatches = 3;
  GptModel executed(options);
  ASSERT_TRUE(RunSchedule(executed, MustMake("zbh1", kMicroBatches)).ok());

  GptModel plain(options);
  const MicroBatchPlan plan = RandomPlan(options, kMicroBatches, kMicroBatchSize);
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    ForwardContext ctx{true, /*iteration=*/1, plan.first_sample(mb), kLossScale, {}, 0};
    LossSum loss = plain.ForwardLoss(plan.tokens(mb), ctx);
    (loss.sum * kLossScale).backward();
  }
  ExpectSameGradients(executed, plain);
}

// NOTE [activation memory]: one stage running F B W per micro-batch holds one micro-batch
// at a time; running all forwards first (GPipe's order) holds all of them, so its peak is
// about `m` times as high. A micro-batch holds at least its layers' inputs.
TEST_F(PipelineExecutorTest, PeakActivationBytesFollowTheMicroBatchesInFlight) {
  const ModelOptions options = EngineModel();
  constexpr int kMicroBatches = 4;
  GptModel model(options);
  absl::StatusOr<StageRunResult> one = RunSchedule(model, MustMake("zbh1", kMicroBatches));
  ASSERT_TRUE(one.ok()) << one.status();

  Schedule gpipe;
  gpipe.name = "gpipe";
  gpipe.num_stages = 1;
  gpipe.num_microbatches = kMicroBatches;
  gpipe.max_in_flight = kMicroBatches;
  gpipe.stages.resize(1);
  for (int mb = 0; mb < kMicroBatches; ++mb) gpipe.stages[0].push_back({ActionKind::kForward, mb});
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    gpipe.stages[0].push_back({ActionKind::kBackwardInput, mb});
    gpipe.stages[0].push_back({ActionKind::kBackwardWeight, mb});
  }
  ASSERT_TRUE(ValidateSchedule(gpipe).ok());
  model.ZeroGrad();
  absl::StatusOr<StageRunResult> all = RunSchedule(model, gpipe);
  ASSERT_TRUE(all.ok()) << all.status();

  const int64_t layer_input_bytes =
      options.seq_length * kMicroBatchSize * options.hidden_size * static_cast<int64_t>(sizeof(float));
  std::cout << "peak activation bytes: one in flight " << one->peak_activation_bytes << ", "
            << kMicroBatches << " in flight " << all->peak_activation_bytes << std::endl;
  EXPECT_GE(one->peak_activation_bytes, options.num_layers * layer_input_bytes);
  EXPECT_GT(all->peak_activation_bytes, (kMicroBatches - 0.5) * one->peak_activation_bytes);
  EXPECT_LT(all->peak_activation_bytes, (kMicroBatches + 0.5) * one->peak_activation_bytes);
}

// A forward-only run (evaluation) measures no backward and no memory.
TEST_F(PipelineExecutorTest, ForwardOnlyRunHasOnlyForwardTimes) {
  GptModel model(EngineModel());
  StageExecutor executor(world_.get(), kMicroBatchSize);
  absl::StatusOr<StageRunResult> run =
      executor.Run(model, MustMake("1f1b", 2), 0, RandomPlan(model.options(), 2, kMicroBatchSize),
                   1.0, /*forward_only=*/true);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->layer_forward_ms.size(), 4u);
  EXPECT_TRUE(run->layer_backward_ms.empty());
  EXPECT_EQ(run->peak_activation_bytes, 0);
  EXPECT_GT(run->tokens, 0);
}

// A timer that measures nothing: each interval of a key lasts the key's number (1, 2, 3,
// ... in the order the keys were first started). Per-layer times that are not exactly
// these whole numbers did not come from the timer. As a "device-event" timer it also
// places the n-th interval stopped at [10⁶ + 100 n + 0.25, that + its key's number) on its
// time axis: far from any host time of a test run (10⁶ ms is over 16 minutes), with a
// quarter no clock difference would give exactly, and in stop order without overlap.
class FakeTimer : public kernels::DeviceTimer {
 public:
  struct Log {
    int collects = 0;
    int starts = 0;
    int origins = 0;
    std::map<std::string, double> returned;  // what the last Collect returned
    std::vector<Span> spans;                 // the spans it returned (device events only)
    bool lose_action_spans = false;          // a broken timer: no span for the actions
  };
  explicit FakeTimer(Log* log, bool device_events = false)
      : DeviceTimer(c10::Device(c10::kCPU)), log_(log), device_events_(device_events) {}
  bool uses_device_events() const override { return device_events_; }
  void MarkOrigin() override {
    EXPECT_TRUE(open_.empty()) << "origin marked with " << *open_.begin() << " open";
    EXPECT_EQ(log_->starts, 0) << "origin marked after an interval";
    ++log_->origins;
  }
  void Start(const std::string& key) override {
    EXPECT_TRUE(open_.insert(key).second) << key << " started twice";
    id_.emplace(key, static_cast<double>(id_.size() + 1));
    ++log_->starts;
  }
  void Stop(const std::string& key) override {
    EXPECT_EQ(open_.erase(key), 1u) << key << " stopped without a start";
    ms_[key] += id_.at(key);
    const double start = 1e6 + 100.0 * static_cast<double>(spans_.size()) + 0.25;
    spans_.push_back({key, start, start + id_.at(key)});
  }
  std::map<std::string, double> Collect(std::vector<Span>* spans) override {
    EXPECT_TRUE(open_.empty()) << *open_.begin() << " still open at Collect";
    EXPECT_EQ(spans != nullptr, device_events_) << "spans asked of a host-clock timer or not "
                                                   "asked of a device-event one";
    ++log_->collects;
    log_->returned = ms_;
    if (spans != nullptr) {
      for (const Span& span : spans_) {
        if (!log_->lose_action_spans || span.key.rfind("A/", 0) != 0) spans->push_back(span);
      }
      log_->spans = *spans;
    }
    spans_.clear();
    return std::exchange(ms_, {});
  }

 private:
  Log* log_;
  bool device_events_;
  std::set<std::string> open_;
  std::map<std::string, double> id_;
  std::map<std::string, double> ms_;
  std::vector<Span> spans_;
};

// NOTE [action times on the device]: the timer's figures for the action keys ("A/<index>").
bool IsActionKey(const std::string& key) { return key.rfind("A/", 0) == 0; }

// NOTE [per-layer timing]: the per-layer F, B and W times of every action, and the
// per-layer sums the load model reads, are the timer's figures, collected once per run.
TEST_F(PipelineExecutorTest, PerLayerTimesComeFromTheDeviceTimer) {
  GptModel model(EngineModel());
  FakeTimer::Log log;
  StageExecutor executor(world_.get(), kMicroBatchSize);
  executor.set_timer_factory([&log](c10::Device device) -> std::unique_ptr<kernels::DeviceTimer> {
    EXPECT_TRUE(device.is_cpu());
    return std::make_unique<FakeTimer>(&log);
  });
  constexpr int kMicroBatches = 3;
  absl::StatusOr<StageRunResult> run =
      executor.Run(model, MustMake("zbh1", kMicroBatches), 1,
                   RandomPlan(model.options(), kMicroBatches, kMicroBatchSize), 1e-3);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(log.collects, 1);  // one synchronisation per iteration
  // Every figure the timer returned is some action's time of some layer, once; the W
  // computations of no layer (head, embedding: tag -1) are timed and left out.
  std::multiset<double> expected, shown;
  for (const auto& [key, ms] : log.returned) {
    if (IsActionKey(key)) continue;  // the actions' own intervals (below)
    if (key.size() < 3 || key.compare(key.size() - 3, 3, "/-1") != 0) expected.insert(ms);
  }
  std::map<ActionKind, PerLayer> from_actions;
  for (const ActionTiming& t : run->timings) {
    EXPECT_EQ(t.layer_ms.size(), 4u) << t.action.ToString();
    for (const auto& [layer, ms] : t.layer_ms) {
      EXPECT_EQ(ms, std::round(ms)) << t.action.ToString() << " layer " << layer << ": " << ms
                                    << " ms is no figure of the timer";
      EXPECT_GE(ms, 1.0);
      shown.insert(ms);
      from_actions[t.action.kind][layer] += ms;
    }
  }
  EXPECT_EQ(shown, expected);
  EXPECT_EQ(shown.size(), 3u * kMicroBatches * 4);  // F, B, W × micro-batches × layers
  EXPECT_EQ(from_actions[ActionKind::kForward], run->layer_forward_ms);
  EXPECT_EQ(from_actions[ActionKind::kBackwardInput], run->layer_backward_ms);
  EXPECT_EQ(from_actions[ActionKind::kBackwardWeight], run->layer_weight_ms);
  // On the CPU the allocator's figures are not tracked (the activation meter's are used).
  EXPECT_FALSE(run->device_memory.tracked);
  EXPECT_EQ(run->device_memory.ToString(), "not tracked (cpu)");
  EXPECT_GT(run->peak_activation_bytes, 0);
  // A host-clock timer: the actions' start and end are host times, none of the timer's.
  EXPECT_EQ(log.origins, 1);
  EXPECT_TRUE(log.spans.empty());
  for (const ActionTiming& t : run->timings) {
    EXPECT_LT(t.end_ms, 1e6) << t.action.ToString();
  }
}

// StageExecutor::set_layer_timing(false): only the actions are timed — no per-layer
// interval starts, no per-layer time is reported — and the run computes the same bits
// (the same gradients, the same loss) as one timed layer by layer; the activation meter
// still measures each layer.
TEST_F(PipelineExecutorTest, WithoutLayerTimingOnlyTheActionsAreTimed) {
  const ModelOptions options = EngineModel();
  constexpr int kMicroBatches = 3;
  const Schedule schedule = MustMake("zbh1", kMicroBatches);
  const MicroBatchPlan plan = RandomPlan(options, kMicroBatches, kMicroBatchSize);
  auto run_with = [&](bool layer_timing, GptModel& model, FakeTimer::Log& log) {
    StageExecutor executor(world_.get(), kMicroBatchSize);
    executor.set_layer_timing(layer_timing);
    executor.set_timer_factory([&log](c10::Device) -> std::unique_ptr<kernels::DeviceTimer> {
      return std::make_unique<FakeTimer>(&log);
    });
    return executor.Run(model, schedule, 1, plan, 1e-3);
  };
  GptModel timed(options), untimed(options);
  FakeTimer::Log timed_log, untimed_log;
  absl::StatusOr<StageRunResult> with = run_with(true, timed, timed_log);
  absl::StatusOr<StageRunResult> without = run_with(false, untimed, untimed_log);
  ASSERT_TRUE(with.ok()) << with.status();
  ASSERT_TRUE(without.ok()) << without.status();

  EXPECT_EQ(untimed_log.collects, 1);
  EXPECT_EQ(untimed_log.starts, static_cast<int>(schedule.stages[0].size()));  // one per action
  for (const auto& [key, ms] : untimed_log.returned) {
    EXPECT_TRUE(IsActionKey(key)) << key << " was timed with layer timing off";
  }
  EXPECT_GT(timed_log.starts, 4 * untimed_log.starts);  // the timed run did time the layers
  EXPECT_TRUE(without->layer_forward_ms.empty());
  EXPECT_TRUE(without->layer_backward_ms.empty());
  EXPECT_TRUE(without->layer_weight_ms.empty());
  for (const ActionTiming& t : without->timings) EXPECT_TRUE(t.layer_ms.empty()) << t.action.ToString();
  EXPECT_EQ(with->layer_forward_ms.size(), 4u);
  EXPECT_EQ(without->layer_activation_bytes, with->layer_activation_bytes);

  EXPECT_EQ(without->loss_sum, with->loss_sum);
  ExpectSameGradients(timed, untimed);
}

// The run's actions on one stage as a timeline: in list order, none overlapping the next,
// each ending no earlier than it starts, waits inside their action, all within the run.
void ExpectOrderedActions(const StageRunResult& run, const Schedule& schedule) {
  ASSERT_EQ(run.timings.size(), schedule.stages[0].size());
  for (size_t i = 0; i < run.timings.size(); ++i) {
    const ActionTiming& t = run.timings[i];
    EXPECT_EQ(t.action.ToString(), schedule.stages[0][i].ToString());
    EXPECT_GE(t.start_ms, 0.0) << t.action.ToString();
    EXPECT_GE(t.end_ms, t.start_ms) << t.action.ToString();
    EXPECT_LE(t.wait_ms + t.migration_ms, t.end_ms - t.start_ms) << t.action.ToString();
    if (i > 0) {
      EXPECT_GE(t.start_ms, run.timings[i - 1].end_ms) << t.action.ToString();
    }
  }
  EXPECT_GE(run.total_ms, run.timings.back().end_ms);
}

// NOTE [action times on the device]: with device events every action's start and end are
// the timer's span of its interval, exactly (not the host clock's, and the end not the
// start's); the per-layer times still come from the same one Collect.
TEST_F(PipelineExecutorTest, ActionStartAndEndComeFromTheDeviceTimerSpans) {
  GptModel model(EngineModel());
  FakeTimer::Log log;
  StageExecutor executor(world_.get(), kMicroBatchSize);
  executor.set_timer_factory([&log](c10::Device) -> std::unique_ptr<kernels::DeviceTimer> {
    return std::make_unique<FakeTimer>(&log, /*device_events=*/true);
  });
  constexpr int kMicroBatches = 3;
  const Schedule schedule = MustMake("zbh1", kMicroBatches);
  absl::StatusOr<StageRunResult> run = executor.Run(
      model, schedule, 1, RandomPlan(model.options(), kMicroBatches, kMicroBatchSize), 1e-3);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(log.collects, 1);  // still one synchronisation per iteration
  EXPECT_EQ(log.origins, 1);
  std::map<std::string, kernels::DeviceTimer::Span> by_key;
  for (const kernels::DeviceTimer::Span& span : log.spans) {
    if (IsActionKey(span.key)) {
      EXPECT_TRUE(by_key.emplace(span.key, span).second) << span.key;
    }
  }
  ASSERT_EQ(by_key.size(), run->timings.size());
  double last_end = 0;
  for (size_t i = 0; i < run->timings.size(); ++i) {
    const ActionTiming& t = run->timings[i];
    const auto it = by_key.find(absl::StrCat("A/", i));
    ASSERT_NE(it, by_key.end()) << t.action.ToString() << " has no interval";
    EXPECT_EQ(t.start_ms, it->second.start_ms) << t.action.ToString();
    EXPECT_EQ(t.end_ms, it->second.end_ms) << t.action.ToString();
    EXPECT_GT(t.end_ms, t.start_ms) << t.action.ToString();
    last_end = std::max(last_end, t.end_ms);
    EXPECT_EQ(t.layer_ms.size(), 4u) << t.action.ToString();  // per-layer times as before
  }
  // The run lasts until the stream's last action ended.
  EXPECT_GE(run->total_ms, last_end);
  EXPECT_GT(Sum(run->layer_forward_ms), 0.0);
  // The fake's spans are in stop order, so the actions stay ordered on the stage.
  ExpectOrderedActions(*run, schedule);
}

// A device timer that returns no span for an action is refused, naming the action, rather
// than leaving that action at its host times among device ones.
TEST_F(PipelineExecutorTest, ActionWithoutADeviceSpanIsRefused) {
  GptModel model(EngineModel());
  FakeTimer::Log log;
  log.lose_action_spans = true;
  StageExecutor executor(world_.get(), kMicroBatchSize);
  executor.set_timer_factory([&log](c10::Device) -> std::unique_ptr<kernels::DeviceTimer> {
    return std::make_unique<FakeTimer>(&log, /*device_events=*/true);
  });
  absl::StatusOr<StageRunResult> run = executor.Run(
      model, MustMake("zbh1", 2), 1, RandomPlan(model.options(), 2, kMicroBatchSize), 1e-3);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("no interval for action 0 (F0)"), std::string::npos)
      << run.status();
}

// With the host clock (the CPU timer the executor makes itself) the actions' start and end
// are the host's times around them, as before the device axis: an ordered, non-overlapping
// stage timeline.
TEST_F(PipelineExecutorTest, CpuTimelineKeepsHostActionTimes) {
  GptModel model(EngineModel());
  for (const char* name : {"zbh1", "1f1b"}) {
    const Schedule schedule = MustMake(name, 3);
    absl::StatusOr<StageRunResult> run = RunSchedule(model, schedule);
    ASSERT_TRUE(run.ok()) << run.status();
    SCOPED_TRACE(name);
    ExpectOrderedActions(*run, schedule);
  }
}

// A timer that times nothing: the executor's cost without timing.
// On a GPU the timer's events time the work: every layer's forward takes some time and
// together they take no more than the run (wall clocks around launches could exceed
// neither, but would be near zero per layer once the queue is ahead).
TEST_F(PipelineExecutorTest, CudaPerLayerForwardTimesArePositiveAndWithinTheRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  ModelOptions options = EngineModel();
  options.device_spec.device = c10::Device(c10::kCUDA, 0);
  GptModel model(options);
  ASSERT_TRUE(RunSchedule(model, MustMake("zbh1", 4)).ok());  // warm-up
  absl::StatusOr<StageRunResult> run = RunSchedule(model, MustMake("zbh1", 4));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->layer_forward_ms.size(), 4u);
  for (const auto& [layer, ms] : run->layer_forward_ms) EXPECT_GT(ms, 0.0) << "layer " << layer;
  std::cout << "cuda: per-layer F sum " << Sum(run->layer_forward_ms) << " ms, B sum "
            << Sum(run->layer_backward_ms) << " ms, W sum " << Sum(run->layer_weight_ms)
            << " ms, run " << run->total_ms << " ms; " << run->device_memory.ToString()
            << std::endl;
  EXPECT_LE(Sum(run->layer_forward_ms), run->total_ms);
  EXPECT_TRUE(run->device_memory.tracked);
  EXPECT_GT(run->device_memory.peak_allocated_bytes, 0);
}

}  // namespace
}  // namespace fulcrum::pipeline
