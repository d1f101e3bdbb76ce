// bench_moe: one MoE layer, forward and backward, with the index dispatch and combine of
// moe/dispatch.h ("ours") and with GShard's dense formulation (Lepikhin et al. 2020,
// Algorithm 2: a one-hot dispatch mask and a gate-weighted combine tensor, both [T, E, C],
// and two einsums), side by side in one process and interleaved round by round.
//
// Both layers share everything else: the `topk` softmax router of moe/router.h, fixed
// capacity C = ceil(k·T/E) (capacity factor 1) with AssignSlots, and E two-layer GeLU FFNs
// D → H → D as batched matmuls on the [E, C, D] buffer. The layer input requires grad, as
// inside a model, so the backward runs through dispatch too.
//
// Peak memory is the peak of the bytes held by tensors during one forward+backward, above
// what was held just before the forward (inputs, weights, upstream gradient): a counting
// wrapper around LibTorch's default CPU allocator sees every tensor allocation. The weight
// gradients, made during the backward, count on both sides alike; scratch memory that BLAS
// keeps to itself counts on neither.
//
// The first table ("layer") times the whole MoE layer as the model runs it — moe::MoeLayer
// from MakeMoeFactory: router, capacity, dispatch, E GeLU experts, combine, auxiliary loss —
// beside an eager batched-GEMM reference written the way a PyTorch user writes a Tutel-style
// layer: one [E, D, H] and one [E, H, D] weight, `baddbmm` over the [E, C, D] buffer, slots
// from a one-hot cumsum, index_copy / index_add for dispatch and combine, autograd for the
// backward. The reference starts from the layer's own weights, so both compute the same
// function: the table prints the largest output and input-gradient differences.
//
//   build/bin/fulcrum_bench_moe [--tables=layer,dispatch] [--layer_tokens=4096]
//                               [--tokens=4096,16384] [--experts=8,16] [--topk=1,2]
//                               [--hidden=512] [--ffn_hidden=512] [--rounds=3] [--threads=0]
#include <c10/core/CPUAllocator.h>
#include <gflags/gflags.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/config.h"
#include "core/logging.h"
#include "core/malloc_tuning.h"
#include "core/threads.h"
#include "core/transformer_layer.h"
#include "core/unit.h"
#include "moe/capacity.h"
#include "moe/moe_layer.h"
#include "moe/dispatch.h"
#include "moe/router.h"
#include "recipes/cli.h"
#include "tools/internal/bench_util.h"

DEFINE_string(tokens, "4096,16384", "Token counts T to measure (comma-separated).");
DEFINE_string(experts, "8,16", "Expert counts E to measure.");
DEFINE_string(topk, "1,2", "Experts per token k to measure.");
DEFINE_int64(hidden, 512, "Model width D.");
DEFINE_int64(ffn_hidden, 512, "Expert FFN width H.");
DEFINE_int32(rounds, 3,
             "Timed rounds per configuration; each times one forward+backward of each "
             "implementation, and the table shows the medians.");
DEFINE_int32(warmup, 1, "Untimed forward+backward passes of each implementation first.");
DEFINE_int32(threads, 0,
             "Compute threads (LibTorch's intra-op pool); 0: $OMP_NUM_THREADS, else all cores, as "
             "fulcrum_train.");
DEFINE_bool(keep_heap, true,
            "Keep freed memory in the heap as fulcrum_train does (core/malloc_tuning.h); both "
            "sides of each table run in this process, so it applies to both.");
DEFINE_string(tables, "layer,dispatch",
              "Which tables: 'layer' (moe::MoeLayer vs an eager batched-GEMM layer) and/or "
              "'dispatch' (index dispatch/combine vs GShard's one-hot einsums).");
DEFINE_int64(layer_tokens, 4096, "Tokens T of the layer table (seq 1024 x micro-batch 4).");
DEFINE_int64(layer_experts, 8, "Experts E of the layer table.");
DEFINE_int64(layer_topk, 2, "k of the layer table.");
DEFINE_int32(layer_rounds, 7, "Timed rounds of the layer table (median).");
DEFINE_string(profile_trace, "",
              "If set, after the layer table, records LibTorch's op profile of 3 passes of each "
              "side to <this>.moe_layer.json and <this>.eager.json (tools/op_profile_summary.py "
              "sums them by op).");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

// The goal this benchmark checks, at T = 16K tokens.
constexpr double kGoalSpeedup = 3.0;
constexpr double kGoalMemorySaving = 0.8;

// ---- Counting CPU allocator. ----------------------------------------------------------------

// Wraps the default CPU allocator and tracks the bytes currently held and their peak. The
// data pointer stays its own context (as the default allocator's does), so raw_allocate and
// raw_deallocate keep working; the size of each block is looked up on free.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& Instance() {
    static CountingAllocator* instance = new CountingAllocator(c10::GetDefaultCPUAllocator());
    return *instance;
  }

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = inner_->allocate(bytes);
    const c10::Device device = inner.device();
    const c10::DeleterFnPtr inner_deleter = inner.get_deleter();
    void* data = inner.get();
    TORCH_INTERNAL_ASSERT(data == inner.get_context(),
                          "CountingAllocator: the default CPU allocator's context is not its data");
    inner.release_context();
    if (data == nullptr) return {nullptr, nullptr, &Delete, device};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = {bytes, inner_deleter};
    }
    const int64_t now = current_.fetch_add(bytes) + static_cast<int64_t>(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &Delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void ResetPeak() { peak_.store(current_.load()); }

 private:
  struct Block {
    size_t bytes;
    c10::DeleterFnPtr deleter;
  };

  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  static void Delete(void* data) {
    if (data == nullptr) return;
    CountingAllocator& self = Instance();
    Block block;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.blocks_.find(data);
      TORCH_INTERNAL_ASSERT(it != self.blocks_.end(), "CountingAllocator: unknown block");
      block = it->second;
      self.blocks_.erase(it);
    }
    self.current_.fetch_sub(block.bytes);
    block.deleter(data);
  }

  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  mutable std::unordered_map<void*, Block> blocks_;
  mutable std::atomic<int64_t> current_{0};
  mutable std::atomic<int64_t> peak_{0};
};

// ---- The layer. -----------------------------------------------------------------------------

struct Config {
  int64_t tokens, experts, topk;
};

enum class Impl { kOurs, kGShard };

class MoeLayer {
 public:
  MoeLayer(const Config& config, int64_t hidden, int64_t ffn_hidden) : config_(config) {
    moe::RouterOptions options;
    options.num_experts = config.experts;
    options.topk = config.topk;
    options.hidden_size = hidden;
    options.aux_loss_coeff = 0.0;  // the same for both; not what is measured
    auto router = moe::MakeRouter("topk", options);
    TORCH_CHECK(router.ok(), "bench_moe: ", std::string(router.status().message()));
    router_ = std::move(router).value();
    capacity_ = moe::CeilCapacity(1.0, config.topk, config.tokens, config.experts);
    w1_ = (torch::randn({config.experts, hidden, ffn_hidden}) * 0.02).set_requires_grad(true);
    w2_ = (torch::randn({config.experts, ffn_hidden, hidden}) * 0.02).set_requires_grad(true);
    x_ = torch::randn({config.tokens, hidden}).set_requires_grad(true);
    upstream_ = torch::randn({config.tokens, hidden});
  }

  int64_t capacity() const { return capacity_; }

  // One forward+backward; returns {milliseconds, peak bytes above the start}.
  std::pair<double, int64_t> Step(Impl impl) {
    for (at::Tensor* t : {&w1_, &w2_, &x_}) t->mutable_grad() = at::Tensor();
    for (moe::RouterParameter& p : router_->Parameters()) p.value->mutable_grad() = at::Tensor();
    CountingAllocator& counter = CountingAllocator::Instance();
    const int64_t baseline = counter.current();
    counter.ResetPeak();
    const auto start = Clock::now();
    {
      at::Tensor out = impl == Impl::kOurs ? ForwardOurs() : ForwardGShard();
      out.backward(upstream_);
    }
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    return {ms, counter.peak() - baseline};
  }

 private:
  at::Tensor Experts(const at::Tensor& buffer) const {  // [E, C, D] → [E, C, D]
    return at::bmm(at::gelu(at::bmm(buffer, w1_)), w2_);
  }

  std::pair<moe::Routing, moe::SlotAssignment> Route() {
    moe::RouteContext ctx;
    moe::Routing routing = router_->Route(x_, config_.topk, ctx);
    moe::SlotAssignment slots = moe::AssignSlots(routing, config_.experts, capacity_);
    return {std::move(routing), std::move(slots)};
  }

  at::Tensor ForwardOurs() {
    auto [routing, slots] = Route();
    moe::DispatchPlan plan = moe::MakeDispatchPlan(routing, slots, config_.tokens);
    return moe::Combine(Experts(moe::Dispatch(x_, plan)), plan);
  }

  at::Tensor ForwardGShard() {
    auto [routing, slots] = Route();
    const at::Tensor kept = at::nonzero(slots.slot >= 0).view({-1});
    const c10::List<std::optional<at::Tensor>> where({routing.token.index_select(0, kept),
                                                      routing.expert.index_select(0, kept),
                                                      slots.slot.index_select(0, kept)});
    const std::vector<int64_t> shape = {config_.tokens, config_.experts, capacity_};
    const at::Tensor dispatch_mask =
        at::zeros(shape, x_.options()).index_put_(where, at::ones({}, x_.options()));
    const at::Tensor combine =
        at::zeros(shape, x_.options()).index_put(where, routing.gate.index_select(0, kept));
    at::Tensor dispatched = at::einsum("tec,td->ecd", {dispatch_mask, x_});
    return at::einsum("tec,ecd->td", {combine, Experts(dispatched)});
  }

  Config config_;
  std::unique_ptr<moe::Router> router_;
  int64_t capacity_ = 0;
  at::Tensor w1_, w2_, x_, upstream_;
};

// ---- The whole layer: moe::MoeLayer vs an eager batched-GEMM layer. ------------------------

// The eager reference: what a PyTorch user writes for a Tutel-style layer (stacked expert
// weights, batched GEMMs over [E, C, D], slots from a one-hot cumsum), as ATen calls from
// C++, so it pays no interpreter. Same router math as moe/softmax_routers.cc `topk`: softmax
// over linear logits, top-k renormalised, the Switch load-balancing loss; GShard's slot
// order (every token's first choice before any second choice); capacity ceil(k·T/E).
class EagerBatchedMoe {
 public:
  // Copies the layer's weights (global names layers.0.mlp.*) into stacked leaves.
  EagerBatchedMoe(Unit& unit, int64_t experts, int64_t topk, double aux_coeff)
      : experts_(experts), topk_(topk), aux_coeff_(aux_coeff) {
    auto param = [&](const std::string& name) {
      Parameter* p = unit.FindParameter(name);
      TORCH_CHECK(p != nullptr, "bench_moe: the MoE layer has no parameter ", name);
      return p->value.detach();
    };
    router_ = param("mlp.router.weight").clone().set_requires_grad(true);
    std::vector<at::Tensor> w1, b1, w2, b2;
    for (int64_t e = 0; e < experts; ++e) {
      const std::string prefix = "mlp.experts." + std::to_string(e) + ".";
      w1.push_back(param(prefix + "linear_fc1.weight").t());       // [D, H]
      b1.push_back(param(prefix + "linear_fc1.bias").unsqueeze(0));  // [1, H]
      w2.push_back(param(prefix + "linear_fc2.weight").t());       // [H, D]
      b2.push_back(param(prefix + "linear_fc2.bias").unsqueeze(0));  // [1, D]
    }
    w1_ = at::stack(w1).contiguous().set_requires_grad(true);
    b1_ = at::stack(b1).contiguous().set_requires_grad(true);
    w2_ = at::stack(w2).contiguous().set_requires_grad(true);
    b2_ = at::stack(b2).contiguous().set_requires_grad(true);
  }

  // x [.., D] → (out [.., D], auxiliary loss).
  std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& x) {
    const int64_t d = x.size(-1);
    at::Tensor tokens = x.reshape({-1, d});
    const int64_t t = tokens.size(0);
    const int64_t capacity = (topk_ * t + experts_ - 1) / experts_;
    at::Tensor probs = at::softmax(at::linear(tokens, router_), 1);  // [T, E]
    auto [top_p, top_e] = at::topk(probs, topk_, 1);                 // [T, k]
    at::Tensor gates = topk_ > 1 ? top_p / top_p.sum(1, true) : top_p;
    // Choice-major assignments [k·T]: slot = rank among earlier assignments to the expert.
    at::Tensor expert = top_e.t().reshape({-1});
    at::Tensor token = at::arange(t, expert.options()).repeat({topk_});
    at::Tensor gate = gates.t().reshape({-1});
    at::Tensor one_hot = at::one_hot(expert, experts_);                     // [kT, E]
    at::Tensor slot = (at::cumsum(one_hot, 0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1);
    at::Tensor kept = at::nonzero(slot < capacity).squeeze(1);
    at::Tensor kept_token = token.index_select(0, kept);
    at::Tensor position = (expert * capacity + slot).index_select(0, kept);
    at::Tensor kept_gate = gate.index_select(0, kept);
    at::Tensor buffer = at::zeros({experts_ * capacity, d}, tokens.options())
                            .index_copy(0, position, tokens.index_select(0, kept_token))
                            .view({experts_, capacity, d});
    at::Tensor h = at::gelu(at::baddbmm(b1_, buffer, w1_));
    at::Tensor y = at::baddbmm(b2_, h, w2_).view({experts_ * capacity, d});
    at::Tensor out = at::zeros_like(tokens).index_add(
        0, kept_token, y.index_select(0, position) * kept_gate.unsqueeze(1));
    at::Tensor load = at::bincount(expert, /*weights=*/{}, experts_).to(probs.scalar_type());
    at::Tensor aux = aux_coeff_ * static_cast<double>(experts_) *
                     (load / static_cast<double>(t * topk_) * probs.mean(0)).sum();
    return {out.view(x.sizes()), aux};
  }

  void ZeroGrad() {
    for (at::Tensor* p : {&router_, &w1_, &b1_, &w2_, &b2_}) p->mutable_grad() = at::Tensor();
  }

 private:
  int64_t experts_, topk_;
  double aux_coeff_;
  at::Tensor router_, w1_, b1_, w2_, b2_;
};

void MeasureLayer() {
  const int64_t t = FLAGS_layer_tokens, e = FLAGS_layer_experts, k = FLAGS_layer_topk;
  const int64_t seq = 1024, batch = t / seq;  // main checked that 1024 divides t
  ModelOptions model;
  model.hidden_size = FLAGS_hidden;
  model.num_attention_heads = 1;
  model.ffn_hidden_size = FLAGS_ffn_hidden;
  model.num_layers = 1;
  model.seed = 1234;
  moe::MoeOptions options;
  options.num_experts = e;
  options.topk = k;
  options.ffn_hidden_size = FLAGS_ffn_hidden;
  options.capacity_factor = 1.0;
  auto factory = moe::MakeMoeFactory(options, model, moe::MoeGroups());
  TORCH_CHECK(factory.ok(), "bench_moe: ", std::string(factory.status().message()));
  Unit unit("layers.0");
  std::unique_ptr<FeedForward> layer = (*factory)(0, unit, /*initialize=*/true);
  EagerBatchedMoe eager(unit, e, k, options.router_options.aux_loss_coeff);

  const at::Tensor x_value = torch::randn({seq, batch, FLAGS_hidden});
  const at::Tensor upstream = torch::randn({seq, batch, FLAGS_hidden});
  const double loss_scale = 1.0 / static_cast<double>(t);
  // One forward+backward; returns {ms, output, input gradient}.
  auto ours = [&]() {
    unit.ZeroGrad();
    at::Tensor x = x_value.clone().set_requires_grad(true);
    const auto start = Clock::now();
    at::Tensor out = layer->Forward(x, ForwardContext(true, 1, 0, loss_scale));
    out.backward(upstream);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    return std::make_tuple(ms, out.detach(), x.grad());
  };
  auto reference = [&]() {
    eager.ZeroGrad();
    at::Tensor x = x_value.clone().set_requires_grad(true);
    const auto start = Clock::now();
    auto [out, aux] = eager.Forward(x);
    torch::autograd::backward({out, aux}, {upstream, at::full({}, loss_scale * t)});
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    return std::make_tuple(ms, out.detach(), x.grad());
  };
  auto [warm_ms, ours_out, ours_grad] = ours();
  auto [warm_ref_ms, ref_out, ref_grad] = reference();
  const double out_diff = (ours_out - ref_out).abs().max().item<double>();
  const double grad_diff = (ours_grad - ref_grad).abs().max().item<double>();
  const bench::PairedRounds rounds =
      bench::AlternateRounds(FLAGS_layer_rounds, [&] { return std::get<0>(ours()); },
                             [&] { return std::get<0>(reference()); });
  const double ratio = bench::Median(rounds.ratio);
  std::printf("layer: T = %lld [%lld, %lld, %lld], E = %lld, k = %lld, capacity factor 1, "
              "H = %lld, GeLU; forward+backward, median of %d rounds, interleaved\n",
              static_cast<long long>(t), static_cast<long long>(seq),
              static_cast<long long>(batch), static_cast<long long>(FLAGS_hidden),
              static_cast<long long>(e), static_cast<long long>(k),
              static_cast<long long>(FLAGS_ffn_hidden), FLAGS_layer_rounds);
  std::printf("%-12s %-14s %-12s %-22s %s\n", "MoeLayer ms", "eager ref ms", "ratio",
              "max |diff| out, dx", "goal <= 0.8");
  std::printf("%-12.1f %-14.1f %-12.3f %-9.1e %-12.1e %s\n\n", bench::Median(rounds.a),
              bench::Median(rounds.b), ratio, out_diff, grad_diff,
              ratio <= 0.8 ? "met" : "not met");
  std::fflush(stdout);
  if (!FLAGS_profile_trace.empty()) {
    {
      torch::autograd::profiler::RecordProfile profile(FLAGS_profile_trace + ".moe_layer.json");
      for (int i = 0; i < 3; ++i) ours();
    }
    torch::autograd::profiler::RecordProfile profile(FLAGS_profile_trace + ".eager.json");
    for (int i = 0; i < 3; ++i) reference();
  }
}

using bench::Median;

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

void Measure(const Config& config) {
  MoeLayer layer(config, FLAGS_hidden, FLAGS_ffn_hidden);
  for (int i = 0; i < FLAGS_warmup; ++i) {
    layer.Step(Impl::kOurs);
    layer.Step(Impl::kGShard);
  }
  std::vector<double> ours_ms, gshard_ms, ratios;
  int64_t ours_peak = 0, gshard_peak = 0;
  for (int r = 0; r < FLAGS_rounds; ++r) {
    // Alternate which goes first so drift in machine load hits both alike.
    std::pair<double, int64_t> ours, gshard;
    if (r % 2 == 0) {
      ours = layer.Step(Impl::kOurs);
      gshard = layer.Step(Impl::kGShard);
    } else {
      gshard = layer.Step(Impl::kGShard);
      ours = layer.Step(Impl::kOurs);
    }
    ours_ms.push_back(ours.first);
    gshard_ms.push_back(gshard.first);
    ratios.push_back(gshard.first / ours.first);
    ours_peak = std::max(ours_peak, ours.second);
    gshard_peak = std::max(gshard_peak, gshard.second);
  }
  const double speedup = Median(ratios);
  const double saving = 1.0 - static_cast<double>(ours_peak) / static_cast<double>(gshard_peak);
  const bool met = speedup >= kGoalSpeedup && saving >= kGoalMemorySaving;
  std::printf("%6lld %3lld %2lld %6lld | %10.1f %10.1f %7.2fx | %9.1f %10.1f %7.1f%% | %s\n",
              static_cast<long long>(config.tokens), static_cast<long long>(config.experts),
              static_cast<long long>(config.topk), static_cast<long long>(layer.capacity()),
              Median(ours_ms), Median(gshard_ms), speedup, MiB(ours_peak), MiB(gshard_peak),
              100.0 * saving, met ? "met" : "missed");
  std::fflush(stdout);
}

std::vector<int64_t> ParseList(const std::string& flag, const std::string& value) {
  std::vector<int64_t> out;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) {
      std::fprintf(stderr, "bench_moe: --%s must be a list of positive integers, got '%s'\n",
                   flag.c_str(), value.c_str());
      return {};
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_moe";
  help.usage =
      "fulcrum_bench_moe: one MoE layer, forward and backward: moe::MoeLayer vs an eager\n"
      "batched-GEMM layer with the same weights (table \"layer\"), and index dispatch/combine\n"
      "vs GShard's one-hot einsums (table \"dispatch\"), side by side in one process.\n\n"
      "  fulcrum_bench_moe [--tables=layer,dispatch] [--layer_tokens=4096] [--tokens=4096,16384]\n"
      "      [--experts=8,16] [--topk=1,2] [--hidden=512] [--ffn_hidden=512] [--rounds=3]\n\n"
      "Exit status: 0 done, 2 bad flags.\n";
  help.groups = {
      {"Tables", {"tables"}},
      {"Layer table", {"layer_tokens", "layer_experts", "layer_topk", "layer_rounds"}},
      {"Dispatch table", {"tokens", "experts", "topk", "rounds"}},
      {"Both", {"hidden", "ffn_hidden", "warmup", "threads", "keep_heap", "profile_trace"}},
  };
  if (std::optional<int> code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *code;
  }
  fulcrum::InitLogging(argv[0]);
  bool layer_table = false, dispatch_table = false;
  for (absl::string_view table : absl::StrSplit(FLAGS_tables, ',', absl::SkipEmpty())) {
    if (table == "layer") {
      layer_table = true;
    } else if (table == "dispatch") {
      dispatch_table = true;
    } else {
      std::fprintf(stderr, "bench_moe: --tables takes 'layer' and/or 'dispatch', got '%s'\n",
                   FLAGS_tables.c_str());
      return 2;
    }
  }
  if (FLAGS_layer_tokens < 1024 || FLAGS_layer_tokens % 1024 != 0 || FLAGS_layer_experts < 1 ||
      FLAGS_layer_topk < 1 || FLAGS_layer_topk > FLAGS_layer_experts || FLAGS_layer_rounds < 1) {
    std::fprintf(stderr,
                 "bench_moe: need --layer_tokens a multiple of 1024, 1 <= --layer_topk <= "
                 "--layer_experts and --layer_rounds >= 1\n");
    return 2;
  }
  const auto tokens = fulcrum::ParseList("tokens", FLAGS_tokens);
  const auto experts = fulcrum::ParseList("experts", FLAGS_experts);
  const auto topk = fulcrum::ParseList("topk", FLAGS_topk);
  if (tokens.empty() || experts.empty() || topk.empty() || FLAGS_rounds < 1 || FLAGS_hidden < 1 ||
      FLAGS_ffn_hidden < 1) {
    std::fprintf(stderr,
                 "bench_moe: need non-empty --tokens/--experts/--topk, --rounds >= 1, "
                 "--hidden >= 1 and --ffn_hidden >= 1\n");
    return 2;
  }
  for (int64_t k : topk) {
    for (int64_t e : experts) {
      if (k > e) {
        std::fprintf(stderr, "bench_moe: --topk %lld exceeds --experts %lld\n",
                     static_cast<long long>(k), static_cast<long long>(e));
        return 2;
      }
    }
  }
  const fulcrum::ThreadChoice threads = FLAGS_threads > 0
                                            ? fulcrum::ThreadChoice{FLAGS_threads, "--threads"}
                                            : fulcrum::DefaultComputeThreads();
  fulcrum::SetComputeThreads(threads.threads);
  if (FLAGS_keep_heap) fulcrum::KeepStepMemoryInHeap();
  std::printf("threads: %s; keep_heap %s\n", fulcrum::DescribeComputeThreads(threads).c_str(),
              FLAGS_keep_heap ? "true" : "false");
  torch::manual_seed(1234);
  if (layer_table) fulcrum::MeasureLayer();  // its tensors are all freed on return
  if (!dispatch_table) return 0;
  // Before the table's tensors exist, so every block is counted from its allocation to its free.
  c10::SetCPUAllocator(&fulcrum::CountingAllocator::Instance());

  std::printf(
      "MoE layer forward+backward, fp32, D = %lld, H = %lld, capacity factor 1, "
      "%d intra-op threads, median of %d rounds\n",
      static_cast<long long>(FLAGS_hidden), static_cast<long long>(FLAGS_ffn_hidden),
      at::get_num_threads(), FLAGS_rounds);
  std::printf("goal: >=%.0fx faster, >=%.0f%% less activation memory at T=16K\n",
              fulcrum::kGoalSpeedup, 100.0 * fulcrum::kGoalMemorySaving);
  std::printf("%6s %3s %2s %6s | %10s %10s %8s | %9s %10s %8s | %s\n", "T", "E", "k", "C",
              "ours ms", "gshard ms", "ratio", "ours MiB", "gshard MiB", "saving", "goal");
  for (int64_t t : tokens) {
    for (int64_t e : experts) {
      for (int64_t k : topk) fulcrum::Measure({t, e, k});
    }
  }
  return 0;
}
