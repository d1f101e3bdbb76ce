// bench_train: framework overhead of fulcrum_train's training step.
//
// For each model (the `tiny` recipe's shape and the ~20M `gpt_20m` shape) it times, in one
// process and interleaved round by round, (a) Fulcrum's Trainer::TrainIteration on the
// embedded corpus and (b) the same model and optimizer written as a plain LibTorch loop
// (torch::nn modules, torch::optim::AdamW, clip_grad_norm_, gradient accumulation) on
// pre-generated tokens, with no framework around it. It prints the median tokens/s of both
// and their ratio; the goal is framework overhead ≤ 5% (ratio ≥ 0.95).
//
// With --compare_reference it also times tools/bench_train_reference.py, the same model in
// PyTorch on the same LibTorch (the venv's torch, tools/setup.sh), eager and under
// torch.compile, as two coprocesses driven over pipes so their rounds interleave with
// Fulcrum's at the same thread count; it prints ms/step of all four and Fulcrum's time ratio
// to eager (goal ≤ 0.9) and to compiled (goal ≤ 1.0). Without a python that imports torch it
// says so and measures the rest. The `gpt_8k` shape is issue 16's: 4 layers, hidden 256, 4 heads, seq
// 128, micro-batch 8, vocab 8000, untied output layer.
//
// Then, with --layouts, it trains the tiny recipe under each parallel layout (through
// fulcrum_launch and Gloo, on this machine's cores) and prints the median tokens/s of each
// next to one process's.
//
// With --device=cuda (issue 23) it measures on one GPU, by default the ~1.3B `gpt_1p3b` shape
// (24 layers, hidden 2048, 16 heads, seq 2048; --bf16 for bf16 compute over fp32 weights),
// and every run ends with one table per model: ms/step, tokens/s and MFU of each side. There
// the sides run one after another, each alone on the GPU (NOTE [sides on a GPU]).
// NOTE [model FLOPs]: MFU counts the model's FLOPs, not the kernels': per token
// 6·N + 12·L·h·s, N the parameters of the matrix products (L·(4h² + 2h·ffn) + h·vocab: the
// output layer, tied or not; embeddings lookups and norms excluded), L layers, hidden h,
// sequence s — forward and backward, the attention scores and context counted whole
// (causal masking not subtracted, as PaLM's appendix B counts them) — over the GPU's dense
// bf16 peak, found by name (H100 SXM and H200: 989 TFLOP/s; H100 PCIe 756; A100 312). On
// the CPU the column reads "n/a on CPU".
//
//   build/bin/fulcrum_bench_train [--rounds=5] [--iters_per_round=5] [--models=tiny,gpt_20m]
//                                 [--layouts=1,tp2,dp2,tp2dp2] [--layout_iters=30]
//                                 [--compare_reference] [--threads=0] [--cross_entropy]
//                                 [--device=cpu|cuda|cuda:N|auto] [--bf16] [--quick]
#include <ATen/DeviceAccelerator.h>
#include <ATen/autocast_mode.h>
#include <gflags/gflags.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/str_split.h"
#include "absl/strings/match.h"
#include "core/checkpoint/checkpoint.h"
#include "core/data/default_corpus.h"
#include "core/device.h"
#include "core/data/tokenizer.h"
#include "core/logging.h"
#include "core/malloc_tuning.h"
#include "core/tensor_parallel.h"
#include "core/threads.h"
#include "core/trainer.h"
#include "core/usable_cores.h"
#include "recipes/cli.h"
#include "tools/internal/bench_util.h"

DEFINE_int32(rounds, 5, "Interleaved measurement rounds per model.");
DEFINE_int32(iters_per_round, 5, "Training iterations per round and implementation.");
DEFINE_int32(warmup_iters, 2, "Untimed iterations of each implementation before measuring.");
DEFINE_string(models, "tiny,gpt_20m", "Which model shapes to measure (empty: none).");
DEFINE_string(layouts, "1,tp2,dp2,tp2dp2",
              "Parallel layouts to time with the tiny recipe: 1 (one process), tpN, dpN, tpNdpM; "
              "empty skips them.");
DEFINE_int32(layout_iters, 30, "Iterations per layout run (the first 5 are not counted).");
DEFINE_bool(memory_features, false,
            "Also measure the memory features with fulcrum_train on the tiny recipe, each "
            "against the run without it: optimizer bytes per rank with "
            "--use_distributed_optimizer at dp=2, the activation peak with "
            "--recompute_granularity=full at pp=2 and with --sequence_parallel at pp=2 x tp=2, "
            "each with the iteration time, the bytes a rank writes per save with "
            "--ckpt_format=sharded against full at tp=2 x dp=2 with the distributed optimizer, "
            "and what a save every 2 iterations costs one process's training loop (an 11M-"
            "parameter GPT) with --async_save and without. "
            "The two runs of a pair alternate, --memory_rounds times; --layout_iters iterations "
            "each.");
DEFINE_int32(memory_rounds, 2, "Alternating rounds per --memory_features pair.");
DEFINE_bool(save_cost, false,
            "Only the last row of --memory_features: what a save every 2 iterations costs one "
            "process's training loop (an 11M-parameter GPT, --layout_iters iterations), with "
            "--async_save and without, the runs rotating --memory_rounds times.");
DEFINE_bool(compare_reference, false,
            "Also time the same model in PyTorch eager and under torch.compile "
            "(tools/bench_train_reference.py under --reference_python), interleaved; skipped "
            "with a note if that python cannot import torch.");
DEFINE_string(reference_python, FULCRUM_VENV_PYTHON,
              "Python that runs the reference (default: the venv that holds this build's "
              "LibTorch).");
DEFINE_string(reference_script, "",
              "Path of bench_train_reference.py; empty: <binary dir>/../../tools/.");
DEFINE_string(profile_trace, "",
              "If set, after measuring, records a Kineto profile of 3 Fulcrum steps per model "
              "to <this>.<model>.json (chrome trace: host ops, and each kernel on a GPU; "
              "tools/op_profile_summary.py sums it by op, --kernels by kernel).");
DEFINE_bool(keep_heap, true,
            "Keep freed step memory in the heap (core/malloc_tuning.h); the PyTorch-eager "
            "reference keeps glibc's defaults either way.");
DEFINE_int32(threads, 0,
             "Intra-op threads for both sides; 0: $OMP_NUM_THREADS, else all cores "
             "(as fulcrum_train).");
DEFINE_bool(cross_entropy, false,
            "Also time the loss alone: VocabParallelCrossEntropy on one rank against LibTorch's "
            "cross_entropy_loss (log_softmax + nll_loss), forward+backward on each model's "
            "[micro-batch x seq, vocab] logits, interleaved (NOTE [cross-entropy backward in "
            "place] in core/tensor_parallel.cc).");
DEFINE_string(reference_wait_policy, "same",
              "OMP_WAIT_POLICY of the PyTorch-eager reference: 'same' (this process's) or "
              "'default' (unset: libgomp's default, spinning before it sleeps, as a PyTorch user "
              "runs it).");

DEFINE_string(device, "cpu",
              "Where both sides train: cpu, cuda (GPU 0), cuda:N, or auto (cuda when visible). "
              "On a GPU the default model is gpt_1p3b and the layouts are skipped.");
DEFINE_bool(bf16, false, "bf16 compute with fp32 weights and optimizer state, on every side.");
DEFINE_bool(quick, false,
            "2 rounds of 2 iterations after 1 warm-up (flags given explicitly win): what "
            "tools/gpu_check.sh --quick runs.");

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  std::string name;
  int64_t layers, hidden, heads, ffn, seq, micro_batch, global_batch;
  int64_t vocab = 384;  // The byte tokenizer's.
  bool untied = false;
};

const Shape kShapes[] = {{"tiny", 4, 128, 4, 512, 128, 8, 16},
                         {"gpt_20m", 6, 512, 8, 2048, 256, 4, 16},
                         {"gpt_8k", 4, 256, 4, 1024, 128, 8, 8, 8000, true},
                         // Issue 23's GPU benchmark: ~1.3B parameters (GPT-3 XL's shape).
                         {"gpt_1p3b", 24, 2048, 16, 8192, 2048, 2, 8, 50304}};

c10::Device g_device(c10::kCPU);

// NOTE [model FLOPs] in the header comment.
double ModelFlopsPerToken(const Shape& s) {
  const double h = double(s.hidden);
  const double matmul_params = double(s.layers) * (4.0 * h * h + 2.0 * h * double(s.ffn)) +
                               h * double(s.vocab);
  return 6.0 * matmul_params + 12.0 * double(s.layers) * h * double(s.seq);
}

// The dense bf16 peak of GPU `index` by its name (nvidia-smi), in FLOP/s; 0 when unknown.
double GpuPeakFlops(int index, std::string* name) {
  const std::string command =
      "nvidia-smi --query-gpu=name --format=csv,noheader -i " + std::to_string(index) + " 2>/dev/null";
  name->clear();
  if (std::FILE* pipe = popen(command.c_str(), "r")) {
    char line[256];
    if (std::fgets(line, sizeof(line), pipe) != nullptr) *name = line;
    pclose(pipe);
  }
  while (!name->empty() && (name->back() == '\n' || name->back() == ' ')) name->pop_back();
  if (absl::StrContains(*name, "H100") && absl::StrContains(*name, "PCIe")) return 756e12;
  if (absl::StrContains(*name, "H100") || absl::StrContains(*name, "H200")) return 989e12;
  if (absl::StrContains(*name, "A100")) return 312e12;
  return 0;
}

// The one place the Fulcrum side learns --device and --bf16: the device seam
// (ModelOptions::device_spec, core/device.h) — fp32 masters, bf16 compute under --bf16.
absl::Status ConnectFulcrumDevice(TrainerConfig& config) {
  config.model.device_spec =
      DeviceSpec{g_device, /*master_dtype=*/at::kFloat, FLAGS_bf16 ? at::kBFloat16 : at::kFloat};
  return config.model.device_spec.Validate();
}

// Waits for the GPU's queued work, so wall time counts work rather than launches.
void Synchronize() {
  if (g_device.is_cuda()) torch::cuda::synchronize(g_device.index());
}

std::string g_reference_script;

// The PyTorch twin (tools/bench_train_reference.py), eager or compiled, as a coprocess:
// Run(n) asks it for n steps and returns their wall seconds (negative once it has failed).
class Reference {
 public:
  static std::unique_ptr<Reference> Start(const Shape& s, int threads, bool compiled) {
    const std::string& python = FLAGS_reference_python;
    if (python.empty() ||
        std::system((python + " -c 'import torch' > /dev/null 2>&1").c_str()) != 0) {
      std::printf("  (reference: '%s' cannot import torch; run tools/setup.sh or pass "
                  "--reference_python)\n", python.c_str());
      return nullptr;
    }
    // A reference that dies (out of memory, say) must fail its side, not kill this process
    // with SIGPIPE at the next request: writes to it then fail and Run returns -1.
    std::signal(SIGPIPE, SIG_IGN);
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return nullptr;
    std::vector<std::string> args = {python, g_reference_script,
                                     "--layers=" + std::to_string(s.layers),
                                     "--hidden=" + std::to_string(s.hidden),
                                     "--heads=" + std::to_string(s.heads),
                                     "--ffn=" + std::to_string(s.ffn),
                                     "--seq=" + std::to_string(s.seq),
                                     "--micro_batch=" + std::to_string(s.micro_batch),
                                     "--global_batch=" + std::to_string(s.global_batch),
                                     "--vocab=" + std::to_string(s.vocab),
                                     "--threads=" + std::to_string(threads),
                                     "--warmup=" + std::to_string(FLAGS_warmup_iters),
                                     "--device=" + g_device.str()};
    if (FLAGS_bf16) args.push_back("--bf16");
    if (s.untied) args.push_back("--untied");
    if (compiled) args.push_back("--compile");
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      close(to_child[1]);
      close(from_child[0]);
      setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
      if (FLAGS_reference_wait_policy == "default") unsetenv("OMP_WAIT_POLICY");
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());  // --reference_python may be a bare name (python3)
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    auto ref = std::unique_ptr<Reference>(new Reference);
    ref->pid_ = pid;
    ref->in_ = fdopen(to_child[1], "w");
    ref->out_ = fdopen(from_child[0], "r");
    char line[256];
    if (std::fgets(line, sizeof(line), ref->out_) == nullptr || std::strncmp(line, "ready", 5) != 0) {
      std::printf("  (reference: %s%s did not start)\n", g_reference_script.c_str(),
                  compiled ? " --compile" : "");
      return nullptr;
    }
    return ref;
  }
  double Run(int steps) {
    std::fprintf(in_, "%d\n", steps);
    std::fflush(in_);
    char line[256];
    if (std::fgets(line, sizeof(line), out_) == nullptr) return -1;
    return std::atof(line);
  }
  ~Reference() {
    if (in_ != nullptr) std::fclose(in_);
    if (out_ != nullptr) std::fclose(out_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

 private:
  pid_t pid_ = -1;
  std::FILE* in_ = nullptr;
  std::FILE* out_ = nullptr;
};

// ---- The plain LibTorch reference: same math, no framework. ---------------------------
struct PlainBlockImpl : torch::nn::Module {
  PlainBlockImpl(const Shape& s) : heads(s.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})));
    qkv = register_module("qkv", torch::nn::Linear(s.hidden, 3 * s.hidden));
    proj = register_module("proj", torch::nn::Linear(s.hidden, s.hidden));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})));
    fc1 = register_module("fc1", torch::nn::Linear(s.hidden, s.ffn));
    fc2 = register_module("fc2", torch::nn::Linear(s.ffn, s.hidden));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& future) {  // [s, b, h]
    const int64_t s = x.size(0), b = x.size(1), h = x.size(2), d = h / heads;
    auto t = qkv(ln1(x)).view({s, b, heads, 3, d});
    auto q = t.select(3, 0).permute({1, 2, 0, 3});
    auto k = t.select(3, 1).permute({1, 2, 0, 3});
    auto v = t.select(3, 2).permute({1, 2, 0, 3});
    auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(d)));
    auto probs = torch::softmax(scores.masked_fill(future, -INFINITY), -1);
    auto context = torch::matmul(probs, v).permute({2, 0, 1, 3}).reshape({s, b, h});
    x = x + proj(context);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(PlainBlock);

struct PlainGptImpl : torch::nn::Module {
  PlainGptImpl(const Shape& s, int64_t vocab) {
    wte = register_module("wte", torch::nn::Embedding(vocab, s.hidden));
    if (s.untied) {
      head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(s.hidden, vocab).bias(false)));
    }
    wpe = register_module("wpe", torch::nn::Embedding(s.seq, s.hidden));
    for (int64_t i = 0; i < s.layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), PlainBlock(s)));
    }
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.hidden})));
    future = torch::ones({s.seq, s.seq}, torch::kBool).triu(1);
  }
  torch::Tensor forward(const torch::Tensor& tokens) {  // [b, s+1] → summed loss
    const int64_t s = tokens.size(1) - 1;
    auto x = wte(tokens.narrow(1, 0, s).t()) + wpe->weight.narrow(0, 0, s).unsqueeze(1);
    for (auto& block : blocks) x = block->forward(x, future);
    auto logits = head ? head(lnf(x)) : torch::matmul(lnf(x), wte->weight.t());
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), tokens.narrow(1, 1, s).t().reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::Linear head{nullptr};
  std::vector<PlainBlock> blocks;
  torch::nn::LayerNorm lnf{nullptr};
  torch::Tensor future;
};
TORCH_MODULE(PlainGpt);

using bench::Median;

// One row per side: ms/step, tokens/s, MFU (NOTE [model FLOPs]); a side not measured says
// why. Printed for every model on every device.
void PrintThroughputTable(const Shape& shape, double tokens, const std::vector<double>& fulcrum,
                          const std::vector<double>& plain, const std::vector<double>& eager,
                          const std::vector<double>& compiled, const std::string& fulcrum_missing) {
  std::string gpu;
  const double peak = g_device.is_cuda() ? GpuPeakFlops(std::max<int>(g_device.index(), 0), &gpu) : 0;
  const double flops_per_token = ModelFlopsPerToken(shape);
  std::printf("%s on %s%s%s, %s; %.3g model FLOPs per token (6N + 12*L*h*s):\n", shape.name.c_str(),
              g_device.str().c_str(), gpu.empty() ? "" : (" (" + gpu + ")").c_str(),
              peak > 0 ? (", bf16 peak " + std::to_string(int(peak / 1e12)) + " TFLOP/s").c_str() : "",
              FLAGS_bf16 ? "bf16 compute, fp32 weights" : "fp32", flops_per_token);
  std::printf("  %-16s %10s %12s %12s\n", "side", "ms/step", "tokens/s", "MFU");
  auto row = [&](const char* side, const std::vector<double>& ms, const std::string& missing) {
    if (ms.empty()) {
      std::printf("  %-16s %s\n", side, missing.c_str());
      return;
    }
    const double rate = tokens / Median(ms) * 1e3;
    char mfu[64];
    if (g_device.is_cpu()) {
      std::snprintf(mfu, sizeof(mfu), "n/a on CPU");
    } else if (peak <= 0) {
      std::snprintf(mfu, sizeof(mfu), "n/a (unknown GPU peak)");
    } else {
      std::snprintf(mfu, sizeof(mfu), "%.1f%%", 100.0 * rate * flops_per_token / peak);
    }
    std::printf("  %-16s %10.1f %12.0f %12s\n", side, Median(ms), rate, mfu);
  };
  row("fulcrum", fulcrum, "not measured: " + fulcrum_missing);
  row("plain libtorch", plain, "not measured");
  row("pytorch eager", eager, "not measured (--compare_reference)");
  row("torch.compile", compiled, "not measured (--compare_reference)");
  // Per-layer CUDA-event timing (issue 23 item 5) is not in this build: no on/off row yet.
  std::fflush(stdout);
}

void Measure(const Shape& shape, std::shared_ptr<const data::IndexedDataset> corpus) {
  const int64_t vocab = shape.vocab;
  TrainerConfig config;
  config.model.num_layers = shape.layers;
  config.model.hidden_size = shape.hidden;
  config.model.num_attention_heads = shape.heads;
  config.model.ffn_hidden_size = shape.ffn;
  config.model.seq_length = shape.seq;
  config.model.vocab_size = vocab;
  config.model.tie_embeddings = !shape.untied;
  config.train.micro_batch_size = shape.micro_batch;
  config.train.global_batch_size = shape.global_batch;
  config.train.train_iters = 1 << 30;
  config.data.seq_length = shape.seq;
  config.data.split = "100,0,0";
  const absl::Status connected = ConnectFulcrumDevice(config);
  auto make_trainer = [&]() -> absl::StatusOr<std::unique_ptr<Trainer>> {
    if (!connected.ok()) return connected;
    absl::StatusOr<std::unique_ptr<Trainer>> made = Trainer::Create(config, corpus);
    if (!made.ok()) {
      std::fprintf(stderr, "bench_train: %s\n", std::string(made.status().message()).c_str());
      std::exit(1);
    }
    return made;
  };

  // The plain LibTorch side: the model and its optimizer.
  struct PlainSide {
    PlainSide(const Shape& shape, int64_t vocab) : model(shape, vocab) {
      model->to(g_device);
      model->future = model->future.to(g_device);
      adamw = std::make_unique<torch::optim::AdamW>(
          model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    }
    PlainGpt model;
    std::unique_ptr<torch::optim::AdamW> adamw;
  };
  const int64_t micro = shape.global_batch / shape.micro_batch;
  const double tokens = double(shape.global_batch) * double(shape.seq);
  torch::Tensor batches = torch::randint(vocab, {micro, shape.micro_batch, shape.seq + 1},
                                         torch::TensorOptions(torch::kLong).device(g_device));
  auto plain_step = [&](PlainSide& plain) {
    plain.adamw->zero_grad();
    // --bf16 as PyTorch users write it: autocast over fp32 weights (only around the forward).
    for (int64_t m = 0; m < micro; ++m) {
      at::autocast::set_autocast_enabled(g_device.type(), FLAGS_bf16);
      if (FLAGS_bf16) at::autocast::set_autocast_dtype(g_device.type(), at::kBFloat16);
      torch::Tensor loss = plain.model->forward(batches[m]);
      at::autocast::set_autocast_enabled(g_device.type(), false);
      at::autocast::clear_cache();
      (loss.to(torch::kFloat) / tokens).backward();
    }
    torch::nn::utils::clip_grad_norm_(plain.model->parameters(), 1.0);
    plain.adamw->step();
  };
  auto fulcrum_step = [&](Trainer& trainer) {
    auto stats = trainer.TrainIteration();
    if (!stats.ok()) std::exit(1);
  };
  // Milliseconds per step of `step`, over --iters_per_round steps.
  auto ms_per_step = [&](const std::function<void()>& step) {
    const auto start = Clock::now();
    for (int i = 0; i < FLAGS_iters_per_round; ++i) step();
    Synchronize();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count() /
           FLAGS_iters_per_round;
  };
  // ms per step of each side, per round.
  std::vector<double> ours, theirs, eager, compiled;
  auto time_reference = [&](Reference* reference, std::vector<double>* ms) {
    if (reference == nullptr) return;
    const double seconds = reference->Run(FLAGS_iters_per_round);
    if (seconds > 0) ms->push_back(seconds / FLAGS_iters_per_round * 1e3);
  };
  auto start_reference = [&](bool compiled_side) -> std::unique_ptr<Reference> {
    if (!FLAGS_compare_reference) return nullptr;
    return Reference::Start(shape, at::get_num_threads(), compiled_side);
  };
  auto profile = [&](Trainer& trainer) {
    if (FLAGS_profile_trace.empty()) return;
    // Kineto, as torch.profiler records: the ops on the host and, on a GPU, every kernel's
    // own time on the device (tools/op_profile_summary.py --kernels sums those).
    namespace prof = torch::profiler::impl;
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
    if (g_device.is_cuda()) activities.insert(prof::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    for (int i = 0; i < 3; ++i) fulcrum_step(trainer);
    Synchronize();
    torch::autograd::profiler::disableProfiler()->save(FLAGS_profile_trace + "." + shape.name +
                                                       ".json");
  };
  std::string fulcrum_missing;
  int64_t fulcrum_params = 0;

  // NOTE [sides on a GPU]
  // On the CPU the sides run interleaved, round by round, so that drift in the shared
  // machine's load hits them alike. On a GPU the timed work is the device's, steady from one
  // run to the next, and the sides cannot share its memory: each holds a 1.3B model's fp32
  // masters, gradients and Adam state (~21 GB) plus its activations, and an H200 (140 GB)
  // ran out with the four alive at once (65 + 40 + 34 GiB and the plain side's). There they
  // run one after another, each alone on the GPU, its memory returned before the next.
  if (g_device.is_cuda()) {
    auto release = [] {
      Synchronize();
      at::accelerator::emptyCache();
    };
    {
      absl::StatusOr<std::unique_ptr<Trainer>> trainer = make_trainer();
      if (trainer.ok()) {
        for (int i = 0; i < FLAGS_warmup_iters; ++i) fulcrum_step(**trainer);
        for (int r = 0; r < FLAGS_rounds; ++r) ours.push_back(ms_per_step([&] { fulcrum_step(**trainer); }));
        fulcrum_params = (*trainer)->model().NumParameterElements();
        profile(**trainer);
      } else {
        fulcrum_missing = std::string(trainer.status().message());
      }
    }
    release();
    {
      PlainSide plain(shape, vocab);
      for (int i = 0; i < FLAGS_warmup_iters; ++i) plain_step(plain);
      for (int r = 0; r < FLAGS_rounds; ++r) theirs.push_back(ms_per_step([&] { plain_step(plain); }));
    }
    release();
    for (bool compiled_side : {false, true}) {
      std::unique_ptr<Reference> reference = start_reference(compiled_side);
      for (int r = 0; r < FLAGS_rounds && reference != nullptr; ++r) {
        time_reference(reference.get(), compiled_side ? &compiled : &eager);
      }
    }  // ~Reference closes its pipe and waits: the GPU is the next one's alone
  } else {
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = make_trainer();
    if (!trainer.ok()) fulcrum_missing = std::string(trainer.status().message());
    PlainSide plain(shape, vocab);
    for (int i = 0; i < FLAGS_warmup_iters; ++i) {
      plain_step(plain);
      if (trainer.ok()) fulcrum_step(**trainer);
    }
    Synchronize();
    std::unique_ptr<Reference> eager_reference = start_reference(false);
    std::unique_ptr<Reference> compiled_reference = start_reference(true);
    for (int r = 0; r < FLAGS_rounds; ++r) {
      // Rotate which goes first so drift in machine load hits all alike.
      std::vector<std::function<void()>> order = {
          [&] { if (trainer.ok()) ours.push_back(ms_per_step([&] { fulcrum_step(**trainer); })); },
          [&] { theirs.push_back(ms_per_step([&] { plain_step(plain); })); },
          [&] { time_reference(eager_reference.get(), &eager); },
          [&] { time_reference(compiled_reference.get(), &compiled); }};
      std::rotate(order.begin(), order.begin() + r % order.size(), order.end());
      for (auto& run : order) run();
    }
    if (trainer.ok()) {
      fulcrum_params = (*trainer)->model().NumParameterElements();
      profile(**trainer);
    }
  }
  // Fulcrum's time over each other side's, round by round (the same round index: side by
  // side on the CPU, in sequence on a GPU).
  std::vector<double> ratios, eager_ratios, compiled_ratios;
  for (size_t r = 0; r < ours.size(); ++r) {
    if (r < theirs.size()) ratios.push_back(theirs[r] / ours[r]);
    if (eager.size() == ours.size()) eager_ratios.push_back(ours[r] / eager[r]);
    if (compiled.size() == ours.size()) compiled_ratios.push_back(ours[r] / compiled[r]);
  }
  PrintThroughputTable(shape, tokens, ours, theirs, eager, compiled, fulcrum_missing);
  if (ours.empty()) return;
  std::printf("%-8s %10lld params | fulcrum %9.0f tok/s | plain libtorch %9.0f tok/s | "
              "ratio %.3f (median of %d rounds; overhead %+.1f%%)\n",
              shape.name.c_str(), static_cast<long long>(fulcrum_params),
              tokens / Median(ours) * 1e3, tokens / Median(theirs) * 1e3, Median(ratios),
              FLAGS_rounds, (1.0 - Median(ratios)) * 100.0);
  if (!eager_ratios.empty()) {
    std::printf("%-8s ms/step: fulcrum %.1f | plain libtorch %.1f | pytorch eager %.1f | "
                "fulcrum/eager time %.3f (median of %zu rounds, %d threads; goal <= 0.9)\n",
                shape.name.c_str(), Median(ours), Median(theirs), Median(eager),
                Median(eager_ratios), eager_ratios.size(), at::get_num_threads());
  }
  if (!compiled_ratios.empty()) {
    std::printf("%-8s ms/step: fulcrum %.1f | torch.compile %.1f | fulcrum/compiled time %.3f "
                "(median of %zu rounds, %d threads; goal <= 1.0)\n",
                shape.name.c_str(), Median(ours), Median(compiled), Median(compiled_ratios),
                compiled_ratios.size(), at::get_num_threads());
  }
  std::fflush(stdout);
}

// The loss alone: Fulcrum's cross-entropy against LibTorch's, forward+backward on logits of
// the model's shape, each scaled by one per-token weight as the trainer does.
void MeasureCrossEntropy(const Shape& shape) {
  const int64_t tokens = shape.micro_batch * shape.seq;
  const at::Tensor base = torch::randn({tokens, shape.vocab});
  const at::Tensor targets = torch::randint(shape.vocab, {tokens}, at::kLong);
  const at::Tensor weight = torch::full({tokens}, 1.0 / static_cast<double>(tokens));
  auto run = [&](bool ours) {
    at::Tensor logits = base.clone().set_requires_grad(true);
    const auto start = Clock::now();
    at::Tensor loss = ours ? VocabParallelCrossEntropy(logits, targets, 0, nullptr)
                           : at::cross_entropy_loss(logits, targets, {}, at::Reduction::None);
    (loss * weight).sum().backward();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  for (int i = 0; i < 3; ++i) {
    run(true);
    run(false);
  }
  const bench::PairedRounds rounds =
      bench::AlternateRounds(21, [&] { return run(true); }, [&] { return run(false); });
  std::printf("%-8s cross-entropy [%lld, %lld] fwd+bwd: fulcrum %.2f ms | libtorch %.2f ms | "
              "ratio %.3f (median of 21, interleaved)\n",
              shape.name.c_str(), static_cast<long long>(tokens),
              static_cast<long long>(shape.vocab), Median(rounds.a), Median(rounds.b),
              Median(rounds.ratio));
  std::fflush(stdout);
}

// One fulcrum_train run's figures from its metrics file: the medians of the iteration time
// and tokens/s after the first five iterations (start-up, first-touch allocation), the last
// record's optimizer bytes (the logging rank's), the largest activation peak (pipeline runs
// only; 0 otherwise) and, for a run that saved, its last checkpoint's files and save time.
// ok false when it failed.
struct TrainFigures {
  bool ok = false;
  double ms = 0;
  double tokens_per_second = 0;
  double state_bytes = 0;
  double activation_peak_mb = 0;
  double reduce_ms = 0;          // the step's gradient reduction (median, as ms)
  double save_largest_file = 0;  // bytes: the most one rank wrote
  double save_total_bytes = 0;
  double save_seconds = 0;       // the committing rank's "written in" of the last save
  std::vector<double> elapsed;   // elapsed_s of every iteration
};

// Runs the tiny recipe with `flags` on `n` ranks (--layout_iters iterations); with a
// `save_interval`, saving every so many iterations into a scratch directory, removed after.
TrainFigures RunTrain(const std::string& bin_dir, int n, const std::string& flags,
                      int save_interval = 0) {
  const bool save = save_interval > 0;
  TrainFigures out;
  std::string work = std::filesystem::temp_directory_path().string() + "/fulcrum_bench_run_XXXXXX";
  if (mkdtemp(work.data()) == nullptr) return out;
  const std::string metrics = work + "/metrics.jsonl";
  const std::string train = bin_dir + "/fulcrum_train --recipe=tiny --eval_interval=0 "
                            "--log_interval=1000 --train_iters=" +
                            std::to_string(FLAGS_layout_iters) + " " + flags +
                            (save ? " --save=" + work + "/ck --save_interval=" +
                                        std::to_string(save_interval)
                                  : "") +
                            " --metrics_file=" + metrics;
  const std::string command =
      (n == 1 ? train
              : bin_dir + "/fulcrum_launch --nproc_per_node=" + std::to_string(n) +
                    " --master_port=0 -- " + train) + " > " + work + "/log 2>&1";
  if (std::system(command.c_str()) == 0) {
    std::ifstream in(metrics);
    std::string line;
    std::vector<double> ms, rates, reduce, elapsed;
    while (std::getline(in, line)) {
      const nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (r.is_discarded()) continue;
      if (r.contains("iteration_ms")) ms.push_back(r["iteration_ms"].get<double>());
      if (r.contains("tokens_per_second")) rates.push_back(r["tokens_per_second"].get<double>());
      if (r.contains("grad_reduce_ms")) reduce.push_back(r["grad_reduce_ms"].get<double>());
      if (r.contains("elapsed_s")) elapsed.push_back(r["elapsed_s"].get<double>());
      if (r.contains("optimizer_state_bytes")) out.state_bytes = r["optimizer_state_bytes"].get<double>();
      if (r.contains("activation_peak_mb")) {
        out.activation_peak_mb = std::max(out.activation_peak_mb, r["activation_peak_mb"].get<double>());
      }
    }
    if (ms.size() > 5 && rates.size() > 5) {
      out.ms = Median(std::vector<double>(ms.begin() + 5, ms.end()));
      out.tokens_per_second = Median(std::vector<double>(rates.begin() + 5, rates.end()));
      if (reduce.size() > 5) out.reduce_ms = Median(std::vector<double>(reduce.begin() + 5, reduce.end()));
      out.elapsed = elapsed;
      out.ok = true;
    }
  }
  if (out.ok && save) {
    auto reader = ckpt::CheckpointReader::Open(work + "/ck");
    std::ifstream log(work + "/log");
    std::string line;
    while (std::getline(log, line)) {
      const size_t at = line.find(" written in ");
      if (line.find("checkpoint of iteration") != std::string::npos && at != std::string::npos) {
        out.save_seconds = std::atof(line.c_str() + at + 12);
      }
    }
    out.ok = reader.ok();
    if (out.ok) {
      for (const auto& [file, info] : reader->manifest()["files"].items()) {
        const double bytes = info["bytes"].get<double>();
        out.save_largest_file = std::max(out.save_largest_file, bytes);
        out.save_total_bytes += bytes;
      }
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(work, ignored);
  return out;
}

// The median tokens/s of the tiny recipe under `layout` ("1", "tp2", "dp2", "tp2dp2"), or a
// negative value on failure.
double LayoutTokensPerSecond(const std::string& bin_dir, const std::string& layout) {
  int tp = 1, dp = 1;
  if (layout != "1" && std::sscanf(layout.c_str(), "tp%ddp%d", &tp, &dp) != 2 &&
      std::sscanf(layout.c_str(), "tp%d", &tp) != 1 && std::sscanf(layout.c_str(), "dp%d", &dp) != 1) {
    std::fprintf(stderr, "bench_train: cannot parse layout '%s'\n", layout.c_str());
    return -1;
  }
  const TrainFigures f =
      RunTrain(bin_dir, tp * dp, "--tensor_model_parallel_size=" + std::to_string(tp));
  return f.ok ? f.tokens_per_second : -1;
}

// Sharded against full checkpoints of one run (tp=2 x dp=2, the distributed optimizer,
// saving every 10 iterations), alternating --memory_rounds times: the most bytes one rank
// writes, all bytes, and the save's time.
void CompareCheckpointFormats(const std::string& bin_dir) {
  const std::string base = "--tensor_model_parallel_size=2 --use_distributed_optimizer";
  std::vector<double> largest[2], total[2], seconds[2];
  for (int round = 0; round < FLAGS_memory_rounds; ++round) {
    for (int sharded = 0; sharded < 2; ++sharded) {
      const TrainFigures f = RunTrain(
          bin_dir, 4, base + (sharded ? " --ckpt_format=sharded" : " --ckpt_format=full"), 10);
      if (!f.ok) {
        std::printf("  %-34s failed\n", "tp=2 x dp=2 ZeRO --ckpt_format");
        return;
      }
      largest[sharded].push_back(f.save_largest_file);
      total[sharded].push_back(f.save_total_bytes);
      seconds[sharded].push_back(f.save_seconds);
    }
  }
  std::printf("  %-34s bytes the busiest rank writes %.0f -> %.0f (ratio %.3f) | all files %.0f "
              "-> %.0f | save s %.3f -> %.3f\n",
              "tp=2 x dp=2 ZeRO full -> sharded", Median(largest[0]), Median(largest[1]),
              Median(largest[1]) / Median(largest[0]), Median(total[0]), Median(total[1]),
              Median(seconds[0]), Median(seconds[1]));
  std::fflush(stdout);
}

// The loop's time of each `interval` iterations from the end of iteration 6 on: with saves
// every `interval` iterations, each period holds one save (the one after its first
// iteration's predecessor) and the iterations it overlaps.
std::vector<double> SavePeriods(const std::vector<double>& elapsed, int interval) {
  std::vector<double> periods;
  for (size_t end = 5 + interval; end < elapsed.size(); end += interval) {
    periods.push_back(elapsed[end] - elapsed[end - interval]);
  }
  return periods;
}

// What saving costs the training loop, with and without --async_save (NOTE [background
// saves]): one process of a ~11M-parameter GPT (hidden 384, 6 layers: a 125 MB checkpoint
// with the moments; global batch 8) saves every 2 iterations. A save's cost is the median
// loop time of a 2-iteration period holding one save (SavePeriods, elapsed_s) less the
// median period of the same runs without saving; the three runs rotate --memory_rounds
// times. Once with compute threads on every core, once with one core left to the writer,
// as on a GPU node whose host cores mostly wait.
void CompareAsyncSave(const std::string& bin_dir) {
  const std::string model = "--hidden_size=384 --num_layers=6 --num_attention_heads=6 "
                            "--global_batch_size=8 --micro_batch_size=8";
  const int interval = 2;
  const int cores = UsableCores();
  for (const int threads : {cores, cores - 1}) {
    if (threads < 1) continue;
    const std::string flags = model + " --num_threads=" + std::to_string(threads);
    std::vector<double> periods[3];  // no saves, synchronous, background
    for (int round = 0; round < FLAGS_memory_rounds; ++round) {
      for (int side = 0; side < 3; ++side) {
        const TrainFigures f = RunTrain(bin_dir, 1, flags + (side == 2 ? " --async_save" : ""),
                                        side == 0 ? 0 : interval);
        const std::vector<double> run = SavePeriods(f.elapsed, interval);
        if (!f.ok || run.empty()) {
          std::printf("  %-34s failed (or --layout_iters too small for a save)\n", "--async_save");
          return;
        }
        periods[side].insert(periods[side].end(), run.begin(), run.end());
      }
    }
    const double none = Median(periods[0]);
    const double sync_ms = (Median(periods[1]) - none) * 1e3;
    const double async_ms = (Median(periods[2]) - none) * 1e3;
    const std::string label =
        absl::StrCat("11M params, ", threads, " of ", cores, " cores --async_save");
    std::printf("  %-34s what a save costs the loop: %.0f -> %.0f ms (ratio %.2f; %zu periods "
                "of %d iterations each, %.0f ms without a save)\n",
                label.c_str(), sync_ms, async_ms, async_ms / sync_ms, periods[1].size(), interval,
                none * 1e3);
    std::fflush(stdout);
  }
}

// A feature against the run without it, the two alternating --memory_rounds times: the
// medians of each side's figures, and their ratios (with / without).
// What a CompareFeature row reports beside the iteration time.
enum class Figure { kStateBytes, kActivationPeak, kReduceWait };

void CompareFeature(const std::string& bin_dir, const char* label, int n, const std::string& base,
                    const std::string& feature, Figure figure) {
  std::vector<double> ms[2], value[2];
  for (int round = 0; round < FLAGS_memory_rounds; ++round) {
    for (int with = 0; with < 2; ++with) {
      const TrainFigures f = RunTrain(bin_dir, n, base + (with ? " " + feature : ""));
      if (!f.ok) {
        std::printf("  %-34s failed (%s)\n", label, with ? feature.c_str() : "without it");
        return;
      }
      ms[with].push_back(f.ms);
      value[with].push_back(figure == Figure::kStateBytes       ? f.state_bytes
                            : figure == Figure::kActivationPeak ? f.activation_peak_mb
                                                                : f.reduce_ms);
    }
  }
  const double without = Median(value[0]), with = Median(value[1]);
  switch (figure) {
    case Figure::kStateBytes:
      std::printf("  %-34s optimizer bytes/rank %.0f -> %.0f (ratio %.3f, goal 0.50 +- 5%%)",
                  label, without, with, with / without);
      break;
    case Figure::kActivationPeak:
      std::printf("  %-34s activation peak %.2f -> %.2f MB (ratio %.3f)", label, without, with,
                  with / without);
      break;
    case Figure::kReduceWait:
      std::printf("  %-34s the step's gradient reduction %.2f -> %.2f ms (ratio %.3f)", label,
                  without, with, with / without);
      break;
  }
  std::printf(" | ms/iter %.1f -> %.1f (ratio %.2f)\n", Median(ms[0]), Median(ms[1]),
              Median(ms[1]) / Median(ms[0]));
  std::fflush(stdout);
}

void MeasureMemoryFeatures(const std::string& bin_dir) {
  std::printf("\nmemory features, tiny recipe, %d iterations per run, %d alternating rounds "
              "(Gloo on this machine; pp=2 x tp=2 runs 4 ranks):\n",
              FLAGS_layout_iters, FLAGS_memory_rounds);
  CompareFeature(bin_dir, "dp=2 --use_distributed_optimizer", 2, "",
                 "--use_distributed_optimizer", Figure::kStateBytes);
  CompareFeature(bin_dir, "pp=2 --recompute_granularity=full", 2,
                 "--pipeline_model_parallel_size=2", "--recompute_granularity=full",
                 Figure::kActivationPeak);
  CompareFeature(bin_dir, "pp=2 x tp=2 --sequence_parallel", 4,
                 "--pipeline_model_parallel_size=2 --tensor_model_parallel_size=2",
                 "--sequence_parallel", Figure::kActivationPeak);
  // The step's reduction (the time it waits) and the iteration (NOTE [overlapped gradient
  // reduction]). Both sides cut the same buckets of 200,000 elements (the tiny model fits
  // one default 25 MiB bucket: nothing could start early); the replicated optimizer's
  // blocking reducer keeps its own 25 MB buckets.
  CompareFeature(bin_dir, "dp=2 --overlap_grad_reduce", 2, "--ddp_bucket_size=200000",
                 "--overlap_grad_reduce", Figure::kReduceWait);
  CompareFeature(bin_dir, "dp=2 ZeRO --overlap_grad_reduce", 2,
                 "--use_distributed_optimizer --ddp_bucket_size=200000", "--overlap_grad_reduce",
                 Figure::kReduceWait);
  CompareCheckpointFormats(bin_dir);
  CompareAsyncSave(bin_dir);
}

void MeasureLayouts(const std::string& bin_dir) {
  std::printf("\nparallel layouts, tiny recipe, %d iterations each (Gloo on this machine):\n",
              FLAGS_layout_iters);
  double single = -1;
  for (absl::string_view layout : absl::StrSplit(FLAGS_layouts, ',', absl::SkipEmpty())) {
    const double rate = LayoutTokensPerSecond(bin_dir, std::string(layout));
    if (rate < 0) {
      std::printf("  %-8s failed\n", std::string(layout).c_str());
      continue;
    }
    if (layout == "1") single = rate;
    std::printf("  %-8s %9.0f tok/s", std::string(layout).c_str(), rate);
    if (single > 0) std::printf("   (%.2f x one process)", rate / single);
    std::printf("\n");
    std::fflush(stdout);
  }
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_bench_train";
  help.usage =
      "fulcrum_bench_train: framework overhead of fulcrum_train's training step: Fulcrum's\n"
      "Trainer against the same model as a plain LibTorch loop, interleaved round by round;\n"
      "with --compare_reference also PyTorch eager and torch.compile; with --layouts the tiny\n"
      "recipe under parallel layouts (fulcrum_launch, built next to it); with --memory_features\n"
      "the distributed optimizer, recomputation, sequence parallelism and overlapped gradient\n"
      "reduction against runs without (--save_cost: only what a save costs, with --async_save and\n"
      "without).\n\n"
      "  fulcrum_bench_train [--rounds=5] [--iters_per_round=5] [--models=tiny,gpt_20m]\n"
      "      [--layouts=1,tp2,dp2,tp2dp2] [--memory_features] [--compare_reference] [--threads=0]\n"
      "      [--device=cpu|cuda|cuda:N|auto] [--bf16] [--quick]\n\n"
      "Exit status: 0 done, 2 bad flags (an unknown model or device included), 1 a failure.\n";
  help.groups = {
      {"Measurements", {"models", "rounds", "iters_per_round", "warmup_iters", "quick",
                        "cross_entropy", "threads", "keep_heap", "profile_trace"}},
      {"Device", {"device", "bf16"}},
      {"Parallel layouts", {"layouts", "layout_iters", "memory_features", "memory_rounds",
                            "save_cost"}},
      {"PyTorch reference", {"compare_reference", "reference_python", "reference_script",
                             "reference_wait_policy"}},
  };
  if (std::optional<int> code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *code;
  }
  fulcrum::InitLogging(argv[0]);
  if (auto device = fulcrum::ResolveDevice(FLAGS_device, /*local_rank=*/0); !device.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", std::string(device.status().message()).c_str());
    return 2;
  } else {
    fulcrum::g_device = *device;
  }
  auto is_default = [](const char* flag) { return gflags::GetCommandLineFlagInfoOrDie(flag).is_default; };
  if (FLAGS_quick) {
    if (is_default("rounds")) FLAGS_rounds = 2;
    if (is_default("iters_per_round")) FLAGS_iters_per_round = 2;
    if (is_default("warmup_iters")) FLAGS_warmup_iters = 1;
  }
  if (fulcrum::g_device.is_cuda()) {
    if (is_default("models")) FLAGS_models = "gpt_1p3b";
    // The layouts run fulcrum_train over Gloo on this machine's cores.
    if (is_default("layouts")) FLAGS_layouts = "";
  }
  if (FLAGS_reference_wait_policy != "same" && FLAGS_reference_wait_policy != "default") {
    std::fprintf(stderr, "bench_train: --reference_wait_policy must be 'same' or 'default', got '%s'\n",
                 FLAGS_reference_wait_policy.c_str());
    return 2;
  }
  const fulcrum::ThreadChoice threads = FLAGS_threads > 0
                                            ? fulcrum::ThreadChoice{FLAGS_threads, "--threads"}
                                            : fulcrum::DefaultComputeThreads();
  fulcrum::SetComputeThreads(threads.threads);
  fulcrum::data::ByteTokenizer tokenizer;
  auto corpus = fulcrum::data::BuildDefaultCorpus(tokenizer);
  if (!corpus.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", std::string(corpus.status().message()).c_str());
    return 1;
  }
  if (FLAGS_keep_heap) fulcrum::KeepStepMemoryInHeap();
  std::printf("threads: %s; the reference's OMP_WAIT_POLICY: %s\n",
              fulcrum::DescribeComputeThreads(threads).c_str(),
              FLAGS_reference_wait_policy == "same" ? "the same" : "unset");
  const std::string bin_dir = fulcrum::bench::BinDir(argv[0]);
  fulcrum::g_reference_script = FLAGS_reference_script.empty()
                                    ? bin_dir + "/../../tools/bench_train_reference.py"
                                    : FLAGS_reference_script;
  for (absl::string_view name : absl::StrSplit(FLAGS_models, ',', absl::SkipEmpty())) {
    bool found = false;
    for (const auto& shape : fulcrum::kShapes) {
      if (shape.name == name) {
        fulcrum::Measure(shape, *corpus);
        if (FLAGS_cross_entropy) fulcrum::MeasureCrossEntropy(shape);
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "bench_train: unknown model '%s' (tiny, gpt_20m, gpt_8k, gpt_1p3b)\n", std::string(name).c_str());
      return 2;
    }
  }
  if (!FLAGS_layouts.empty()) fulcrum::MeasureLayouts(bin_dir);
  if (FLAGS_memory_features) fulcrum::MeasureMemoryFeatures(bin_dir);
  if (FLAGS_save_cost && !FLAGS_memory_features) fulcrum::CompareAsyncSave(bin_dir);
  return 0;
}
