// fulcrum_plot under virtual pipeline stages: a metrics file whose stage_ranges hold the p·v
// chunk ranges in model order, with stage_range_ranks naming each one's rank, draws a band per
// chunk coloured by its RANK (both chunks of a rank share a colour) with data-rank and
// data-chunk read back here; a file without stage_range_ranks (v = 1) draws as before (no
// such attributes, a colour per stage); ranks that do not fit the ranges exit 2 naming the field.
#include <unistd.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fulcrum {
namespace {

const std::string kPlot = std::string(FULCRUM_BIN_DIR) + "/fulcrum_plot";

std::string Temp(const std::string& name) {
  static const std::string dir = testing::MakeTempDir("plot_chunks");  // one per test process
  return dir + "/" + name;
}

// The attributes of every <rect class="range" .../> of the SVG, in order.
std::vector<std::map<std::string, std::string>> RangeRects(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string svg = text.str();
  std::vector<std::map<std::string, std::string>> out;
  const std::regex tag("<rect class=\"range\"([^>]*)/>"), attribute("([a-z-]+)=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tag); it != std::sregex_iterator();
       ++it) {
    std::map<std::string, std::string> attributes;
    const std::string body = (*it)[1];
    for (auto a = std::sregex_iterator(body.begin(), body.end(), attribute);
         a != std::sregex_iterator(); ++a) {
      attributes[(*a)[1]] = (*a)[2];
    }
    out.push_back(std::move(attributes));
  }
  return out;
}

// One iteration of a p = 2, v = 2 run with `ranks`; returns its range rects.
std::vector<std::map<std::string, std::string>> Draw(const std::string& name,
                                                     const std::string& ranks) {
  const std::string metrics = Temp(name + ".jsonl"), svg = Temp(name + ".svg");
  std::ofstream(metrics) << "{\"iteration\":1,\"loss\":3,\"stage_ranges\":[[0,2],[2,4],[4,6],[6,8]],"
                         << ranks << "\"stage_ms\":[5,6],\"bubble_ratio\":0.2,\"layers_moved\":0}\n";
  std::string output;
  EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + svg, &output), 0) << output;
  return RangeRects(svg);
}

struct Band {
  std::string rank, chunk;
};

void ExpectBands(const std::vector<std::map<std::string, std::string>>& rects,
                 const std::vector<Band>& expected) {
  ASSERT_EQ(rects.size(), expected.size());
  for (size_t k = 0; k < rects.size(); ++k) {
    SCOPED_TRACE("virtual stage " + std::to_string(k));
    EXPECT_EQ(rects[k].at("data-stage"), std::to_string(k));
    EXPECT_EQ(rects[k].at("data-rank"), expected[k].rank);
    EXPECT_EQ(rects[k].at("data-chunk"), expected[k].chunk);
    EXPECT_EQ(rects[k].at("data-begin"), std::to_string(2 * k));
    // Same colour exactly when the same rank.
    for (size_t other = 0; other < rects.size(); ++other) {
      EXPECT_EQ(rects[k].at("fill") == rects[other].at("fill"),
                expected[k].rank == expected[other].rank)
          << "virtual stages " << k << " and " << other;
    }
  }
}

TEST(PlotChunksTest, ZeroBubbleVBandsAreColouredByRank) {
  // V layout at p = 2: rank 0 holds the first and last pieces.
  ExpectBands(Draw("zbv", "\"stage_range_ranks\":[0,1,1,0],"),
              {{"0", "0"}, {"1", "0"}, {"1", "1"}, {"0", "1"}});
}

TEST(PlotChunksTest, InterleavedBandsAreColouredByRank) {
  ExpectBands(Draw("interleaved", "\"stage_range_ranks\":[0,1,0,1],"),
              {{"0", "0"}, {"1", "0"}, {"0", "1"}, {"1", "1"}});
}

TEST(PlotChunksTest, OneChunkDrawsAsBefore) {
  const auto rects = Draw("one_chunk", "");
  ASSERT_EQ(rects.size(), 4u);
  for (size_t k = 0; k < rects.size(); ++k) {
    EXPECT_EQ(rects[k].count("data-rank"), 0u);
    EXPECT_EQ(rects[k].count("data-chunk"), 0u);
    for (size_t other = 0; other < k; ++other) EXPECT_NE(rects[k].at("fill"), rects[other].at("fill"));
  }
  EXPECT_EQ(rects[0].at("fill"), "hsl(0,55%,62%)");  // The stage colour, (stage × 137) mod 360.
  EXPECT_EQ(rects[1].at("fill"), "hsl(137,55%,62%)");
}

TEST(PlotChunksTest, RanksThatDoNotFitTheRangesAreRefused) {
  for (const std::string ranks : {"[0,1,1]", "[0,1,1,4]", "[0,\"1\",1,0]", "7"}) {
    SCOPED_TRACE(ranks);
    const std::string metrics = Temp("bad.jsonl"), svg = Temp("bad.svg");
    std::ofstream(metrics) << "{\"iteration\":1,\"stage_ranges\":[[0,2],[2,4],[4,6],[6,8]],"
                           << "\"stage_range_ranks\":" << ranks << "}\n";
    std::string output;
    EXPECT_EQ(testing::RunCommand(kPlot + " " + metrics + " -o " + svg, &output), 2) << output;
    EXPECT_NE(output.find("stage_range_ranks"), std::string::npos) << output;
    EXPECT_NE(output.find(":1:"), std::string::npos) << output;
  }
}

}  // namespace
}  // namespace fulcrum
