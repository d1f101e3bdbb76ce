// Helpers shared by the core tests: small models, synthetic corpora, temp dirs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/data/indexed_dataset.h"
#include "core/trainer.h"
#include "core/transformer_layer.h"
#include "tests/run_command.h"  // RunCommand
#include "tests/temp_dir.h"     // MakeTempDir

namespace fulcrum::testing {

/// The small GPT of the model-level tests: 32 wide, 4 heads, an MLP of 64, a vocabulary
/// of 64, with `num_layers` layers and `seq_length` tokens per sample; every other option
/// keeps its default (the seed included).
ModelOptions SmallModelOf(int64_t num_layers, int64_t seq_length);

/// SmallModelOf(2, 16) with seed 42.
ModelOptions SmallModel();

/// A trainer config for SmallModel with micro-batch 2, global batch 4, 8 iterations.
TrainerConfig SmallTrainerConfig();

/// An in-memory corpus of `num_documents` documents that follow one bigram rule from
/// seeded starting tokens; the last id, vocab - 1, ends each document.
std::shared_ptr<data::IndexedDataset> SyntheticCorpus(int64_t num_documents, int64_t tokens_per_doc,
                                                      int64_t vocab, uint64_t seed = 7);

/// Max |a - b| over all elements (as double).
double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b);

/// Max |a[i] - b[i]| of two loss curves (over the first min(a.size(), b.size()) entries).
double MaxAbsDiff(const std::vector<double>& a, const std::vector<double>& b);

/// Holds `layer` to `reference` (the same function written out in the test) at
/// `tolerance`: both run in training on one fp64 input of `shape` drawn from N(0, 1) by the
/// global generator (seed it first), then back-propagate Σ output·probe, the probe drawn
/// next; the outputs and the input gradients are compared.
void ExpectLayerMatchesReference(const TransformerLayer& layer,
                                 const std::function<at::Tensor(const at::Tensor&)>& reference,
                                 at::IntArrayRef shape, double tolerance);

/// Bytes allocated minus bytes freed on this thread while installed (through
/// c10::DebugInfoGuard with DebugInfoKind::PROFILER_STATE): the c10 memory reporter the
/// pipeline executor's activation meter is (pipeline/internal/activation_meter.h).
class LiveBytes final : public c10::MemoryReportingInfoBase {
 public:
  void reportMemoryUsage(void* /*ptr*/, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    live_ += alloc_size;
  }
  bool memoryProfilingEnabled() const override { return true; }
  int64_t live() const { return live_; }

 private:
  int64_t live_ = 0;
};

}  // namespace fulcrum::testing
