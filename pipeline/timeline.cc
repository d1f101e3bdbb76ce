#include "pipeline/timeline.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/file_system.h"
#include "core/logging.h"
#include "core/status.h"

namespace fulcrum::pipeline {
namespace {

// The rows ("threads") of a rank's process in the trace viewer.
constexpr int kComputeRow = 0;    // Actions, with their waits nested inside them.
constexpr int kIterationRow = 1;  // One span per recorded Run.
constexpr int kEventRow = 2;      // RecordSpan's free-form events.

constexpr double kMicrosecondsPerMillisecond = 1000.0;
// Waits shorter than this (rounding noise of a sum of differences) are not drawn.
constexpr double kMinWaitMs = 1e-3;

// Microsecond timestamps keep three decimals: enough for the steady_clock's nanoseconds,
// and short in the file ("2000.39", not "2000.3899999999999").
double RoundToNanoseconds(double us) { return std::round(us * 1000.0) / 1000.0; }

nlohmann::json Metadata(const char* name, int pid, int tid, nlohmann::json args) {
  return {{"name", name}, {"ph", "M"},  {"ts", 0},
          {"pid", pid},   {"tid", tid}, {"args", std::move(args)}};
}

}  // namespace

TimelineRecorder::TimelineRecorder(parallel::Communicator* world, std::string path, int stage,
                                   TimelineOptions options)
    : world_(world), path_(std::move(path)), stage_(stage), options_(options) {
  TORCH_CHECK(world_ != nullptr, "TimelineRecorder needs a world communicator");
  TORCH_CHECK(options_.max_iterations >= 0 && options_.max_spans >= 0,
              "TimelineOptions: max_iterations=", options_.max_iterations,
              " and max_spans=", options_.max_spans, " must be >= 0");
  // NOTE [timeline clock]: every rank leaves the second barrier within one barrier latency
  // of the others and reads its clock right away. The first barrier only warms the
  // connections: a communicator's first collective is the slowest.
  world_->Barrier();
  world_->Barrier();
  origin_ = Clock::now();
}

double TimelineRecorder::MillisecondsSinceOrigin(Clock::time_point t) const {
  return std::chrono::duration<double, std::milli>(t - origin_).count();
}

void TimelineRecorder::RecordIteration(int64_t iteration, const StageRunResult& run) {
  if (recorded_iterations_ >= options_.max_iterations) {
    if (!logged_iteration_limit_) {
      FULCRUM_LOG(INFO) << "timeline: recorded " << recorded_iterations_
                        << " iterations (max_iterations); later iterations are not recorded";
      logged_iteration_limit_ = true;
    }
    return;
  }
  ++recorded_iterations_;
  const double base_ms = MillisecondsSinceOrigin(run.start);
  auto us = [base_ms](double ms) { return (base_ms + ms) * kMicrosecondsPerMillisecond; };

  Event span;
  span.name = absl::StrCat("iteration ", iteration);
  span.category = "iteration";
  span.tid = kIterationRow;
  span.ts_us = us(0);
  span.dur_us = std::max(0.0, run.total_ms) * kMicrosecondsPerMillisecond;
  span.iteration = iteration;
  span.args = {{"wait_ms", run.wait_ms}, {"total_ms", run.total_ms}};
  events_.push_back(std::move(span));

  double action_wait_ms = 0;
  double last_end_ms = 0;
  // With model chunks every action names its chunk ("F3.0", "F3.1"), as the schedule's own
  // printout does: a bare "F3" beside "F3.1" would read as a different kind of action. A
  // stage with several chunks runs actions of a chunk above 0 in every iteration.
  const bool chunks = std::any_of(run.timings.begin(), run.timings.end(),
                                  [](const ActionTiming& t) { return t.action.chunk > 0; });
  for (const ActionTiming& timing : run.timings) {
    const double duration_ms = std::max(0.0, timing.end_ms - timing.start_ms);
    Event slice;
    slice.name = timing.action.ToString(chunks);
    slice.category = "compute";
    slice.tid = kComputeRow;
    slice.ts_us = us(timing.start_ms);
    slice.dur_us = duration_ms * kMicrosecondsPerMillisecond;
    slice.iteration = iteration;
    slice.action = timing.action;
    // NOTE [per-layer timing]: the action's share per layer, e.g. "layers.3 ms": 1.25.
    for (const auto& [layer, ms] : timing.layer_ms) {
      slice.args.emplace_back(absl::StrCat("layers.", layer, " ms"), ms);
    }
    if (timing.migration_ms > 0) slice.args.emplace_back("migration ms", timing.migration_ms);
    events_.push_back(std::move(slice));
    if (timing.wait_ms >= kMinWaitMs) {
      // Receives come first in an action, so its wait is drawn at its start; clamped so
      // the child stays inside its parent, as the trace format's nesting requires.
      Event wait;
      wait.name = "wait";
      wait.category = "wait";
      wait.tid = kComputeRow;
      wait.ts_us = us(timing.start_ms);
      wait.dur_us = std::min(timing.wait_ms, duration_ms) * kMicrosecondsPerMillisecond;
      wait.iteration = iteration;
      wait.args = {{"for", timing.action.ToString(chunks)}};
      events_.push_back(std::move(wait));
    }
    action_wait_ms += timing.wait_ms;
    last_end_ms = std::max(last_end_ms, timing.end_ms);
  }
  // The rest of run.wait_ms is the final wait for outstanding sends, after the last action.
  const double drain_ms = run.wait_ms - action_wait_ms;
  if (drain_ms >= kMinWaitMs) {
    Event wait;
    wait.name = "wait";
    wait.category = "wait";
    wait.tid = kComputeRow;
    wait.ts_us = us(std::max(last_end_ms, run.total_ms - drain_ms));
    wait.dur_us = drain_ms * kMicrosecondsPerMillisecond;
    wait.iteration = iteration;
    wait.args = {{"for", std::string("sends")}};
    events_.push_back(std::move(wait));
  }
  // After the run: waiting for the slowest stage (NOTE [bubble measurement]).
  if (run.tail_wait_ms >= kMinWaitMs) {
    Event wait;
    wait.name = "wait";
    wait.category = "wait";
    wait.tid = kComputeRow;
    wait.ts_us = us(std::max(last_end_ms, run.total_ms));
    wait.dur_us = run.tail_wait_ms * kMicrosecondsPerMillisecond;
    wait.iteration = iteration;
    wait.args = {{"for", std::string("pipeline end")}};
    events_.push_back(std::move(wait));
  }
}

void TimelineRecorder::RecordSpan(const std::string& name, const std::string& category,
                                  double start_ms, double end_ms, const Args& args) {
  if (recorded_spans_ >= options_.max_spans) {
    if (!logged_span_limit_) {
      FULCRUM_LOG(INFO) << "timeline: recorded " << recorded_spans_
                        << " events (max_spans); later events are not recorded";
      logged_span_limit_ = true;
    }
    return;
  }
  ++recorded_spans_;
  Event event;
  event.name = name;
  event.category = category;
  event.phase = end_ms > start_ms ? 'X' : 'i';
  event.tid = kEventRow;
  event.ts_us = start_ms * kMicrosecondsPerMillisecond;
  event.dur_us = event.phase == 'X' ? (end_ms - start_ms) * kMicrosecondsPerMillisecond : 0;
  for (const auto& [key, value] : args) event.args.emplace_back(key, value);
  events_.push_back(std::move(event));
}

std::string TimelineRecorder::SerializeEvents() const {
  const int pid =
      world_->global_ranks().empty() ? world_->rank() : world_->global_ranks()[world_->rank()];
  std::string out;
  auto append = [&out](const nlohmann::json& event) {
    if (!out.empty()) out += ',';
    out += event.dump();
  };
  append(Metadata("process_name", pid, 0,
                  {{"name", absl::StrCat("rank ", pid, " (stage ", stage_, ")")}}));
  append(Metadata("process_sort_index", pid, 0, {{"sort_index", pid}}));
  append(Metadata("thread_name", pid, kComputeRow, {{"name", "compute"}}));
  append(Metadata("thread_name", pid, kIterationRow, {{"name", "iterations"}}));
  append(Metadata("thread_name", pid, kEventRow, {{"name", "events"}}));
  for (const Event& event : events_) {
    nlohmann::json json = {{"name", event.name},
                           {"cat", event.category},
                           {"ph", std::string(1, event.phase)},
                           {"ts", RoundToNanoseconds(event.ts_us)},
                           {"pid", pid},
                           {"tid", event.tid}};
    if (event.phase == 'X') json["dur"] = RoundToNanoseconds(event.dur_us);
    if (event.phase == 'i') json["s"] = "t";  // Instant on its own row, not the whole process.
    nlohmann::json args = nlohmann::json::object();
    if (event.iteration >= 0) args["iteration"] = event.iteration;
    if (event.action) {
      args["microbatch"] = event.action->microbatch;
      args["kind"] = ActionKindName(event.action->kind);
      args["chunk"] = event.action->chunk;
    }
    for (const auto& [key, value] : event.args) {
      std::visit([&args, &key = key](const auto& v) { args[key] = v; }, value);
    }
    json["args"] = std::move(args);
    append(json);
  }
  return out;
}

absl::Status TimelineRecorder::Flush() {
  // Sizes first, then every rank's bytes padded to the largest (AllGather needs one shape).
  const std::string mine = SerializeEvents();
  const at::Tensor sizes =
      world_->AllGather(at::tensor({static_cast<int64_t>(mine.size())}, at::kLong));
  const int64_t padded = std::max<int64_t>(1, sizes.max().item<int64_t>());
  at::Tensor buffer = at::zeros({padded}, at::kByte);
  std::memcpy(buffer.data_ptr<uint8_t>(), mine.data(), mine.size());
  const at::Tensor all = world_->AllGather(buffer);
  if (world_->rank() != 0) return absl::OkStatus();

  const char* bytes = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  std::string trace = R"({"traceEvents":[)";
  bool first = true;
  for (int r = 0; r < world_->size(); ++r) {
    const int64_t size = sizes[r].item<int64_t>();
    if (size == 0) continue;
    if (!first) trace += ',';
    first = false;
    trace.append(bytes + r * padded, static_cast<size_t>(size));
  }
  nlohmann::json other = {
      {"producer", "fulcrum TimelineRecorder"},
      {"ranks", world_->size()},
      {"clock", "steady_clock per rank; origins agree to within one barrier latency"}};
  trace += R"(],"displayTimeUnit":"ms","otherData":)";
  trace += other.dump();
  trace += "}\n";

  FileSystem* fs = DefaultFileSystem();
  FULCRUM_RETURN_IF_ERROR(fs->CreateDir(DirName(path_)));
  FULCRUM_RETURN_IF_ERROR(WriteFileAtomically(fs, path_, trace));
  FULCRUM_LOG(INFO) << "timeline: wrote " << path_ << " (" << trace.size() << " bytes, "
                    << world_->size() << " ranks); open it in https://ui.perfetto.dev";
  return absl::OkStatus();
}

}  // namespace fulcrum::pipeline
