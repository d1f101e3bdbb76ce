// Helpers shared by the core tests: small models, synthetic corpora, temp dirs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/data/indexed_dataset.h"
#include "core/trainer.h"
#include "tests/run_command.h"  // RunCommand

namespace fulcrum::testing {

/// A 2-layer, 32-wide GPT over a vocabulary of 64.
ModelOptions SmallModel();

/// A trainer config for SmallModel with micro-batch 2, global batch 4, 8 iterations.
TrainerConfig SmallTrainerConfig();

/// An in-memory corpus of `num_documents` documents that follow one bigram rule from
/// seeded starting tokens; the last id, vocab - 1, ends each document.
std::shared_ptr<data::IndexedDataset> SyntheticCorpus(int64_t num_documents, int64_t tokens_per_doc,
                                                      int64_t vocab, uint64_t seed = 7);

/// A fresh empty directory under the test temp dir.
std::string MakeTempDir(const std::string& tag);

/// Max |a - b| over all elements (as double).
double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b);

}  // namespace fulcrum::testing
