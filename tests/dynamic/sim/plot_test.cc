// fulcrum_plot through its binary: two hand-written metrics files (a static run and a
// balancing one that moves a layer and then re-packs) become one SVG whose elements are read
// back: tags balanced, one column per run, a band per stage and iteration at the layers it
// held, the loads and bubble ratios in their polylines, decisions and re-packing marked. A
// single-process run's metrics give the training curves; bad input exits 2 in one line and
// writes nothing; the SVG never replaces an input.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum {
namespace {

struct Element {
  std::string name;
  std::map<std::string, std::string> attributes;
};

// A small reader of the SVG's tags: every <name a="v" ...>, </name> and <name .../> in order;
// fails the test on unbalanced tags (the writer's output must be well-formed XML).
std::vector<Element> ParseTags(const std::string& svg) {
  std::vector<Element> out;
  std::vector<std::string> open;
  size_t i = 0;
  while ((i = svg.find('<', i)) != std::string::npos) {
    const size_t end = svg.find('>', i);
    EXPECT_NE(end, std::string::npos);
    std::string tag = svg.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty() || tag[0] == '?') continue;
    if (tag[0] == '/') {
      EXPECT_FALSE(open.empty()) << "closing " << tag << " with nothing open";
      if (!open.empty()) {
        EXPECT_EQ(open.back(), tag.substr(1));
        open.pop_back();
      }
      continue;
    }
    const bool self_closing = tag.back() == '/';
    if (self_closing) tag.pop_back();
    Element e;
    size_t p = tag.find_first_of(" \n");
    e.name = tag.substr(0, p);
    while (p != std::string::npos) {
      const size_t eq = tag.find('=', p);
      if (eq == std::string::npos) break;
      std::string key = tag.substr(p + 1, eq - p - 1);
      key.erase(0, key.find_first_not_of(" \n"));
      const size_t q1 = tag.find('"', eq), q2 = tag.find('"', q1 + 1);
      e.attributes[key] = tag.substr(q1 + 1, q2 - q1 - 1);
      p = q2 + 1 < tag.size() ? q2 + 1 : std::string::npos;
    }
    if (!self_closing) open.push_back(e.name);
    out.push_back(std::move(e));
  }
  EXPECT_TRUE(open.empty()) << "unclosed <" << (open.empty() ? "" : open.back()) << ">";
  return out;
}

std::string PlotTemp(const std::string& name) {
  static const std::string dir = testing::MakeTempDir("plot");  // one per test process
  return dir + "/" + name;
}

TEST(PlotTest, DrawsStaticAndBalancedRunsSideBySide) {
  const std::string fixed = PlotTemp("static.jsonl"), balanced = PlotTemp("balanced.jsonl");
  {
    std::ofstream f(fixed);
    for (int i = 1; i <= 3; ++i) {
      f << "{\"iteration\":" << i << ",\"stage_ranges\":[[0,4],[4,8]],\"stage_ms\":[30,10],"
        << "\"bubble_ratio\":0.5,\"layers_moved\":0}\n";
    }
    std::ofstream b(balanced);
    b << "{\"iteration\":1,\"stage_ranges\":[[0,4],[4,8]],\"stage_ms\":[30,10],\"bubble_ratio\":0.5,"
         "\"layers_moved\":0}\n";
    b << "{\"iteration\":2,\"stage_ranges\":[[0,2],[2,8]],\"stage_ms\":[30,10],\"bubble_ratio\":0.5,"
         "\"layers_moved\":2}\n";
    b << "{\"iteration\":3,\"stage_ranges\":[[0,8]],\"stage_ms\":[40],\"bubble_ratio\":0.0,"
         "\"layers_moved\":2}\n";
  }
  const std::string svg_path = PlotTemp("out.svg");
  std::string output;
  ASSERT_EQ(testing::RunCommand(std::string(FULCRUM_BIN_DIR) + "/fulcrum_plot " + fixed + " " +
                                    balanced + " -o " + svg_path,
                                &output),
            0)
      << output;
  std::ifstream in(svg_path);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<Element> tags = ParseTags(text.str());
  ASSERT_FALSE(tags.empty());
  EXPECT_EQ(tags.front().name, "svg");

  std::vector<const Element*> series, ranges, bubbles, loads, decisions, repacks;
  for (const Element& e : tags) {
    const auto cls = e.attributes.find("class");
    if (cls == e.attributes.end()) continue;
    if (cls->second == "series") series.push_back(&e);
    if (cls->second == "range") ranges.push_back(&e);
    if (cls->second == "bubble") bubbles.push_back(&e);
    if (cls->second == "load") loads.push_back(&e);
    if (cls->second == "decision") decisions.push_back(&e);
    if (cls->second == "repack") repacks.push_back(&e);
  }
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0]->attributes.at("data-name"), fixed);
  EXPECT_EQ(series[1]->attributes.at("data-name"), balanced);
  // 3 iterations × 2 stages (static) + 2 + 2 + 1 (balanced).
  ASSERT_EQ(ranges.size(), 11u);
  const Element& moved = *ranges[9];  // Balanced run, iteration 2, stage 1.
  EXPECT_EQ(moved.attributes.at("data-iteration"), "2");
  EXPECT_EQ(moved.attributes.at("data-stage"), "1");
  EXPECT_EQ(moved.attributes.at("data-begin"), "2");
  EXPECT_EQ(moved.attributes.at("data-end"), "8");
  // Its band covers layers 2..8 of 8: 3/4 of the 220-pixel chart, starting a quarter down.
  EXPECT_NEAR(std::stod(moved.attributes.at("height")), 165, 1e-6);
  EXPECT_NEAR(std::stod(moved.attributes.at("y")), 50 + 55, 1e-6);
  ASSERT_EQ(bubbles.size(), 2u);
  EXPECT_EQ(bubbles[1]->attributes.at("data-values"), "0.5 0.5 0");
  ASSERT_EQ(loads.size(), 4u);  // Two stages per run.
  EXPECT_EQ(loads[0]->attributes.at("data-values"), "30 30 30");
  ASSERT_EQ(decisions.size(), 1u);
  EXPECT_EQ(decisions[0]->attributes.at("data-iteration"), "2");
  ASSERT_EQ(repacks.size(), 1u);
  EXPECT_EQ(repacks[0]->attributes.at("data-iteration"), "3");
}

const std::string kPlot = std::string(FULCRUM_BIN_DIR) + "/fulcrum_plot";

// NOTE [long runs]: 250 iterations drawn at --max_points=50 are 50 points of 5 iterations:
// a point's load and bubble are its iterations' means (not one iteration's), a placement held
// by consecutive points is one band spanning them, and a move inside a bucket (at the end of
// iteration 103) shows from the next bucket on, its marker at the end of its own bucket.
TEST(PlotTest, LongRunsAreDrawnInBucketsOfIterations) {
  const std::string run = PlotTemp("long.jsonl");
  {
    std::ofstream f(run);
    for (int i = 1; i <= 250; ++i) {
      f << "{\"iteration\":" << i << ",\"stage_ranges\":"
        << (i <= 103 ? "[[0,4],[4,8]]" : "[[0,3],[3,8]]") << ",\"stage_ms\":[" << i
        << ",10],\"bubble_ratio\":" << (i % 5 == 0 ? 0.5 : 0.0)
        << ",\"layers_moved\":" << (i == 103 ? 1 : 0) << "}\n";
    }
  }
  const std::string svg_path = PlotTemp("long.svg");
  std::string output;
  ASSERT_EQ(testing::RunCommand(kPlot + " " + run + " --max_points=50 -o " + svg_path, &output), 0)
      << output;
  std::ifstream in(svg_path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("5 recorded iterations per point"), std::string::npos);
  const std::vector<Element> tags = ParseTags(text.str());
  std::vector<const Element*> ranges, loads, bubbles, decisions;
  for (const Element& e : tags) {
    const auto cls = e.attributes.find("class");
    if (cls == e.attributes.end()) continue;
    if (cls->second == "range") ranges.push_back(&e);
    if (cls->second == "load") loads.push_back(&e);
    if (cls->second == "bubble") bubbles.push_back(&e);
    if (cls->second == "decision") decisions.push_back(&e);
  }
  // Two placements × two stages: buckets 1-105 (the move's bucket on the placement it began
  // on) and 106-250.
  ASSERT_EQ(ranges.size(), 4u);
  EXPECT_EQ(ranges[0]->attributes.at("data-iteration"), "1");
  EXPECT_EQ(ranges[0]->attributes.at("data-last"), "105");
  EXPECT_EQ(ranges[2]->attributes.at("data-iteration"), "106");
  EXPECT_EQ(ranges[2]->attributes.at("data-last"), "250");
  EXPECT_EQ(ranges[2]->attributes.at("data-end"), "3");
  // The bands tile the 420-pixel column (from x = 40): 105 and 145 of 250 iterations.
  const double dx = 420.0 / 250;
  EXPECT_NEAR(std::stod(ranges[0]->attributes.at("width")), 105 * dx, 1e-6);
  EXPECT_NEAR(std::stod(ranges[2]->attributes.at("x")), 40 + 105 * dx, 0.01);
  EXPECT_NEAR(std::stod(ranges[2]->attributes.at("width")), 145 * dx, 1e-6);
  ASSERT_EQ(loads.size(), 2u);
  std::istringstream values(loads[0]->attributes.at("data-values"));
  std::vector<double> means{std::istream_iterator<double>(values), std::istream_iterator<double>()};
  ASSERT_EQ(means.size(), 50u);
  for (size_t k = 0; k < means.size(); ++k) EXPECT_EQ(means[k], 5.0 * k + 3) << k;  // 5k+1..5k+5
  ASSERT_EQ(bubbles.size(), 1u);
  EXPECT_EQ(bubbles[0]->attributes.at("data-values").substr(0, 7), "0.1 0.1");  // one 0.5 in five
  ASSERT_EQ(decisions.size(), 1u);
  EXPECT_EQ(decisions[0]->attributes.at("data-iteration"), "101");
  EXPECT_NEAR(std::stod(decisions[0]->attributes.at("x1")), 40 + 105 * dx, 0.01);
  // At or under the limit, every iteration is its own point (the default limit is 1000).
  ASSERT_EQ(testing::RunCommand(kPlot + " " + run + " -o " + svg_path, &output), 0) << output;
  std::ifstream again(svg_path);
  std::stringstream full;
  full << again.rdbuf();
  size_t bands = 0;
  for (size_t at = 0; (at = full.str().find("class=\"range\"", at)) != std::string::npos; ++at) ++bands;
  EXPECT_EQ(bands, 500u);
  EXPECT_EQ(full.str().find("iterations per point"), std::string::npos);
  EXPECT_EQ(testing::RunCommand(kPlot + " " + run + " --max_points=0 -o " + svg_path, &output), 2);
  EXPECT_NE(output.find("--max_points=0"), std::string::npos) << output;
}

// The elements of class `cls` in `tags`.
std::vector<const Element*> OfClass(const std::vector<Element>& tags, const std::string& cls) {
  std::vector<const Element*> out;
  for (const Element& e : tags) {
    const auto it = e.attributes.find("class");
    if (it != e.attributes.end() && it->second == cls) out.push_back(&e);
  }
  return out;
}

// A single-process run has no stage ranges: its column is the training curves. The loss the
// writer could not represent (NaN, written as null) is a gap; validation where evaluated.
TEST(PlotTest, DrawsTheTrainingCurvesOfASingleProcessRun) {
  const std::string metrics = PlotTemp("single.jsonl");
  std::ofstream(metrics)
      << "{\"iteration\":1,\"loss\":10.5,\"lr\":0.001,\"grad_norm\":4,\"tokens_per_second\":900,"
         "\"iteration_ms\":70,\"consumed_samples\":8,\"pipeline_size\":1,\"active_ranks\":1}\n"
      << "{\"iteration\":2,\"loss\":null,\"lr\":0.002,\"grad_norm\":3,\"tokens_per_second\":1000,"
         "\"valid_loss\":9.25}\n"
      << "{\"iteration\":3,\"loss\":8,\"lr\":0.002,\"grad_norm\":2,\"tokens_per_second\":1100}\n";
  const std::string svg_path = PlotTemp("single.svg");
  std::string output;
  ASSERT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + svg_path, &output), 0) << output;
  const std::vector<Element> tags = ParseTags(testing::ReadFileBytes(svg_path));
  ASSERT_EQ(OfClass(tags, "series").size(), 1u);
  EXPECT_TRUE(OfClass(tags, "range").empty());
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"loss", "10.5 8"}, {"valid_loss", "9.25"}, {"lr", "0.001 0.002 0.002"},
      {"grad_norm", "4 3 2"}, {"tokens_per_second", "900 1000 1100"}};
  for (const auto& [cls, values] : expected) {
    const std::vector<const Element*> lines = OfClass(tags, cls);
    ASSERT_EQ(lines.size(), 1u) << cls;
    EXPECT_EQ(lines[0]->attributes.at("data-values"), values) << cls;
  }
  EXPECT_EQ(OfClass(tags, "loss")[0]->attributes.at("data-iterations"), "1 3");
  EXPECT_EQ(OfClass(tags, "valid_loss")[0]->attributes.at("data-iterations"), "2");
}

// A pipeline run's metrics keep the per-stage pictures and gain the training curves below.
TEST(PlotTest, PipelineMetricsGetStageAndTrainingCharts) {
  const std::string metrics = PlotTemp("pp.jsonl");
  std::ofstream(metrics) << "{\"iteration\":1,\"loss\":3,\"stage_ranges\":[[0,2],[2,4]],"
                            "\"stage_ms\":[5,6],\"bubble_ratio\":0.2,\"layers_moved\":0}\n"
                         << "{\"iteration\":2,\"loss\":2,\"stage_ranges\":[[0,2],[2,4]],"
                            "\"stage_ms\":[5,6],\"bubble_ratio\":0.2,\"layers_moved\":0}\n";
  std::string output;
  ASSERT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + PlotTemp("pp.svg"), &output), 0) << output;
  const std::vector<Element> tags = ParseTags(testing::ReadFileBytes(PlotTemp("pp.svg")));
  EXPECT_EQ(OfClass(tags, "range").size(), 4u);
  ASSERT_EQ(OfClass(tags, "loss").size(), 1u);
  EXPECT_EQ(OfClass(tags, "loss")[0]->attributes.at("data-values"), "3 2");
  // Below the stage charts (which end at y = 600).
  const std::string points = OfClass(tags, "loss")[0]->attributes.at("points");
  EXPECT_GT(std::stod(points.substr(points.find(',') + 1)), 600) << points;
}

// Inputs that crashed it (a string where a number belongs, non-numeric stage ranges, a trace
// line with malformed loads) or that it drew as an empty picture: exit 2, one line naming the
// file and line, and no SVG written.
TEST(PlotTest, BadInputExitsTwoInOneLineAndWritesNothing) {
  const std::string trace_head =
      "{\"iteration\":1,\"ran_on\":[[0,1],[1,2]],\"decision\":[[0,1],[1,2]],\"loads\":";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"iteration\":\"1\",\"loss\":2}", ":1: no integer 'iteration'"},
      {"{\"iteration\":1,\"loss\":\"low\"}", ":1: 'loss' is \"low\""},
      {"{\"iteration\":1,\"stage_ranges\":[[0,2],[2,4]],\"stage_ms\":[\"5\",6]}", ":1: 'stage_ms'"},
      {"{\"iteration\":1,\"stage_ranges\":[[\"0\",\"2\"]]}", ":1: 'stage_ranges' holds"},
      {"{\"iteration\":1,\"stage_ranges\":[[0,2],[3,4]]}", ":1: 'stage_ranges' holds [3,4]"},
      {trace_head + "3}", ":1: 'loads' is not an array"},
      {trace_head + "[{\"forward_ms\":\"x\"}]}", ":1: a stage load's 'forward_ms'"},
      {"{\"iteration\":1,\"source\":\"fulcrum_sim\",\"scenario\":1}", ":1: a fulcrum_sim line"},
      {"{\"iteration\":1,\"note\":\"nothing to draw\"}", ":1: neither a metrics line"},
      {"[1,2,3]", ":1: not a JSON object"},
      {"", " holds no lines to draw"},
  };
  int k = 0;
  for (const auto& [line, message] : cases) {
    const std::string input = PlotTemp("bad" + std::to_string(k) + ".jsonl");
    const std::string svg = PlotTemp("bad" + std::to_string(k++) + ".svg");
    std::ofstream(input) << line << (line.empty() ? "" : "\n");
    std::remove(svg.c_str());
    std::string output;
    EXPECT_EQ(testing::RunCommand(kPlot + " " + input + " -o " + svg, &output), 2) << line << "\n" << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_NE(output.find(input + message), std::string::npos) << line << "\n" << output;
    EXPECT_FALSE(std::ifstream(svg).good()) << line;
  }
}

TEST(PlotTest, NeverWritesOntoAnInputNorOverAGoodSvgOnFailure) {
  const std::string metrics = PlotTemp("input.jsonl");
  std::ofstream(metrics) << "{\"iteration\":1,\"loss\":2.5}\n";
  const std::string before = testing::ReadFileBytes(metrics);
  std::string output;
  const std::string dir = metrics.substr(0, metrics.rfind('/'));
  for (const std::string& o : {metrics, dir + "/./" + metrics.substr(metrics.rfind('/') + 1)}) {
    EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + o, &output), 2) << output;
    EXPECT_NE(output.find("refusing to overwrite"), std::string::npos) << output;
  }
  EXPECT_EQ(testing::ReadFileBytes(metrics), before);
  // Nor onto the temporary file the atomic write starts with (-o OUT writes OUT.tmp first).
  const std::string tmp_input = PlotTemp("picture.svg.tmp");
  std::ofstream(tmp_input) << "{\"iteration\":1,\"loss\":2.5}\n";
  EXPECT_EQ(testing::RunCommand(kPlot + " " + tmp_input + " -o " + PlotTemp("picture.svg"), &output), 2);
  EXPECT_NE(output.find("refusing to overwrite"), std::string::npos) << output;
  EXPECT_EQ(testing::ReadFileBytes(tmp_input), "{\"iteration\":1,\"loss\":2.5}\n");

  const std::string svg = PlotTemp("kept.svg"), broken = PlotTemp("broken.jsonl");
  std::ofstream(svg) << "<svg>the previous picture</svg>\n";
  std::ofstream(broken) << "{\"iteration\":1,\"loss\":2.5}\n{\"iteration\":2,\"loss\":[]}\n";
  EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " " + broken + " -o " + svg, &output), 2);
  EXPECT_EQ(testing::ReadFileBytes(svg), "<svg>the previous picture</svg>\n");
  EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + PlotTemp("no/such/dir.svg"), &output), 2);
  EXPECT_NE(output.find("does not exist"), std::string::npos) << output;
  EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + dir, &output), 2);
  EXPECT_NE(output.find("is a directory"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum
