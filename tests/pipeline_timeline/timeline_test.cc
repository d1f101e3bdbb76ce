// TimelineRecorder (pipeline/timeline.h): a synthetic iteration on a one-rank Gloo world
// becomes the trace events it should, in a file that has the Chrome trace-event structure
// Perfetto and chrome://tracing read; three ranks under fulcrum_launch gather their
// different-sized event lists into one file (suite TimelineWorker is their per-rank half);
// and, through the real binaries, a two-stage ZB-H1 run with --timeline draws every F, B
// and W of every micro-batch on both ranks' rows, without overlaps.
#include "pipeline/timeline.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "parallel/world_communicator.h"
#include "tests/run_command.h"
#include "tests/worker_runs.h"
#include "tests/temp_dir.h"

namespace fulcrum::pipeline {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Timestamps are doubles in microseconds; this absorbs their rounding.
constexpr double kToleranceUs = 0.01;

std::string MakeTempDir() { return fulcrum::testing::MakeTempDir("timeline"); }

using fulcrum::testing::RunCommand;

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());  // Throws (fails the test) on malformed JSON.
}

// The structure every trace viewer relies on: a traceEvents array of objects with name,
// ph, ts, pid and tid; complete events with a duration ≥ 0; the display unit.
void ExpectValidTrace(const json& trace) {
  ASSERT_TRUE(trace.is_object());
  ASSERT_TRUE(trace.contains("traceEvents") && trace["traceEvents"].is_array());
  EXPECT_EQ(trace.value("displayTimeUnit", ""), "ms");
  for (const json& event : trace["traceEvents"]) {
    ASSERT_TRUE(event.is_object()) << event;
    ASSERT_TRUE(event.contains("name") && event["name"].is_string()) << event;
    ASSERT_TRUE(event.contains("ph") && event["ph"].is_string()) << event;
    ASSERT_TRUE(event.contains("ts") && event["ts"].is_number()) << event;
    ASSERT_TRUE(event.contains("pid") && event["pid"].is_number_integer()) << event;
    ASSERT_TRUE(event.contains("tid") && event["tid"].is_number_integer()) << event;
    const std::string ph = event["ph"];
    EXPECT_TRUE(ph == "X" || ph == "i" || ph == "M") << event;
    if (ph == "X") {
      ASSERT_TRUE(event.contains("dur") && event["dur"].is_number()) << event;
      EXPECT_GE(event["dur"].get<double>(), 0.0) << event;
    }
  }
}

std::vector<json> Select(const json& trace, const std::string& ph, const std::string& cat) {
  std::vector<json> out;
  for (const json& event : trace["traceEvents"]) {
    if (event["ph"] == ph && (cat.empty() || event.value("cat", "") == cat)) out.push_back(event);
  }
  return out;
}

std::unique_ptr<parallel::Communicator> OneProcessWorld() {
  auto comm = parallel::CreateWorldCommunicator(parallel::WorldInfo{}, parallel::Backend::kGloo,
                                                std::chrono::seconds(10));
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? std::move(comm).value() : nullptr;
}

// A two-micro-batch ZB-H1-like iteration: F0 [0,2) waiting 0.5 ms, F1 [2,4), B0 [4,7)
// waiting 1 ms, W0 [7,8), B1 [8,10), W1 [10,11), then 0.75 ms waiting for sends; 12 ms.
StageRunResult SyntheticRun(Clock::time_point start) {
  StageRunResult run;
  run.start = start;
  auto add = [&run](ActionKind kind, int mb, double begin, double end, double wait) {
    run.timings.push_back(ActionTiming{Action{kind, mb}, begin, end, wait});
  };
  add(ActionKind::kForward, 0, 0, 2, 0.5);
  add(ActionKind::kForward, 1, 2, 4, 0);
  add(ActionKind::kBackwardInput, 0, 4, 7, 1.0);
  add(ActionKind::kBackwardWeight, 0, 7, 8, 0);
  add(ActionKind::kBackwardInput, 1, 8, 10, 0);
  add(ActionKind::kBackwardWeight, 1, 10, 11, 0);
  run.total_ms = 12;
  run.wait_ms = 0.5 + 1.0 + 0.75;
  return run;
}

TEST(TimelineRecorderTest, SyntheticIterationBecomesNestedTraceEvents) {
  auto world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  const std::string path = MakeTempDir() + "/nested/dir/timeline.json";
  TimelineRecorder timeline(world.get(), path, /*stage=*/3);
  const Clock::time_point start = Clock::now();
  timeline.RecordIteration(7, SyntheticRun(start));
  const double move_ms = timeline.MillisecondsSinceOrigin(start) + 20;
  timeline.RecordSpan("move layers.3 -> stage 1", "migration", move_ms, move_ms + 2.5,
                      {{"layer", "3"}, {"to_stage", "1"}});
  timeline.RecordSpan("checkpoint", "checkpoint", move_ms + 5, move_ms + 5);
  ASSERT_TRUE(timeline.Flush().ok());

  const json trace = ReadJson(path);
  ExpectValidTrace(trace);
  if (HasFatalFailure()) return;
  for (const json& event : trace["traceEvents"]) EXPECT_EQ(event["pid"], 0) << event;

  // The row's name says the rank and the stage.
  bool named = false;
  for (const json& event : Select(trace, "M", "")) {
    if (event["name"] == "process_name") {
      EXPECT_EQ(event["args"]["name"], "rank 0 (stage 3)");
      named = true;
    }
  }
  EXPECT_TRUE(named);

  // Actions: names, args, durations, and offsets from the iteration's start.
  const std::vector<json> compute = Select(trace, "X", "compute");
  ASSERT_EQ(compute.size(), 6u);
  const std::vector<std::string> names = {"F0", "F1", "B0", "W0", "B1", "W1"};
  const std::vector<double> starts_ms = {0, 2, 4, 7, 8, 10}, ends_ms = {2, 4, 7, 8, 10, 11};
  const std::vector<std::string> kinds = {"F", "F", "B", "W", "B", "W"};
  const double origin_us = compute[0]["ts"].get<double>();
  EXPECT_NEAR(origin_us, timeline.MillisecondsSinceOrigin(start) * 1000.0, kToleranceUs);
  for (size_t i = 0; i < compute.size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(compute[i]["name"], names[i]);
    EXPECT_EQ(compute[i]["tid"], 0);
    EXPECT_NEAR(compute[i]["ts"].get<double>() - origin_us, starts_ms[i] * 1000.0, kToleranceUs);
    EXPECT_NEAR(compute[i]["dur"].get<double>(), (ends_ms[i] - starts_ms[i]) * 1000.0,
                kToleranceUs);
    EXPECT_EQ(compute[i]["args"]["iteration"], 7);
    EXPECT_EQ(compute[i]["args"]["microbatch"], names[i][1] - '0');
    EXPECT_EQ(compute[i]["args"]["kind"], kinds[i]);
  }

  // Waits: nested at the start of F0 and B0 (same row, inside the parent), then the
  // 0.75 ms wait for sends after the last action.
  const std::vector<json> waits = Select(trace, "X", "wait");
  ASSERT_EQ(waits.size(), 3u);
  const std::vector<std::pair<double, double>> expected_waits = {{0, 0.5}, {4, 1.0}, {11.25, 0.75}};
  for (size_t i = 0; i < waits.size(); ++i) {
    EXPECT_EQ(waits[i]["name"], "wait");
    EXPECT_EQ(waits[i]["tid"], 0);
    EXPECT_NEAR(waits[i]["ts"].get<double>() - origin_us, expected_waits[i].first * 1000.0,
                kToleranceUs);
    EXPECT_NEAR(waits[i]["dur"].get<double>(), expected_waits[i].second * 1000.0, kToleranceUs);
  }
  EXPECT_EQ(waits[0]["args"]["for"], "F0");
  EXPECT_EQ(waits[1]["args"]["for"], "B0");
  EXPECT_EQ(waits[2]["args"]["for"], "sends");

  // The iteration's own span, on its own row.
  const std::vector<json> iterations = Select(trace, "X", "iteration");
  ASSERT_EQ(iterations.size(), 1u);
  EXPECT_EQ(iterations[0]["name"], "iteration 7");
  EXPECT_NE(iterations[0]["tid"], 0);
  EXPECT_NEAR(iterations[0]["dur"].get<double>(), 12000.0, kToleranceUs);

  // Free-form events: a span with its args, and an instant.
  const std::vector<json> moves = Select(trace, "X", "migration");
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0]["name"], "move layers.3 -> stage 1");
  EXPECT_NEAR(moves[0]["ts"].get<double>(), move_ms * 1000.0, kToleranceUs);
  EXPECT_NEAR(moves[0]["dur"].get<double>(), 2500.0, kToleranceUs);
  EXPECT_EQ(moves[0]["args"]["layer"], "3");
  EXPECT_EQ(moves[0]["args"]["to_stage"], "1");
  const std::vector<json> instants = Select(trace, "i", "checkpoint");
  ASSERT_EQ(instants.size(), 1u);
  EXPECT_EQ(instants[0]["name"], "checkpoint");
}

// Under virtual stages (two chunks per rank) every action names its chunk, chunk 0 too, and
// carries it as an argument; with one chunk the names stay "F0" (the test above).
TEST(TimelineRecorderTest, ActionsOfSeveralChunksNameTheirChunk) {
  auto world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  const std::string path = MakeTempDir() + "/timeline.json";
  TimelineRecorder timeline(world.get(), path, /*stage=*/0);
  StageRunResult run;
  run.start = Clock::now();
  run.timings = {ActionTiming{Action{ActionKind::kForward, 3, 0}, 0, 1, 0.25},
                 ActionTiming{Action{ActionKind::kForward, 3, 1}, 1, 2, 0},
                 ActionTiming{Action{ActionKind::kBackwardInput, 3, 1}, 2, 3, 0},
                 ActionTiming{Action{ActionKind::kBackwardWeight, 3, 0}, 3, 4, 0}};
  run.total_ms = 4;
  run.wait_ms = 0.25;
  timeline.RecordIteration(1, run);
  ASSERT_TRUE(timeline.Flush().ok());
  const json trace = ReadJson(path);
  ExpectValidTrace(trace);
  const std::vector<json> compute = Select(trace, "X", "compute");
  ASSERT_EQ(compute.size(), 4u);
  const std::vector<std::string> names = {"F3.0", "F3.1", "B3.1", "W3.0"};
  const std::vector<int> chunks = {0, 1, 1, 0};
  for (size_t i = 0; i < compute.size(); ++i) {
    EXPECT_EQ(compute[i]["name"], names[i]);
    EXPECT_EQ(compute[i]["args"]["chunk"], chunks[i]);
    EXPECT_EQ(compute[i]["args"]["microbatch"], 3);
  }
  const std::vector<json> waits = Select(trace, "X", "wait");
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0]["args"]["for"], "F3.0");
}

TEST(TimelineRecorderTest, StopsRecordingAfterMaxIterationsAndFlushIsCumulative) {
  auto world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  const std::string path = MakeTempDir() + "/timeline.json";
  TimelineOptions options;
  options.max_iterations = 2;
  options.max_spans = 1;
  TimelineRecorder timeline(world.get(), path, /*stage=*/0, options);

  timeline.RecordIteration(1, SyntheticRun(Clock::now()));
  ASSERT_TRUE(timeline.Flush().ok());
  EXPECT_EQ(Select(ReadJson(path), "X", "compute").size(), 6u);

  for (int64_t i = 2; i <= 5; ++i) timeline.RecordIteration(i, SyntheticRun(Clock::now()));
  timeline.RecordSpan("a", "event", 1, 2);
  timeline.RecordSpan("b", "event", 3, 4);
  EXPECT_EQ(timeline.recorded_iterations(), 2);
  ASSERT_TRUE(timeline.Flush().ok());
  const json trace = ReadJson(path);
  ExpectValidTrace(trace);
  std::set<int64_t> iterations;
  for (const json& event : Select(trace, "X", "compute"))
    iterations.insert(event["args"]["iteration"].get<int64_t>());
  EXPECT_EQ(iterations, (std::set<int64_t>{1, 2}));
  EXPECT_EQ(Select(trace, "X", "event").size(), 1u);
}

TEST(TimelineRecorderTest, FlushReportsAnUnwritablePath) {
  auto world = OneProcessWorld();
  ASSERT_NE(world, nullptr);
  const std::string file = MakeTempDir() + "/a_file";
  std::ofstream(file) << "x";
  TimelineRecorder timeline(world.get(), file + "/timeline.json", /*stage=*/0);
  const absl::Status status = timeline.Flush();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(std::string(status.message()).find(file), std::string::npos) << status;
}

// ---- Several ranks ---------------------------------------------------------------------

const std::string kBin = FULCRUM_BIN_DIR;

// The per-rank half of SlowTimelineTest.ThreeRanksGatherIntoOneFile: runs only when that
// driver started this binary under fulcrum_launch with FULCRUM_TIMELINE_WORKER_OUT set.
// Rank r is stage r and records r + 1 iterations, so every rank sends a different number
// of bytes (the gather pads them).
TEST(TimelineWorker, RecordAndFlush) {
  const char* out = std::getenv("FULCRUM_TIMELINE_WORKER_OUT");
  if (out == nullptr || std::getenv("RANK") == nullptr) {
    GTEST_SKIP() << "runs only under fulcrum_launch, started by SlowTimelineTest";
  }
  auto info = parallel::WorldInfoFromEnvironment();
  ASSERT_TRUE(info.ok()) << info.status();
  auto world =
      parallel::CreateWorldCommunicator(*info, parallel::Backend::kGloo, std::chrono::seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  const int rank = (*world)->rank();
  TimelineRecorder timeline(world->get(), out, /*stage=*/rank);
  for (int i = 0; i <= rank; ++i) timeline.RecordIteration(i, SyntheticRun(Clock::now()));
  EXPECT_TRUE(timeline.Flush().ok());
  (*world)->Barrier();  // Leave together: rank 0 still writes while the others are done.
}

TEST(SlowTimelineTest, ThreeRanksGatherIntoOneFile) {
  const std::string launcher = kBin + "/fulcrum_launch";
  ASSERT_EQ(access(launcher.c_str(), X_OK), 0) << launcher << " is missing: build fulcrum_launch";
  std::string self(4096, '\0');
  const ssize_t length = readlink("/proc/self/exe", self.data(), self.size());
  ASSERT_GT(length, 0);
  self.resize(length);
  const std::string path = MakeTempDir() + "/t.json";
  std::string output;
  const int code = RunCommand("FULCRUM_TIMELINE_WORKER_OUT=" + path + " timeout -k 5 120 " +
                                  launcher + " --nproc_per_node=3 --master_port=0 -- " + self +
                                  " --gtest_filter='TimelineWorker.*'",
                              &output);
  ASSERT_EQ(code, 0) << output;
  EXPECT_TRUE(fulcrum::testing::RanksRanAndPassed(
      output, fulcrum::testing::FirstRanks(3),
      fulcrum::testing::CountSelectedTests(self, "TimelineWorker.*")))
      << output;
  EXPECT_EQ(output.find("[  SKIPPED ]"), std::string::npos) << output;
  const json trace = ReadJson(path);
  ExpectValidTrace(trace);
  if (HasFatalFailure()) return;

  std::map<int, std::set<int64_t>> iterations;
  std::map<int, int> actions;
  std::map<int, std::string> names;
  for (const json& event : trace["traceEvents"]) {
    const int pid = event["pid"];
    if (event["ph"] == "M" && event["name"] == "process_name") names[pid] = event["args"]["name"];
    if (event.value("cat", "") != "compute") continue;
    ++actions[pid];
    iterations[pid].insert(event["args"]["iteration"].get<int64_t>());
    // Every rank's clock starts at the common origin, just before it records.
    EXPECT_GE(event["ts"].get<double>(), 0.0) << event;
    EXPECT_LT(event["ts"].get<double>(), 60e6) << event;
  }
  ASSERT_EQ(names.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(names[r], "rank " + std::to_string(r) + " (stage " + std::to_string(r) + ")");
    EXPECT_EQ(actions[r], 6 * (r + 1)) << "rank " << r;
    EXPECT_EQ(iterations[r].size(), static_cast<size_t>(r + 1)) << "rank " << r;
  }
}

// ---- Through the real binaries --------------------------------------------------------

TEST(SlowTimelineTest, TwoStageZeroBubbleRunDrawsEveryActionOnBothRanks) {
  // A missing binary or flag is a failure, not a skip: the test would prove nothing.
  ASSERT_EQ(access((kBin + "/fulcrum_train").c_str(), X_OK), 0)
      << "fulcrum_train is not built in " << kBin;
  std::string help;
  ASSERT_EQ(RunCommand(kBin + "/fulcrum_train --help", &help), 0) << help;
  ASSERT_NE(help.find("--timeline="), std::string::npos)
      << "fulcrum_train --help does not list --timeline:\n" << help;
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/t.json";
  constexpr int kMicroBatches = 4;  // --global_batch_size / --micro_batch_size.
  std::string output;
  const int code = RunCommand(
      kBin + "/fulcrum_launch --nproc_per_node=2 --master_port=0 -- " + kBin +
          "/fulcrum_train --recipe=tiny --pipeline_model_parallel_size=2 "
          "--pipeline_schedule=zbh1 --train_iters=3 --eval_interval=0 --global_batch_size=16 "
          "--micro_batch_size=4 --timeline=" +
          path,
      &output);
  ASSERT_EQ(code, 0) << output;
  const json trace = ReadJson(path);
  ExpectValidTrace(trace);
  if (HasFatalFailure()) return;

  // pid -> iteration -> the actions it ran; pid -> its compute slices in time order.
  std::map<int, std::map<int64_t, std::set<std::string>>> actions;
  std::map<int, std::vector<std::pair<double, double>>> slices;
  for (const json& event : Select(trace, "X", "compute")) {
    const int pid = event["pid"];
    actions[pid][event["args"]["iteration"].get<int64_t>()].insert(
        event["name"].get<std::string>());
    slices[pid].emplace_back(event["ts"].get<double>(), event["dur"].get<double>());
  }
  ASSERT_EQ(actions.size(), 2u) << "one row per rank";
  EXPECT_TRUE(actions.count(0) && actions.count(1));
  std::set<std::string> expected;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    for (const char* kind : {"F", "B", "W"}) expected.insert(kind + std::to_string(mb));
  }
  for (const auto& [pid, by_iteration] : actions) {
    EXPECT_EQ(by_iteration.size(), 3u) << "rank " << pid << ": every training iteration";
    for (const auto& [iteration, names] : by_iteration) {
      EXPECT_EQ(names, expected) << "rank " << pid << ", iteration " << iteration;
    }
  }
  for (auto& [pid, row] : slices) {
    std::sort(row.begin(), row.end());
    for (size_t i = 1; i < row.size(); ++i) {
      EXPECT_GE(row[i].first + kToleranceUs, row[i - 1].first + row[i - 1].second)
          << "rank " << pid << ": compute slice " << i << " starts before the previous one ends";
    }
  }
  bool named[2] = {false, false};
  for (const json& event : Select(trace, "M", "")) {
    if (event["name"] != "process_name") continue;
    const int pid = event["pid"];
    if (pid < 0 || pid > 1) continue;
    EXPECT_EQ(event["args"]["name"],
              "rank " + std::to_string(pid) + " (stage " + std::to_string(pid) + ")");
    named[pid] = true;
  }
  EXPECT_TRUE(named[0] && named[1]);
}

}  // namespace
}  // namespace fulcrum::pipeline
