// Tests of PipelineMetrics on hand-made stage figures: the bubble ratios, the imbalance, the
// line after a rebalancing and the previous run's part of the load trace.
#include "pipeline/pipeline_metrics.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace fulcrum::pipeline {
namespace {

// A stage's run: `total_ms` long with `wait_ms` blocked, one action computing `compute_ms`
// (its wait and a migration taken out), then `tail_wait_ms` waiting for the others.
StageRunResult MakeRun(double total_ms, double wait_ms, double compute_ms, double tail_wait_ms) {
  StageRunResult run;
  ActionTiming action(Action{}, 0, compute_ms + 3, /*wait_ms=*/2);
  action.migration_ms = 1;
  run.timings.push_back(action);
  run.total_ms = total_ms;
  run.wait_ms = wait_ms;
  run.tail_wait_ms = tail_wait_ms;
  run.peak_activation_bytes = 3 << 20;
  return run;
}

at::Tensor Rows(const std::vector<StageRunResult>& runs) {
  std::vector<at::Tensor> rows;
  for (const StageRunResult& run : runs) rows.push_back(PipelineMetrics::StageRow(run));
  return at::stack(rows);
}

TEST(PipelineMetricsTest, ImbalanceIsTheSpreadOverTheMean) {
  EXPECT_DOUBLE_EQ(Imbalance({10, 20, 30}), 1.0);  // (30 − 10) / 20
  EXPECT_DOUBLE_EQ(Imbalance({5, 5}), 0.0);
  EXPECT_DOUBLE_EQ(Imbalance({}), 0.0);
  EXPECT_DOUBLE_EQ(Imbalance({0, 0}), 0.0);
}

TEST(PipelineMetricsTest, StageRowCountsTheTailWaitAsBubble) {
  const StageRunResult run = MakeRun(/*total_ms=*/80, /*wait_ms=*/20, /*compute_ms=*/50,
                                     /*tail_wait_ms=*/20);
  EXPECT_DOUBLE_EQ(ComputeMs(run), 50);
  const at::Tensor row = PipelineMetrics::StageRow(run);
  ASSERT_EQ(row.numel(), PipelineMetrics::kRowWidth);
  EXPECT_DOUBLE_EQ(row[0].item<double>(), 0.4);   // (20 + 20) / (80 + 20)
  EXPECT_DOUBLE_EQ(row[1].item<double>(), 0.25);  // 20 / 80
  EXPECT_DOUBLE_EQ(row[2].item<double>(), 50);
}

TEST(PipelineMetricsTest, WritesTheMeansOverTheStages) {
  PipelineMetrics metrics;
  const StageRunResult first = MakeRun(80, 20, 40, 20);   // bubble 0.4, in run 0.25
  const StageRunResult second = MakeRun(100, 0, 80, 0);   // bubble 0, in run 0
  metrics.StartRun({}, 4);
  EXPECT_EQ(metrics.EndRun(1, first, Rows({first, second}), /*moves=*/0), "");
  nlohmann::json record;
  std::string line;
  metrics.Write(&record, &line);
  EXPECT_DOUBLE_EQ(record["bubble_ratio"].get<double>(), 0.2);
  EXPECT_DOUBLE_EQ(record["bubble_ratio_max"].get<double>(), 0.4);
  EXPECT_DOUBLE_EQ(record["bubble_ratio_in_run"].get<double>(), 0.125);
  EXPECT_EQ(record["stage_bubble_ratio"], nlohmann::json({0.4, 0.0}));
  EXPECT_EQ(record["stage_ms"], nlohmann::json({40.0, 80.0}));
  EXPECT_DOUBLE_EQ(record["imbalance"].get<double>(), 40.0 / 60.0);
  EXPECT_DOUBLE_EQ(record["pipeline_ms"].get<double>(), 100);  // this stage's run + tail
  EXPECT_DOUBLE_EQ(record["activation_peak_mb"].get<double>(), 3);
  EXPECT_EQ(record["layers_moved"], 0);
  EXPECT_EQ(line, " | bubble 0.200 | imbalance 0.667");
  EXPECT_FALSE(metrics.has_previous());
}

// The caching allocator's figures go into the record where they are tracked (a GPU); on
// the CPU nothing reads as a measured zero: only the activation estimate is written.
TEST(PipelineMetricsTest, WritesTheDeviceMemoryOnlyWhereTracked) {
  PipelineMetrics metrics;
  StageRunResult run = MakeRun(80, 20, 40, 20);
  metrics.StartRun({}, 4);
  metrics.EndRun(1, run, Rows({run}), 0);
  nlohmann::json record;
  std::string line;
  metrics.Write(&record, &line);
  EXPECT_FALSE(record.contains("device_allocated_mb"));
  EXPECT_FALSE(record.contains("device_reserved_mb"));
  EXPECT_FALSE(record.contains("device_peak_allocated_mb"));
  EXPECT_DOUBLE_EQ(record["activation_peak_mb"].get<double>(), 3);

  run.device_memory.tracked = true;
  run.device_memory.allocated_bytes = 5 << 20;
  run.device_memory.reserved_bytes = 8 << 20;
  run.device_memory.peak_allocated_bytes = 6 << 20;
  run.device_memory.peak_reserved_bytes = 8 << 20;
  metrics.EndRun(2, run, Rows({run}), 0);
  record = nlohmann::json::object();
  metrics.Write(&record, &line);
  EXPECT_DOUBLE_EQ(record["device_allocated_mb"].get<double>(), 5);
  EXPECT_DOUBLE_EQ(record["device_reserved_mb"].get<double>(), 8);
  EXPECT_DOUBLE_EQ(record["device_peak_allocated_mb"].get<double>(), 6);
}

// The iteration after one whose tail moved layers is compared with it, once.
TEST(PipelineMetricsTest, TheFirstIterationOnANewPlacementIsComparedWithTheOneBefore) {
  PipelineMetrics metrics;
  const StageRunResult slow = MakeRun(100, 0, 90, 0);
  const StageRunResult fast = MakeRun(100, 50, 30, 0);
  EXPECT_EQ(metrics.EndRun(1, slow, Rows({slow, fast}), /*moves=*/2), "");
  const StageRunResult even = MakeRun(70, 10, 60, 0);
  EXPECT_EQ(metrics.EndRun(2, even, Rows({even, even}), /*moves=*/0),
            "iteration 2, the first on the new placement: bottleneck 60.0 ms (was 90.0), "
            "imbalance 0.000, bubble 0.143 (was 0.250)");
  EXPECT_EQ(metrics.EndRun(3, even, Rows({even, even}), /*moves=*/0), "");
  nlohmann::json record;
  std::string line;
  metrics.Write(&record, &line);
  EXPECT_EQ(record["layers_moved"], 2);
}

TEST(PipelineMetricsTest, LoadTraceGetsWhatThePreviousRunMeasured) {
  PipelineMetrics metrics;
  const StageRunResult run = MakeRun(80, 20, 40, 20);
  metrics.StartRun({}, 4);
  metrics.EndRun(1, run, Rows({run, run}), 0);
  nlohmann::json before;
  metrics.WritePrevious(&before);
  EXPECT_TRUE(before.is_null()) << "nothing before a second run";
  metrics.StartRun({{0, 2}, {2, 4}}, 6);
  ASSERT_TRUE(metrics.has_previous());
  nlohmann::json record;
  metrics.WritePrevious(&record);
  EXPECT_EQ(record["microbatches"], 6);
  EXPECT_EQ(record["ran_on"], nlohmann::json::parse("[[0, 2], [2, 4]]"));
  EXPECT_DOUBLE_EQ(record["measured"]["pipeline_ms"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(record["measured"]["bubble_ratio"].get<double>(), 0.4);
  EXPECT_EQ(record["measured"]["stage_ms"], nlohmann::json({40.0, 40.0}));
}

}  // namespace
}  // namespace fulcrum::pipeline
