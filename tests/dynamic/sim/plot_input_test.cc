// fulcrum_plot's input reader (tools/internal/plot_input.h) on text: the three kinds of line,
// iteration order with a resumed run's repeated iterations, and errors naming the line.
#include "tools/internal/plot_input.h"

#include <string>

#include "gtest/gtest.h"

namespace fulcrum::plot {
namespace {

TEST(PlotInputTest, AResumedRunsRepeatedIterationsKeepTheLaterLine) {
  // Iterations 1-3, then a run resumed from iteration 2 appended 3 and 4 again.
  const std::string text =
      "{\"iteration\":1,\"loss\":4}\n{\"iteration\":2,\"loss\":3}\n{\"iteration\":3,\"loss\":2.5}\n"
      "{\"iteration\":3,\"loss\":2.4,\"valid_loss\":2.6}\n{\"iteration\":4,\"loss\":2}\n";
  absl::StatusOr<std::vector<Series>> series = ParsePlotInput(text, "m.jsonl");
  ASSERT_TRUE(series.ok()) << series.status();
  ASSERT_EQ(series->size(), 1u);
  const Series& s = (*series)[0];
  EXPECT_EQ(s.name, "m.jsonl");
  EXPECT_TRUE(s.stages.empty());
  ASSERT_EQ(s.training.size(), 4u);
  EXPECT_EQ(s.training[2].iteration, 3);
  EXPECT_EQ(s.training[2].loss, 2.4);
  EXPECT_EQ(s.training[2].valid_loss, 2.6);
  EXPECT_FALSE(s.training[3].valid_loss.has_value());
  EXPECT_FALSE(s.training[0].lr.has_value());
}

TEST(PlotInputTest, TraceAndSimulationLines) {
  const std::string trace =
      "{\"iteration\":1,\"ran_on\":[[0,2],[2,4]],\"decision\":[[0,1],[1,4]],"
      "\"loads\":[{\"forward_ms\":1,\"backward_ms\":2,\"weight_ms\":3},{\"forward_ms\":4}],"
      "\"measured\":{\"bubble_ratio\":0.25}}\n";
  absl::StatusOr<std::vector<Series>> t = ParsePlotInput(trace, "t.jsonl");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ((*t)[0].stages.size(), 1u);
  EXPECT_EQ((*t)[0].stages[0].stage_ms, (std::vector<double>{6, 4}));
  EXPECT_TRUE((*t)[0].stages[0].decision);
  EXPECT_EQ((*t)[0].stages[0].bubble, 0.25);

  const std::string sim =
      "{\"source\":\"fulcrum_sim\",\"scenario\":\"moe\",\"strategy\":\"a\",\"iteration\":1,"
      "\"stage_ranges\":[[0,4]],\"stage_ms\":[3],\"layers_moved\":0}\n"
      "{\"source\":\"fulcrum_sim\",\"scenario\":\"moe\",\"strategy\":\"b\",\"iteration\":1,"
      "\"stage_ranges\":[[0,4]],\"stage_ms\":[3],\"layers_moved\":2}\n";
  absl::StatusOr<std::vector<Series>> s = ParsePlotInput(sim, "s.jsonl");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->size(), 2u);
  EXPECT_EQ((*s)[1].name, "moe: b");
  EXPECT_TRUE((*s)[1].stages[0].decision);
}

TEST(PlotInputTest, ErrorsNameTheLine) {
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {"{\"iteration\":1,\"loss\":1}\n\n{\"iteration\":2,\"lr\":\"x\"}", "m:3: 'lr' is \"x\""},
           {"{\"iteration\":1,\"stage_ranges\":[[0,0]]}", "m:1: 'stage_ranges' holds [0,0]"},
           {"{\"iteration\":1,\"stage_ranges\":[]}", "m:1: 'stage_ranges' is missing"},
           {"{\"iteration\":1,\"stage_ranges\":[[0,2]],\"bubble_ratio\":2}", "m:1: 'bubble_ratio'"},
           {"{\"iteration\":1,\"stage_ranges\":[[0,2]],\"layers_moved\":-1}", "m:1: 'layers_moved'"},
           {"{\"iteration\":1,\"ran_on\":[[0,2]],\"loads\":[],\"measured\":[]}", "m:1: 'measured'"},
           {"{\"iteration\":1", "m:1: not a JSON object"},
           {"{\"iteration\":-1,\"loss\":1}", "m:1: iteration -1"},
           {"{\"iteration\":18446744073709551615,\"loss\":1}", "m:1: iteration 18446744073709551615"},
           {"\n \n", "m holds no lines"},
       }) {
    absl::StatusOr<std::vector<Series>> series = ParsePlotInput(text, "m");
    ASSERT_FALSE(series.ok()) << text;
    EXPECT_NE(std::string(series.status().message()).find(message), std::string::npos)
        << text << " -> " << series.status();
  }
}

}  // namespace
}  // namespace fulcrum::plot
