// fulcrum_plot through its binary: two hand-written metrics files (a static run and a
// balancing one that moves a layer and then re-packs) become one SVG whose elements are read
// back: tags balanced, one column per run, a band per stage and iteration at the layers it
// held, the loads and bubble ratios in their polylines, decisions and re-packing marked.
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/run_command.h"

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

std::string Temp(const std::string& name) {
  return ::testing::TempDir() + "/plot_" + std::to_string(::getpid()) + "_" + name;
}

TEST(PlotTest, DrawsStaticAndBalancedRunsSideBySide) {
  const std::string fixed = Temp("static.jsonl"), balanced = Temp("balanced.jsonl");
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
  const std::string svg_path = Temp("out.svg");
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

TEST(PlotTest, RefusesInputItCannotDraw) {
  const std::string bad = Temp("bad.jsonl");
  std::ofstream(bad) << "{\"iteration\":1,\"loss\":2.5}\n";
  std::string output;
  EXPECT_EQ(testing::RunCommand(std::string(FULCRUM_BIN_DIR) + "/fulcrum_plot " + bad + " -o " +
                                    Temp("bad.svg"),
                                &output),
            2);
  EXPECT_NE(output.find("has no stage_ranges"), std::string::npos) << output;
}

}  // namespace
}  // namespace fulcrum
