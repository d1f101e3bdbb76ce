// fulcrum_plot: one self-contained SVG of one or more runs, to open in a browser.
//
//   fulcrum_plot m.jsonl -o m.svg                 a fulcrum_train --metrics_file (any run)
//   fulcrum_plot none.jsonl partition.jsonl -o m.svg    runs side by side (static vs balanced)
//   fulcrum_plot trace.jsonl -o t.svg             a --load_trace file
//   fulcrum_plot sim.jsonl -o s.svg               fulcrum_sim --output (one panel per strategy)
//
// Each run (a file, or a strategy of a simulation) is one column of charts sharing the
// iteration axis. A pipeline run (a metrics file with stage ranges, a trace, a simulation)
// gets three: which layer lived on which stage (a band per stage, coloured by stage; with
// virtual stages a band per chunk, coloured by its rank, with data-rank and data-chunk), each
// stage's load (compute ms) and the bubble ratio; dashed lines mark balancer decisions that
// moved layers (blue) and re-packings, where the stage count changes (red). A metrics file
// also gets its training curves: the loss (train, and validation where it was evaluated), the
// learning rate, the gradient norm and tokens/s. Elements carry their values as data-*
// attributes (data-iteration, data-stage, data-begin, data-end, data-values,
// data-iterations), so tests and scripts can read the picture back. What the inputs may hold:
// NOTE [plot input] in tools/internal/plot_input.h.
//
// Exit codes: 0 written, 2 bad flags or unreadable input (one line, before anything is
// written), 1 the SVG could not be written. The SVG is written atomically (a temporary file
// renamed over -o) and never onto an input.
#include <gflags/gflags.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/file_system.h"
#include "recipes/cli.h"
#include "tools/internal/plot_input.h"

DEFINE_string(o, "", "The SVG file to write (required).");
DEFINE_string(title, "", "Title (default: the input file names).");
DEFINE_int64(max_points, 1000,
             "The most points a run's pipeline charts draw; a longer run is drawn in buckets of "
             "consecutive iterations (NOTE [long runs]). Must be >= 1.");

namespace fulcrum {
namespace {

constexpr int kUsageError = 2;
constexpr double kTop = 50;  // Below the column title.

using plot::Series;
using plot::StagePoint;
using plot::TrainingPoint;

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

// NOTE [long runs]
// A simulation of DynMo's 10 000 iterations has one point per iteration and stage per
// strategy: drawn one by one, an SVG of hundreds of megabytes. Above --max_points points a
// run's pipeline charts are drawn in buckets of k = ceil(points / max_points) consecutive
// points: a bucket's load and bubble are its points' means (a stage's over the points that
// had it), its placement the one its first point ran on (a move inside it shows from the next
// bucket on, where its marker stands, at the bucket's end), and it carries a decision
// (re-packing) marker when any of its points moved layers (changed the stage count). Bands of
// consecutive buckets on the same placement are one rect (data-iteration its first iteration,
// data-last its last). A bucket spans the iterations from its first point to the next
// bucket's, so a file that records every n-th iteration draws to scale. The chart says "k
// recorded iterations per point". Runs at or under the limit are drawn point by point.
struct Drawn {
  std::vector<StagePoint> points;
  int64_t last = 0;       // The run's last iteration.
  int64_t per_point = 1;  // Recorded points per drawn point.
};

// One drawn point: the mean of points [begin, end) (NOTE [long runs]).
StagePoint Bucket(const std::vector<StagePoint>& points, size_t begin, size_t end) {
  StagePoint bucket = points[begin];
  size_t stages = 0;
  for (size_t i = begin; i < end; ++i) stages = std::max(stages, points[i].stage_ms.size());
  bucket.stage_ms.assign(stages, 0.0);
  bucket.bubble = 0;
  std::vector<int64_t> counts(stages, 0);
  for (size_t i = begin; i < end; ++i) {
    const StagePoint& p = points[i];
    bucket.bubble += p.bubble / static_cast<double>(end - begin);
    bucket.decision = bucket.decision || p.decision;
    bucket.repack = bucket.repack || p.repack;
    for (size_t st = 0; st < p.stage_ms.size(); ++st) {
      bucket.stage_ms[st] += p.stage_ms[st];
      ++counts[st];
    }
  }
  for (size_t st = 0; st < stages; ++st) {
    if (counts[st] > 0) bucket.stage_ms[st] /= static_cast<double>(counts[st]);
  }
  return bucket;
}

Drawn Bucketed(const std::vector<StagePoint>& points, int64_t max_points) {
  Drawn drawn;
  drawn.last = points.back().iteration;
  const size_t n = points.size();
  if (static_cast<int64_t>(n) <= max_points) {
    drawn.points = points;
    return drawn;
  }
  drawn.per_point = (static_cast<int64_t>(n) + max_points - 1) / max_points;
  const size_t k = static_cast<size_t>(drawn.per_point);
  for (size_t begin = 0; begin < n; begin += k) {
    drawn.points.push_back(Bucket(points, begin, std::min(n, begin + k)));
  }
  return drawn;
}

// The end of the run of points from `k` on that hold points[k]'s placement: merged into one
// band when bucketed (NOTE [long runs]), else k + 1.
size_t BandEnd(const Drawn& drawn, size_t k) {
  const std::vector<StagePoint>& points = drawn.points;
  size_t end = k + 1;
  while (drawn.per_point > 1 && end < points.size() && points[end].ranges == points[k].ranges &&
         points[end].ranks == points[k].ranks) {
    ++end;
  }
  return end;
}

// The three pipeline charts of `s` at horizontal offset x0, from kTop; appended to `svg`.
// Returns the y below them.
double StageCharts(const Series& s, double x0, double width, std::string* out) {
  std::string& svg = *out;
  const Drawn drawn = Bucketed(s.stages, FLAGS_max_points);
  const std::vector<StagePoint>& points = drawn.points;
  const int64_t first = points.front().iteration, last = drawn.last;
  const double span = std::max<int64_t>(1, last - first + 1);
  const double dx = width / span;
  auto x_of = [&](int64_t it) { return x0 + (static_cast<double>(it - first)) * dx; };
  // The iterations point k stands for end where the next point's begin (the run's end for
  // the last); its width on the axis.
  auto end_of = [&](size_t k) {
    return k + 1 < points.size() ? points[k + 1].iteration : last + 1;
  };
  auto width_of = [&](size_t k) { return x_of(end_of(k)) - x_of(points[k].iteration); };
  int64_t layers = 1;
  size_t stages = 1;
  double max_ms = 0;
  for (const StagePoint& p : points) {
    if (!p.ranges.empty()) layers = std::max(layers, p.ranges.back().second);
    // Load lines are per rank: with chunks the ranges outnumber the ranks.
    stages = std::max(stages, p.ranks.empty()
                                  ? p.ranges.size()
                                  : static_cast<size_t>(*std::max_element(p.ranks.begin(), p.ranks.end()) + 1));
    for (double v : p.stage_ms) max_ms = std::max(max_ms, v);
  }
  if (max_ms <= 0) max_ms = 1;
  const double top1 = kTop, h1 = 220, top2 = top1 + h1 + 40, h2 = 150, top3 = top2 + h2 + 40, h3 = 100;
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">layers on stages (layer 0 at the "
                        "top; %d layers)%s</text>\n",
                        x0, top1 - 6, layers,
                        drawn.per_point > 1
                            ? absl::StrFormat("; %d recorded iterations per point", drawn.per_point)
                            : std::string());
  for (size_t k = 0, band_end = 0; k < points.size(); k = band_end) {
    const StagePoint& p = points[k];
    band_end = BandEnd(drawn, k);
    const int64_t band_last = end_of(band_end - 1) - 1;
    const double band_width = drawn.per_point > 1 ? x_of(band_last + 1) - x_of(p.iteration) : dx;
    const std::string band_last_attribute =
        drawn.per_point > 1 ? absl::StrFormat(" data-last=\"%d\"", band_last) : std::string();
    std::vector<int> chunks_seen;  // Per rank: its ranges drawn so far in this point.
    for (size_t st = 0; st < p.ranges.size(); ++st) {
      const auto [b, e] = p.ranges[st];
      // With chunks a band is coloured by the rank that holds it (a rank's chunks share a
      // colour) and names its rank and chunk; a rank's chunks run in model order in both
      // layouts (interleaved: chunk k / p; V: chunk 0 descends, chunk 1 comes back), so the
      // chunk is how many of the rank's ranges came before. One chunk: exactly as before.
      std::string chunk_attributes;
      int colour = static_cast<int>(st);
      if (!p.ranks.empty()) {
        const int rank = p.ranks[st];
        if (chunks_seen.size() <= static_cast<size_t>(rank)) chunks_seen.resize(rank + 1, 0);
        chunk_attributes =
            absl::StrFormat(" data-rank=\"%d\" data-chunk=\"%d\"", rank, chunks_seen[rank]++);
        colour = rank;
      }
      absl::StrAppendFormat(
          &svg,
          "<rect class=\"range\" data-iteration=\"%d\"%s data-stage=\"%d\"%s data-begin=\"%d\" "
          "data-end=\"%d\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"/>\n",
          p.iteration, band_last_attribute, st, chunk_attributes, b, e, x_of(p.iteration),
          top1 + h1 * b / layers, band_width, h1 * (e - b) / layers, Color(colour));
    }
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">per-stage load, ms (max %.1f)</text>\n",
                        x0, top2 - 6, max_ms);
  absl::StrAppendFormat(&svg, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                              "stroke=\"#ccc\"/>\n", x0, top2, width, h2);
  for (size_t st = 0; st < stages; ++st) {
    std::vector<std::string> xy, values;
    for (size_t k = 0; k < points.size(); ++k) {
      const StagePoint& p = points[k];
      if (st >= p.stage_ms.size()) continue;
      xy.push_back(absl::StrFormat("%.2f,%.2f", x_of(p.iteration) + width_of(k) / 2,
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
  for (size_t k = 0; k < points.size(); ++k) {
    const double mid = x_of(points[k].iteration) + width_of(k) / 2;
    xy.push_back(absl::StrFormat("%.2f,%.2f", mid, top3 + h3 - h3 * points[k].bubble));
    values.push_back(absl::StrFormat("%g", points[k].bubble));
  }
  absl::StrAppendFormat(&svg,
                        "<polyline class=\"bubble\" data-values=\"%s\" points=\"%s\" fill=\"none\" "
                        "stroke=\"black\" stroke-width=\"1.5\"/>\n",
                        absl::StrJoin(values, " "), absl::StrJoin(xy, " "));
  for (size_t k = 0; k < points.size(); ++k) {
    const StagePoint& p = points[k];
    if (!p.decision && !p.repack) continue;
    const double at = x_of(p.iteration) + width_of(k);  // the end of the point's iterations
    absl::StrAppendFormat(
        &svg,
        "<line class=\"%s\" data-iteration=\"%d\" x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
        "stroke=\"%s\" stroke-dasharray=\"4,3\"><title>iteration %d: %s</title></line>\n",
        p.repack ? "repack" : "decision", p.iteration, at, top1, at, top3 + h3,
        p.repack ? "red" : "#2563eb", p.iteration,
        p.repack ? "re-packed" : "layers moved");
  }
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">iteration %d</text>\n", x0,
                        top3 + h3 + 16, first);
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%d</text>\n",
                        x0 + width, top3 + h3 + 16, last);
  return top3 + h3 + 40;
}

// One line of a training chart: (iteration, value) pairs.
struct Curve {
  const char* cls;  // The polyline's class: the metrics field it draws.
  const char* color;
  std::vector<std::pair<int64_t, double>> values;
};

// A chart of `curves` over iterations [first, last], from y = top; appended to `svg`. Returns
// the y below it (top, unchanged, when no curve has a value).
double Chart(const std::string& title, const std::vector<Curve>& curves, int64_t first, int64_t last,
             double x0, double width, double top, std::string* svg) {
  double lo = 0, hi = 0;
  bool any = false;
  for (const Curve& c : curves) {
    for (const auto& [it, v] : c.values) {
      lo = any ? std::min(lo, v) : v;
      hi = any ? std::max(hi, v) : v;
      any = true;
    }
  }
  if (!any) return top;
  if (hi == lo) {  // A flat curve sits in the middle of the chart.
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.05;
    lo -= pad;
    hi += pad;
  }
  const double height = 110;
  const double span = static_cast<double>(std::max<int64_t>(1, last - first));
  auto x_of = [&](int64_t it) { return x0 + width * static_cast<double>(it - first) / span; };
  auto y_of = [&](double v) { return top + height - height * (v - lo) / (hi - lo); };
  absl::StrAppendFormat(svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">%s (%g to %g)</text>\n",
                        x0, top - 6, Escape(title), lo, hi);
  absl::StrAppendFormat(svg, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                             "stroke=\"#ccc\"/>\n", x0, top, width, height);
  for (const Curve& c : curves) {
    if (c.values.empty()) continue;
    std::vector<std::string> xy, values, iterations;
    for (const auto& [it, v] : c.values) {
      xy.push_back(absl::StrFormat("%.2f,%.2f", x_of(it), y_of(v)));
      values.push_back(absl::StrFormat("%g", v));
      iterations.push_back(absl::StrCat(it));
    }
    // A single value still shows: a polyline of one point draws nothing, a circle does.
    if (c.values.size() == 1) {
      absl::StrAppendFormat(svg, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n",
                            x_of(c.values[0].first), y_of(c.values[0].second), c.color);
    }
    absl::StrAppendFormat(svg,
                          "<polyline class=\"%s\" data-iterations=\"%s\" data-values=\"%s\" "
                          "points=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"/>\n",
                          c.cls, absl::StrJoin(iterations, " "), absl::StrJoin(values, " "),
                          absl::StrJoin(xy, " "), c.color);
  }
  return top + height + 40;
}

// The training charts of `s` (loss, learning rate, grad norm, tokens/s) from y = top.
double TrainingCharts(const Series& s, double x0, double width, double top, std::string* svg) {
  const int64_t first = s.training.front().iteration, last = s.training.back().iteration;
  auto curve = [&](const char* cls, const char* color,
                   std::optional<double> TrainingPoint::*field) {
    Curve c{cls, color, {}};
    for (const TrainingPoint& p : s.training) {
      if (p.*field) c.values.emplace_back(p.iteration, *(p.*field));
    }
    return c;
  };
  double y = top;
  y = Chart("loss (train black, validation orange)",
            {curve("loss", "black", &TrainingPoint::loss),
             curve("valid_loss", "#ea580c", &TrainingPoint::valid_loss)},
            first, last, x0, width, y, svg);
  y = Chart("learning rate", {curve("lr", "#2563eb", &TrainingPoint::lr)}, first, last, x0, width,
            y, svg);
  y = Chart("gradient norm", {curve("grad_norm", "#7c3aed", &TrainingPoint::grad_norm)}, first,
            last, x0, width, y, svg);
  y = Chart("tokens/s", {curve("tokens_per_second", "#16a34a", &TrainingPoint::tokens_per_second)},
            first, last, x0, width, y, svg);
  if (y > top) {
    absl::StrAppendFormat(svg, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\">iteration %d</text>\n",
                          x0, y - 24, first);
    absl::StrAppendFormat(svg,
                          "<text x=\"%.1f\" y=\"%.1f\" font-size=\"11\" text-anchor=\"end\">%d</text>\n",
                          x0 + width, y - 24, last);
  }
  return y;
}

// One column: the charts of `s` at horizontal offset x0. `*bottom` gets the y below them.
std::string Column(const Series& s, double x0, double width, double* bottom) {
  std::string svg;
  absl::StrAppend(&svg, "<g class=\"series\" data-name=\"", Escape(s.name), "\">\n");
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"30\" font-size=\"13\" font-weight=\"bold\">%s</text>\n",
                        x0, Escape(s.name));
  double y = kTop;
  if (!s.stages.empty()) y = StageCharts(s, x0, width, &svg);
  if (!s.training.empty()) y = TrainingCharts(s, x0, width, y, &svg);
  svg += "</g>\n";
  *bottom = y;
  return svg;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_plot";
  help.takes_arguments = true;  // the files to draw
  help.usage =
      "fulcrum_plot: one self-contained SVG of one or more runs, side by side.\n\n"
      "  fulcrum_plot INPUT.jsonl... -o OUT.svg\n\n"
      "An input is a fulcrum_train --metrics_file (any run), a --load_trace file or a\n"
      "fulcrum_sim --output (one column per strategy).\n"
      "Exit status: 0 written, 2 bad flags or unreadable input (one line, before anything is\n"
      "written), 1 the SVG could not be written. The SVG is written atomically and never onto\n"
      "an input.\n";
  help.groups = {{"Output", {"o", "title", "max_points"}}};
  if (std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }
  if (FLAGS_max_points < 1) {
    std::fprintf(stderr, "fulcrum_plot: --max_points=%lld must be >= 1\n",
                 static_cast<long long>(FLAGS_max_points));
    return fulcrum::kUsageError;
  }
  if (argc < 2 || FLAGS_o.empty()) {
    std::fprintf(stderr, "fulcrum_plot: give one or more input files and -o OUT.svg\n");
    return fulcrum::kUsageError;
  }
  std::vector<std::string> inputs(argv + 1, argv + argc);
  for (const std::string& input : inputs) {
    // WriteFileAtomically writes OUT.tmp first: that must not be an input either.
    if (fulcrum::IsSameFile(input, FLAGS_o) || fulcrum::IsSameFile(input, FLAGS_o + ".tmp")) {
      std::fprintf(stderr, "fulcrum_plot: -o %s is the input %s; refusing to overwrite it\n",
                   FLAGS_o.c_str(), input.c_str());
      return fulcrum::kUsageError;
    }
  }
  if (fulcrum::DefaultFileSystem()->IsDirectory(FLAGS_o)) {
    std::fprintf(stderr, "fulcrum_plot: -o %s is a directory\n", FLAGS_o.c_str());
    return fulcrum::kUsageError;
  }
  if (!fulcrum::DefaultFileSystem()->IsDirectory(fulcrum::DirName(FLAGS_o))) {
    std::fprintf(stderr, "fulcrum_plot: -o %s: the directory '%s' does not exist\n", FLAGS_o.c_str(),
                 fulcrum::DirName(FLAGS_o).c_str());
    return fulcrum::kUsageError;
  }
  std::vector<fulcrum::Series> series;
  for (const std::string& input : inputs) {
    absl::StatusOr<std::string> text = fulcrum::DefaultFileSystem()->ReadFile(input);
    absl::StatusOr<std::vector<fulcrum::Series>> read =
        text.ok() ? fulcrum::plot::ParsePlotInput(*text, input)
                  : absl::StatusOr<std::vector<fulcrum::Series>>(text.status());
    if (!read.ok()) {
      std::fprintf(stderr, "fulcrum_plot: %s\n", std::string(read.status().message()).c_str());
      return fulcrum::kUsageError;
    }
    series.insert(series.end(), read->begin(), read->end());
  }
  const double column = 420, gap = 40;
  const double width = gap + static_cast<double>(series.size()) * (column + gap);
  std::string columns;
  double height = 0;
  for (size_t i = 0; i < series.size(); ++i) {
    double bottom = 0;
    columns += fulcrum::Column(series[i], gap + static_cast<double>(i) * (column + gap), column, &bottom);
    height = std::max(height, bottom);
  }
  std::string svg = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
      "<title>%s</title>\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height, width, height,
      fulcrum::Escape(FLAGS_title.empty() ? absl::StrJoin(inputs, " vs ") : FLAGS_title));
  svg += columns;
  svg += "</svg>\n";
  if (absl::Status s = fulcrum::WriteFileAtomically(fulcrum::DefaultFileSystem(), FLAGS_o, svg);
      !s.ok()) {
    std::fprintf(stderr, "fulcrum_plot: -o %s: %s\n", FLAGS_o.c_str(), std::string(s.message()).c_str());
    return 1;
  }
  std::printf("wrote %s: %zu run(s), %zu bytes\n", FLAGS_o.c_str(), series.size(), svg.size());
  return 0;
}
