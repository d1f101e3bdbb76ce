// fulcrum_train's command line: gflags definitions (Megatron-LM names with underscores)
// and their conversion into options structs. The only place these flags are read.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/data/indexed_dataset.h"
#include "core/trainer.h"

namespace fulcrum {

/// Applies --recipe: sets the recipe's flags as defaults, keeping every flag the user set
/// explicitly (command line or --flagfile). Unknown recipe → InvalidArgument listing them.
absl::Status ApplyRecipe();

/// The usage text shown by --help: what the program does and the registered recipes.
std::string TrainUsage();

/// The training corpus and its vocabulary size: --data_path (with --tokenizer_model or
/// --vocab_size, else the largest token id + 1), or the embedded default corpus.
struct TrainData {
  std::shared_ptr<const data::IndexedDataset> corpus;
  int64_t vocab_size = 0;      // Before padding.
  std::string description;
};
absl::StatusOr<TrainData> LoadTrainData();

/// Flags → TrainerConfig (vocabulary padded to --make_vocab_size_divisible_by), validated.
absl::StatusOr<TrainerConfig> ConfigFromFlags(int64_t vocab_size);

/// --load, or empty.
std::string LoadPathFlag();

}  // namespace fulcrum
