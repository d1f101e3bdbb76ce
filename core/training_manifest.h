// The trainer's fields of a checkpoint manifest (beside the tensor table the checkpoint
// writer owns, core/checkpoint/checkpoint.h): where training stands (iteration, data
// position, learning rate), what it trained on, the configuration and the layout it ran
// under. Written by Trainer::Save; read back — every field checked for type, range and
// consistency, and against the run that resumes — by Trainer::Load.
//
// NOTE [resume checks]
// A resume continues the saved run exactly only if the model shape, the MLP replacement
// (MoE), the data (its path, documents and tokens, the split and the shuffle seed) and the
// data position agree. Shape mismatches are refused naming the flag. Data mismatches are
// refused too, unless TrainOptions::allow_data_change says the change is on purpose (then a
// warning). --train_iters below the checkpoint's iteration is refused. A manifest field of
// the wrong type or out of range is DataLoss naming the field — never an exception. (Edits
// to a manifest are caught before this, by its own checksum: ckpt::CheckpointReader.)
//
// Parsing needs no LibTorch (the fuzz target in tests/fuzz calls it); CheckResume, which
// compares with the trainer's configuration, is in core/resume_check.cc.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace fulcrum {

struct TrainerConfig;  // core/trainer.h

/// What the data of a run is: enough to tell another corpus from the same one.
struct DataIdentity {
  std::string path;       // --data_path, or "" for the embedded corpus.
  int64_t documents = 0;  // Sequences in the corpus.
  int64_t tokens = 0;     // Tokens in the corpus.
};

/// The trainer's manifest fields, typed.
struct TrainingManifest {
  int64_t iteration = 0;
  int64_t consumed_samples = 0;
  double lr = 0;                    // Learning rate of the last step taken (0 before any).
  uint64_t data_seed = 0;           // Shuffle seed of the samples (--seed).
  std::string split;                // --split.
  int64_t seq_length = 0;
  int64_t samples_per_epoch = 0;    // Of the training split.
  DataIdentity data;
  nlohmann::json config;            // ConfigToJson of the saving run.
  int tp = 1, pp = 1, dp = 1, ep = 1;  // The layout it ran under (informational).
  /// Each stage's [begin, end) when it was saved (layers may have moved).
  std::vector<std::pair<int64_t, int64_t>> layer_placement;
};

/// The manifest fields of `m` (what Trainer::Save commits).
nlohmann::json TrainingManifestToJson(const TrainingManifest& m);

/// Reads the fields back, checking each one's type and range and their consistency
/// (iteration, optimizer step and schedule step agree; the data position is recorded
/// twice alike; the placement covers the layers in order). DataLoss naming the field and
/// `source` (the manifest's path) otherwise. A checkpoint without the sampler's data
/// identity (older format) reads with empty `data`.
absl::StatusOr<TrainingManifest> ParseTrainingManifest(const nlohmann::json& manifest,
                                                       const std::string& source);

/// Checks that a run configured by `ours`, training on `our_data`, may resume `saved`
/// (NOTE [resume checks]); warnings (allowed data changes, a moved dataset) are appended
/// to `warnings`. InvalidArgument naming the flag otherwise.
absl::Status CheckResume(const TrainingManifest& saved, const TrainerConfig& ours,
                         const DataIdentity& our_data, const std::string& source,
                         std::vector<std::string>* warnings);

/// NOTE [finetune] --finetune loads a checkpoint's model weights into a new run: iteration
/// 0, fresh optimizer and schedule, no data identity or position checks, any data. The
/// model must still be the checkpoint's: the shape fields of NOTE [resume checks] (among
/// them normalization, swiglu, num_query_groups, add_bias_linear), the MoE shape and
/// openai_gelu are refused on a mismatch naming the flag. seq_length is no shape: learned
/// positions compare the table's rows (max_position_embeddings; a checkpoint from before the
/// field had seq_length rows), and a run may fine-tune at any seq_length up to them —
/// GPT-2's 1024-row table at 512 tokens with --max_position_embeddings=1024
/// --seq_length=512, the rows past the sequence untouched by the gradient (AdamW's decay
/// still shrinks them, as Megatron's and transformers' training do); with rope a longer run
/// than the checkpoint's is a warning. The checkpoint
/// may be an import (hf_checkpoint.h, NOTE [imported checkpoints]), whose manifest holds
/// the config but none of the trainer's fields, or any trained checkpoint.
///
/// `saved_config` is the manifest's "config" object. InvalidArgument naming the flag, or
/// DataLoss when the manifest has no config.model.
absl::Status CheckFinetune(const nlohmann::json& saved_config, const TrainerConfig& ours,
                           const std::string& source, std::vector<std::string>* warnings);

/// InvalidArgument when the data's largest token id `data_max_token` does not fit the
/// checkpoint's vocabulary (`saved_config`'s model.vocab_size): data tokenized for another
/// model. OK when the checkpoint does not record a vocabulary size.
absl::Status CheckDataFitsVocabulary(const nlohmann::json& saved_config, int64_t data_max_token,
                                     const std::string& source);

}  // namespace fulcrum
