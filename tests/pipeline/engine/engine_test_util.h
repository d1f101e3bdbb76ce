// Helpers of the pipeline-engine tests: a small model, deterministic micro-batches, and the
// launcher pattern of the multi-process tests (a Slow* driver starts this binary under
// fulcrum_launch, filtered to one *Worker test).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/config.h"
#include "core/parallel_context.h"
#include "parallel/communicator.h"

namespace fulcrum::pipeline::testing {

/// The micro-batch size and loss scale of the engine tests' runs.
inline constexpr int64_t kMicroBatchSize = 2;
inline constexpr double kLossScale = 1e-3;

/// A 4-layer, 64-wide GPT over a vocabulary of 96, 16 tokens per sample, untied head.
inline ModelOptions EngineModel() {
  ModelOptions m;
  m.num_layers = 4;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.ffn_hidden_size = 128;
  m.vocab_size = 96;
  m.seq_length = 16;
  m.tie_embeddings = false;
  m.seed = 11;
  return m;
}

/// Parameter scalars of one layer of EngineModel-like options: two layer norms, QKV and
/// output projections, the two MLP matrices, and their biases.
inline int64_t LayerParameters(const ModelOptions& m) {
  const int64_t h = m.hidden_size, f = m.ffn_hidden_size;
  return 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (f * h + f) + (h * f + h);
}

/// `count` micro-batches of `micro_batch_size` random samples; micro-batch m is the same
/// wherever it is asked for, and `first` offsets the samples (another data-parallel rank).
inline MicroBatchPlan RandomPlan(const ModelOptions& m, int count, int64_t micro_batch_size,
                                 int64_t first = 0) {
  MicroBatchPlan plan;
  plan.count = count;
  plan.first_sample = [=](int mb) { return first + mb * micro_batch_size; };
  plan.tokens = [=](int mb) {
    at::Generator gen = at::detail::createCPUGenerator(1000 + first + mb);
    return at::randint(m.vocab_size, {micro_batch_size, m.seq_length + 1}, gen, at::kLong);
  };
  return plan;
}

/// A Gloo world of this process alone (rank 0 of 1).
std::unique_ptr<parallel::Communicator> OneProcessWorld();

/// The Gloo world of a launched worker, from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
/// (nullptr, with a failure recorded, if the environment or the rendezvous is bad).
std::unique_ptr<parallel::Communicator> WorldFromEnvironment();

/// This test binary, for the drivers that launch it.
std::string SelfPath();

/// Runs this binary under fulcrum_launch with `nproc` ranks, filtered to `worker_filter`,
/// with FULCRUM_ENGINE_WORKER=1 set; returns the exit code and the output. Fails the calling
/// test unless every rank ran and passed every case the filter selects (at least one).
int LaunchWorkers(int nproc, const std::string& worker_filter, std::string* output);

/// Whether this process is a launched worker (else Worker tests skip).
inline bool IsWorker() {
  return std::getenv("FULCRUM_ENGINE_WORKER") != nullptr && std::getenv("RANK") != nullptr;
}

}  // namespace fulcrum::pipeline::testing
