// fulcrum_plot: one self-contained SVG of a balancing run, to open in a browser.
//
//   fulcrum_plot m.jsonl -o m.svg                 a fulcrum_train --metrics_file
//   fulcrum_plot none.jsonl partition.jsonl -o m.svg    runs side by side (static vs balanced)
//   fulcrum_plot trace.jsonl -o t.svg             a --load_trace file
//   fulcrum_plot sim.jsonl -o s.svg               fulcrum_sim --output (one panel per strategy)
//
// Each run (a file, or a strategy of a simulation) is one column of three charts sharing the
// iteration axis: which layer lived on which stage (a band per stage, coloured by stage), each
// stage's load (compute ms) and the bubble ratio; dashed lines mark balancer decisions that
// moved layers (blue) and re-packings, where the stage count changes (red). Elements carry
// their values as data-* attributes (data-iteration, data-stage, data-begin, data-end,
// data-values), so tests and scripts can read the picture back.
//
// Exit codes: 0 written, 2 bad flags or unreadable input.
#include <gflags/gflags.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

DEFINE_string(o, "", "The SVG file to write (required).");
DEFINE_string(title, "", "Title (default: the input file names).");

namespace fulcrum {
namespace {

constexpr int kUsageError = 2;

struct Point {
  int64_t iteration = 0;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // The placement of the iteration.
  std::vector<double> stage_ms;
  double bubble = 0;
  bool decision = false;  // Layers moved in this iteration.
  bool repack = false;    // The stage count changed.
};

struct Series {
  std::string name;
  std::vector<Point> points;
};

std::vector<std::pair<int64_t, int64_t>> Ranges(const nlohmann::json& j) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!j.is_array()) return out;
  for (const auto& r : j) {
    if (r.is_array() && r.size() == 2) out.emplace_back(r[0].get<int64_t>(), r[1].get<int64_t>());
  }
  return out;
}

// Reads one input file into one or more series (a simulation: one per strategy).
bool Read(const std::string& path, std::vector<Series>* out) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "fulcrum_plot: cannot open '%s'\n", path.c_str());
    return false;
  }
  std::map<std::string, size_t> by_name;
  auto series = [&](const std::string& name) -> Series& {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      it = by_name.emplace(name, out->size()).first;
      out->push_back({name, {}});
    }
    return (*out)[it->second];
  };
  std::string text;
  int number = 0;
  int64_t moved_before = 0;
  while (std::getline(in, text)) {
    ++number;
    if (text.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("iteration")) {
      std::fprintf(stderr, "fulcrum_plot: %s:%d is not a metrics, trace or simulation line\n",
                   path.c_str(), number);
      return false;
    }
    Point p;
    p.iteration = j["iteration"].get<int64_t>();
    std::string name = path;
    if (j.contains("loads") && j.contains("ran_on")) {  // --load_trace
      p.ranges = Ranges(j["ran_on"]);
      for (const auto& load : j["loads"]) {
        p.stage_ms.push_back(load.value("forward_ms", 0.0) + load.value("backward_ms", 0.0) +
                             load.value("weight_ms", 0.0));
      }
      p.bubble = j.contains("measured") ? j["measured"].value("bubble_ratio", 0.0) : 0.0;
      p.decision = Ranges(j["decision"]) != p.ranges;
    } else if (j.value("source", "") == "fulcrum_sim") {
      name = absl::StrCat(j.value("scenario", ""), ": ", j.value("strategy", ""));
      p.ranges = Ranges(j["stage_ranges"]);
      p.stage_ms = j.value("stage_ms", std::vector<double>{});
      p.bubble = j.value("bubble_ratio", 0.0);
      p.decision = j.value("layers_moved", 0) > 0;
    } else {  // --metrics_file: stage_ranges after the iteration's moves, moves cumulative.
      if (!j.contains("stage_ranges")) {
        std::fprintf(stderr, "fulcrum_plot: %s:%d has no stage_ranges (a pipeline run's metrics?)\n",
                     path.c_str(), number);
        return false;
      }
      p.ranges = Ranges(j["stage_ranges"]);
      p.stage_ms = j.value("stage_ms", std::vector<double>{});
      p.bubble = j.value("bubble_ratio", 0.0);
      const int64_t moved = j.value("layers_moved", int64_t{0});
      p.decision = moved > moved_before;
      moved_before = moved;
    }
    Series& s = series(name);
    if (!s.points.empty() && s.points.back().ranges.size() != p.ranges.size()) p.repack = true;
    s.points.push_back(std::move(p));
  }
  return true;
}

// Text and attribute values: the five XML specials escaped.
std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Color(int stage) { return absl::StrFormat("hsl(%d,55%%,62%%)", (stage * 137) % 360); }

// One column: the three charts of `s` at horizontal offset x0.
std::string Column(const Series& s, double x0, double width) {
  std::string svg;
  if (s.points.empty()) return svg;
  const int64_t first = s.points.front().iteration, last = s.points.back().iteration;
  const double span = std::max<int64_t>(1, last - first + 1);
  const double dx = width / span;
  auto x_of = [&](int64_t it) { return x0 + (static_cast<double>(it - first)) * dx; };
  int64_t layers = 1;
  size_t stages = 1;
  double max_ms = 0;
  for (const Point& p : s.points) {
    if (!p.ranges.empty()) layers = std::max(layers, p.ranges.back().second);
    stages = std::max(stages, p.ranges.size());
    for (double v : p.stage_ms) max_ms = std::max(max_ms, v);
  }
  if (max_ms <= 0) max_ms = 1;
  const double top1 = 50, h1 = 220, top2 = top1 + h1 + 40, h2 = 150, top3 = top2 + h2 + 40, h3 = 100;
  absl::StrAppend(&svg, "<g class=\"series\" data-name=\"", Escape(s.name), "\">\n");
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"30\" font-size=\"13\" font-weight=\"bold\">%s</text>\n",
                        x0, Escape(s.name));
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">layers on stages (layer 0 at the "
                        "top; %d layers)</text>\n",
                        x0, top1 - 6, layers);
  for (const Point& p : s.points) {
    for (size_t st = 0; st < p.ranges.size(); ++st) {
      const auto [b, e] = p.ranges[st];
      absl::StrAppendFormat(
          &svg,
          "<rect class=\"range\" data-iteration=\"%d\" data-stage=\"%d\" data-begin=\"%d\" "
          "data-end=\"%d\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"/>\n",
          p.iteration, st, b, e, x_of(p.iteration), top1 + h1 * b / layers, dx,
          h1 * (e - b) / layers, Color(static_cast<int>(st)));
    }
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">per-stage load, ms (max %.1f)</text>\n",
                        x0, top2 - 6, max_ms);
  absl::StrAppendFormat(&svg, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                              "stroke=\"#ccc\"/>\n", x0, top2, width, h2);
  for (size_t st = 0; st < stages; ++st) {
    std::vector<std::string> xy, values;
    for (const Point& p : s.points) {
      if (st >= p.stage_ms.size()) continue;
      xy.push_back(absl::StrFormat("%.2f,%.2f", x_of(p.iteration) + dx / 2,
                                   top2 + h2 - h2 * p.stage_ms[st] / max_ms));
      values.push_back(absl::StrFormat("%g", p.stage_ms[st]));
    }
    absl::StrAppendFormat(&svg,
                          "<polyline class=\"load\" data-stage=\"%d\" data-values=\"%s\" points=\"%s\" "
                          "fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"/>\n",
                          st, absl::StrJoin(values, " "), absl::StrJoin(xy, " "),
                          Color(static_cast<int>(st)));
  }
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">bubble ratio (0 to 1)</text>\n",
                        x0, top3 - 6);
  absl::StrAppendFormat(&svg, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                              "stroke=\"#ccc\"/>\n", x0, top3, width, h3);
  std::vector<std::string> xy, values;
  for (const Point& p : s.points) {
    xy.push_back(absl::StrFormat("%.2f,%.2f", x_of(p.iteration) + dx / 2, top3 + h3 - h3 * p.bubble));
    values.push_back(absl::StrFormat("%g", p.bubble));
  }
  absl::StrAppendFormat(&svg,
                        "<polyline class=\"bubble\" data-values=\"%s\" points=\"%s\" fill=\"none\" "
                        "stroke=\"black\" stroke-width=\"1.5\"/>\n",
                        absl::StrJoin(values, " "), absl::StrJoin(xy, " "));
  for (const Point& p : s.points) {
    if (!p.decision && !p.repack) continue;
    absl::StrAppendFormat(
        &svg,
        "<line class=\"%s\" data-iteration=\"%d\" x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
        "stroke=\"%s\" stroke-dasharray=\"4,3\"><title>iteration %d: %s</title></line>\n",
        p.repack ? "repack" : "decision", p.iteration, x_of(p.iteration) + dx, top1,
        x_of(p.iteration) + dx, top3 + h3, p.repack ? "red" : "#2563eb", p.iteration,
        p.repack ? "re-packed" : "layers moved");
  }
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">iteration %d</text>\n", x0,
                        top3 + h3 + 16, first);
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%d</text>\n",
                        x0 + width, top3 + h3 + 16, last);
  svg += "</g>\n";
  return svg;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  gflags::SetUsageMessage("fulcrum_plot INPUT.jsonl... -o OUT.svg: draw balancing runs (metrics, "
                          "load traces or fulcrum_sim --output) side by side");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (argc < 2 || FLAGS_o.empty()) {
    std::fprintf(stderr, "fulcrum_plot: give one or more input files and -o OUT.svg\n");
    return fulcrum::kUsageError;
  }
  std::vector<fulcrum::Series> series;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    inputs.push_back(argv[i]);
    if (!fulcrum::Read(argv[i], &series)) return fulcrum::kUsageError;
  }
  const double column = 420, gap = 40;
  const double width = gap + static_cast<double>(series.size()) * (column + gap);
  std::string svg = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"%.0f\" height=\"640\" viewBox=\"0 0 %.0f 640\" font-family=\"sans-serif\">\n"
      "<title>%s</title>\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, width, fulcrum::Escape(FLAGS_title.empty() ? absl::StrJoin(inputs, " vs ") : FLAGS_title));
  for (size_t i = 0; i < series.size(); ++i) {
    svg += fulcrum::Column(series[i], gap + static_cast<double>(i) * (column + gap), column);
  }
  svg += "</svg>\n";
  std::ofstream out(FLAGS_o);
  out << svg;
  if (!out) {
    std::fprintf(stderr, "fulcrum_plot: cannot write '%s'\n", FLAGS_o.c_str());
    return fulcrum::kUsageError;
  }
  std::printf("wrote %s: %zu run(s), %zu bytes\n", FLAGS_o.c_str(), series.size(), svg.size());
  return 0;
}
