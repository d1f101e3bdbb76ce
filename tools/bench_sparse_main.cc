// bench_sparse: the linear layers of a pruned transformer layer, dense (LinearForward: the
// MKL GEMM) against core/sparse_linear.h (SparseLinearForward: CSR/CSC SpMM and an
// SDDMM), side by side in one process, repetitions alternating dense and sparse.
//
// Each repetition runs the forward (F), the backward with a WeightGradStore active (B:
// input and bias gradients) and the store's Flush (W: the weight gradient), exactly as a
// zero-bubble pipeline stage does, and times the three. The weight is magnitude-pruned
// (random weights, so the pattern is unstructured) and the dense path uses the masked
// weight, so both compute the same function. LibTorch's own CSR product (to_sparse_csr and
// addmm) is timed for the forward as a second reference. The table shows medians per
// column and the ratio sparse / dense; the layer summary sums the shapes (by default the
// four products of a gpt_20m layer: hidden 512, FFN 2048) and checks the goal: a 90%-pruned
// layer's F+B+W at most 0.4x the dense layer's.
//
//   build/bin/fulcrum_bench_sparse [--shapes=qkv:1536x512,proj:512x512,fc1:2048x512,
//       fc2:512x2048] [--seq=256] [--micro_batch=4] [--sparsity=0.5,0.8,0.9,0.95]
//       [--threads=1,2] [--reps=7] [--warmup=2] [--libtorch_csr=true] [--dtype=float]
#include <gflags/gflags.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/linear.h"
#include "core/logging.h"
#include "core/sparse_linear.h"
#include "core/threads.h"
#include "recipes/cli.h"

DEFINE_string(shapes, "qkv:1536x512,proj:512x512,fc1:2048x512,fc2:512x2048",
              "Weights to measure, name:OUTxIN, comma-separated.");
DEFINE_int64(seq, 256, "Sequence length; tokens T = seq x micro_batch.");
DEFINE_int64(micro_batch, 4, "Micro-batch size.");
DEFINE_string(sparsity, "0.5,0.8,0.9,0.95", "Pruned fractions to measure.");
DEFINE_string(threads, "1,2", "Intra-op thread counts.");
DEFINE_int32(reps, 7, "Timed repetitions of each path per configuration (medians shown).");
DEFINE_int32(warmup, 2, "Untimed repetitions of each path first.");
DEFINE_bool(libtorch_csr, true, "Also time LibTorch's CSR x dense forward.");
DEFINE_string(dtype, "float", "float or double.");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kGoalSparsity = 0.9;
constexpr double kGoalRatio = 0.4;

struct Shape {
  std::string name;
  int64_t out = 0;
  int64_t in = 0;
};

// Median times (ms) of one path.
struct Times {
  double f = 0, b = 0, w = 0, sum = 0;
};

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string LoadAverage() {
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) != 3) return "unknown";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f %.2f %.2f", load[0], load[1], load[2]);
  return buf;
}

void ClearGrads(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors) const_cast<at::Tensor&>(t).mutable_grad() = at::Tensor();
}

// One F, B, W of `layer` (x, weight, bias → y), timed into f, b, w.
template <typename Layer>
void RunOnce(const Layer& layer, const at::Tensor& x, const at::Tensor& weight,
             const at::Tensor& bias, const at::Tensor& grad_y, std::vector<double>* f,
             std::vector<double>* b, std::vector<double>* w) {
  ClearGrads({x, weight, bias});
  WeightGradStore store;
  const auto t0 = Clock::now();
  at::Tensor y = layer(x, weight, bias);
  const auto t1 = Clock::now();
  {
    WeightGradStore::Scope scope(&store);
    y.backward(grad_y);
  }
  const auto t2 = Clock::now();
  store.Flush();
  const auto t3 = Clock::now();
  TORCH_CHECK(weight.grad().defined() && x.grad().defined() && bias.grad().defined(),
              "bench_sparse: a gradient is missing");
  if (f == nullptr) return;
  f->push_back(Ms(t0, t1));
  b->push_back(Ms(t1, t2));
  w->push_back(Ms(t2, t3));
}

struct Row {
  Times dense, sparse;
  double csr_f = -1;  // < 0: not measured or failed.
};

Row Measure(const Shape& shape, double sparsity, at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor weight = (at::randn({shape.out, shape.in}, opts) * 0.02).requires_grad_();
  at::Tensor bias = (at::randn({shape.out}, opts) * 0.02).requires_grad_();
  // Magnitude pruning: keep the largest |w|.
  const int64_t size = shape.out * shape.in;
  const int64_t pruned = std::min<int64_t>(size - 1, static_cast<int64_t>(sparsity * size));
  const at::Tensor magnitude = weight.detach().abs();
  const at::Tensor threshold =
      std::get<0>(at::kthvalue(magnitude.flatten(), std::max<int64_t>(pruned, 1)));
  const at::Tensor mask = pruned > 0 ? magnitude.gt(threshold) : at::ones_like(magnitude).to(at::kBool);
  {
    at::NoGradGuard no_grad;
    weight.mul_(mask);
  }
  auto sparse = std::make_shared<const SparseWeight>(weight, mask);
  at::Tensor x = at::randn({FLAGS_seq, FLAGS_micro_batch, shape.in}, opts).requires_grad_();
  at::Tensor grad_y = at::randn({FLAGS_seq, FLAGS_micro_batch, shape.out}, opts);

  auto dense_layer = [](const at::Tensor& in, const at::Tensor& w, const at::Tensor& b) {
    return LinearForward(in, w, b);
  };
  auto sparse_layer = [&sparse](const at::Tensor& in, const at::Tensor& w, const at::Tensor& b) {
    return SparseLinearForward(in, sparse, w, b);
  };
  // LibTorch's CSR forward: y = (W_csr · xᵀ)ᵀ + b, into the [T, out] layout.
  at::Tensor csr;
  at::Tensor x2 = x.detach().reshape({-1, shape.in});
  auto csr_forward = [&]() {
    return at::addmm(bias.detach().unsqueeze(1), csr, x2.t()).t().contiguous();
  };
  bool csr_ok = FLAGS_libtorch_csr;
  if (csr_ok) {
    try {
      csr = weight.detach().to_sparse_csr();
      const at::Tensor ref = at::matmul(x2, weight.detach().t()) + bias.detach();
      TORCH_CHECK(at::allclose(csr_forward(), ref, 1e-4, 1e-4), "wrong result");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_sparse: LibTorch CSR forward unavailable: %s\n", e.what());
      csr_ok = false;
    }
  }

  for (int i = 0; i < FLAGS_warmup; ++i) {
    RunOnce(dense_layer, x, weight, bias, grad_y, nullptr, nullptr, nullptr);
    RunOnce(sparse_layer, x, weight, bias, grad_y, nullptr, nullptr, nullptr);
    if (csr_ok) csr_forward();
  }
  std::vector<double> df, db, dw, sf, sb, sw, cf;
  for (int i = 0; i < FLAGS_reps; ++i) {
    // Alternate which path goes first, so neither always follows the other.
    if (i % 2 == 0) {
      RunOnce(dense_layer, x, weight, bias, grad_y, &df, &db, &dw);
      RunOnce(sparse_layer, x, weight, bias, grad_y, &sf, &sb, &sw);
    } else {
      RunOnce(sparse_layer, x, weight, bias, grad_y, &sf, &sb, &sw);
      RunOnce(dense_layer, x, weight, bias, grad_y, &df, &db, &dw);
    }
    if (csr_ok) {
      const auto t0 = Clock::now();
      csr_forward();
      cf.push_back(Ms(t0, Clock::now()));
    }
  }
  auto sums = [](const std::vector<double>& f, const std::vector<double>& b,
                 const std::vector<double>& w) {
    std::vector<double> s(f.size());
    for (size_t i = 0; i < f.size(); ++i) s[i] = f[i] + b[i] + w[i];
    return s;
  };
  Row row;
  row.dense = {Median(df), Median(db), Median(dw), Median(sums(df, db, dw))};
  row.sparse = {Median(sf), Median(sb), Median(sw), Median(sums(sf, sb, sw))};
  if (csr_ok) row.csr_f = Median(cf);
  return row;
}

std::vector<Shape> ParseShapes(const std::string& value) {
  std::vector<Shape> out;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(item, ':');
    std::vector<absl::string_view> dims = absl::StrSplit(parts.back(), 'x');
    Shape shape;
    shape.name = parts.size() == 2 ? std::string(parts[0]) : std::string(parts.back());
    if (parts.size() > 2 || dims.size() != 2 || !absl::SimpleAtoi(dims[0], &shape.out) ||
        !absl::SimpleAtoi(dims[1], &shape.in) || shape.out < 1 || shape.in < 1) {
      std::fprintf(stderr, "bench_sparse: --shapes items must be [name:]OUTxIN, got '%s'\n",
                   std::string(item).c_str());
      return {};
    }
    out.push_back(shape);
  }
  return out;
}

template <typename T, typename Parse>
std::vector<T> ParseList(const char* flag, const std::string& value, Parse parse) {
  std::vector<T> out;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    T v{};
    if (!parse(item, &v)) {
      std::fprintf(stderr, "bench_sparse: bad --%s item '%s'\n", flag, std::string(item).c_str());
      return {};
    }
    out.push_back(v);
  }
  return out;
}

void PrintTable(int threads, const std::vector<Shape>& shapes, const std::vector<double>& sparsities,
                at::ScalarType dtype) {
  SetComputeThreads(threads);
  std::printf("\n== %d thread%s, load average before: %s\n", threads, threads == 1 ? "" : "s",
              LoadAverage().c_str());
  std::printf("%-5s %5s %5s %5s | %7s %7s %7s %7s | %7s %7s %7s %7s | %5s %5s %5s %5s | %7s %5s\n",
              "shape", "out", "in", "spars", "dense F", "B", "W", "F+B+W", "ours F", "B", "W",
              "F+B+W", "r F", "r B", "r W", "r sum", "csr F", "r csr");
  std::vector<Row> rows;
  for (const Shape& shape : shapes) {
    for (double s : sparsities) {
      const Row row = Measure(shape, s, dtype);
      rows.push_back(row);
      const Times& d = row.dense;
      const Times& o = row.sparse;
      std::printf("%-5s %5lld %5lld %5.2f | %7.2f %7.2f %7.2f %7.2f | %7.2f %7.2f %7.2f %7.2f |"
                  " %5.2f %5.2f %5.2f %5.2f |",
                  shape.name.c_str(), static_cast<long long>(shape.out),
                  static_cast<long long>(shape.in), s, d.f, d.b, d.w, d.sum, o.f, o.b, o.w, o.sum,
                  o.f / d.f, o.b / d.b, o.w / d.w, o.sum / d.sum);
      if (row.csr_f >= 0) {
        std::printf(" %7.2f %5.2f\n", row.csr_f, row.csr_f / d.f);
      } else {
        std::printf(" %7s %5s\n", "n/a", "");
      }
      std::fflush(stdout);
    }
  }
  std::printf("layer (sum over %zu shapes), %d thread%s; times in ms, r = ours / dense\n",
              shapes.size(), threads, threads == 1 ? "" : "s");
  std::printf("%5s | %8s %8s | %5s %5s %5s %5s | %s\n", "spars", "dense", "ours", "r F", "r B",
              "r W", "r sum", "goal");
  for (size_t k = 0; k < sparsities.size(); ++k) {
    Times d, o;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Row& row = rows[i * sparsities.size() + k];
      d.f += row.dense.f, d.b += row.dense.b, d.w += row.dense.w, d.sum += row.dense.sum;
      o.f += row.sparse.f, o.b += row.sparse.b, o.w += row.sparse.w, o.sum += row.sparse.sum;
    }
    const double ratio = o.sum / d.sum;
    const bool goal_row = std::abs(sparsities[k] - kGoalSparsity) < 1e-9;
    std::printf("%5.2f | %8.2f %8.2f | %5.2f %5.2f %5.2f %5.2f | %s\n", sparsities[k], d.sum,
                o.sum, o.f / d.f, o.b / d.b, o.w / d.w, ratio,
                goal_row ? (ratio <= kGoalRatio ? "met (<= 0.40)" : "MISSED (> 0.40)") : "");
  }
  std::printf("load average after: %s\n", LoadAverage().c_str());
  std::fflush(stdout);
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_sparse";
  help.usage =
      "fulcrum_bench_sparse: the linear layers of a pruned transformer layer, dense GEMM vs\n"
      "sparse SpMM/SDDMM (core/sparse_linear.h), forward, backward and weight gradient, side\n"
      "by side in one process.\n\n"
      "  fulcrum_bench_sparse [--shapes=qkv:1536x512,proj:512x512,fc1:2048x512,fc2:512x2048]\n"
      "      [--seq=256] [--micro_batch=4] [--sparsity=0.5,0.8,0.9,0.95] [--threads=1,2]\n\n"
      "Exit status: 0 done, 2 bad flags.\n";
  help.groups = {
      {"Shapes", {"shapes", "seq", "micro_batch", "dtype"}},
      {"Measurements", {"sparsity", "threads", "reps", "warmup", "libtorch_csr"}},
  };
  if (std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }

  fulcrum::InitLogging(argv[0]);
  const std::vector<fulcrum::Shape> shapes = fulcrum::ParseShapes(FLAGS_shapes);
  const auto sparsities = fulcrum::ParseList<double>(
      "sparsity", FLAGS_sparsity,
      [](absl::string_view s, double* v) { return absl::SimpleAtod(s, v) && *v >= 0 && *v < 1; });
  const auto threads = fulcrum::ParseList<int>(
      "threads", FLAGS_threads,
      [](absl::string_view s, int* v) { return absl::SimpleAtoi(s, v) && *v >= 1; });
  if (shapes.empty() || sparsities.empty() || threads.empty() || FLAGS_reps < 1 ||
      FLAGS_warmup < 0 || FLAGS_seq < 1 || FLAGS_micro_batch < 1) {
    std::fprintf(stderr,
                 "bench_sparse: need non-empty --shapes, --sparsity (each in [0, 1)) and "
                 "--threads, --reps >= 1, --warmup >= 0, --seq and --micro_batch >= 1\n");
    return 2;
  }
  at::ScalarType dtype;
  if (FLAGS_dtype == "float") {
    dtype = at::kFloat;
  } else if (FLAGS_dtype == "double") {
    dtype = at::kDouble;
  } else {
    std::fprintf(stderr, "bench_sparse: --dtype must be float or double, got '%s'\n",
                 FLAGS_dtype.c_str());
    return 2;
  }
  torch::manual_seed(1234);
  std::printf("fulcrum_bench_sparse: pruned linear layers, %s, T = %lld tokens (seq %lld x "
              "micro-batch %lld), median of %d reps, dense and sparse interleaved\n",
              FLAGS_dtype.c_str(), static_cast<long long>(FLAGS_seq * FLAGS_micro_batch),
              static_cast<long long>(FLAGS_seq), static_cast<long long>(FLAGS_micro_batch),
              FLAGS_reps);
  std::printf("F forward, B input+bias gradient (WeightGradStore active), W weight gradient "
              "(Flush); goal: F+B+W ratio <= %.2f at sparsity %.2f\n",
              fulcrum::kGoalRatio, fulcrum::kGoalSparsity);
  for (int t : threads) fulcrum::PrintTable(t, shapes, sparsities, dtype);
  return 0;
}
