// Hugging Face checkpoints in and out: a transformers model directory (config.json plus
// model.safetensors, or model-XXXXX-of-YYYYY.safetensors shards with
// model.safetensors.index.json) converted to a Fulcrum checkpoint of iteration 0, and a
// Fulcrum checkpoint's model converted back to a directory that transformers'
// from_pretrained loads with no missing or unexpected keys. Which architectures, and what
// is refused: NOTE [HF architectures] in hf_config.h.
//
// NOTE [imported checkpoints] An import is a normal checkpoint directory (checkpoint.h:
// `latest`, iter_0000000) holding only model tensors under their global names, with the
// manifest fields
//   "iteration": 0,
//   "imported_from": {"format": "huggingface", "architecture": "LlamaForCausalLM",
//                     "source": HF_DIR, "config": <config.json as read>},
//   "config": {"model": <ConfigToJson's "model" object>, "feed_forward": <MoE shape>},
//   "fulcrum_flags": ["--num_layers=2", ...]   the fulcrum_train flags of the model.
// It has none of the trainer's data-position fields: Trainer::Load refuses it unless
// --finetune (which loads weights only), and says so.
//
// Both directions check everything they can before writing anything (config, every
// tensor's presence, dtype and shape from the file headers alone), then write into a
// sibling temporary directory renamed to the output at the end: a refused or failed
// conversion leaves no output. Input tensors are read one at a time from memory-mapped
// files, so peak memory is one output file's tensors (export) or one layer's (import).
//
// Thread-safety: the functions are reentrant; two conversions must not share an output.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint/hf_config.h"
#include "core/file_system.h"

namespace fulcrum::ckpt {

/// The manifest field that marks an imported checkpoint (NOTE [imported checkpoints]).
inline constexpr char kImportedFromField[] = "imported_from";

struct HfImportResult {
  HfModelConfig model;
  std::string checkpoint_dir;  // <out>/iter_0000000.
  int64_t tensors = 0;
  int64_t parameters = 0;
  std::vector<std::string> flags;  // FulcrumFlags(model).
};

/// Converts the transformers model directory `hf_dir` into a Fulcrum checkpoint at `out`
/// (a save directory that must not exist or be empty). Unsupported configurations, missing
/// files or tensors, unexpected tensors and shape mismatches are InvalidArgument /
/// NotFound naming the field, file or tensor; nothing is written then.
absl::StatusOr<HfImportResult> ImportHuggingFace(FileSystem* fs, const std::string& hf_dir,
                                                 const std::string& out);

struct HfExportOptions {
  /// Default: 5 GB. Output files are at most this large (a tensor larger than it gets a
  /// file of its own); above it the model is sharded as model-XXXXX-of-YYYYY.safetensors
  /// with model.safetensors.index.json. 0: always one model.safetensors.
  uint64_t max_shard_bytes = 5'000'000'000;
  /// Default: 0 (from the checkpoint). Mixtral's num_experts_per_tok, needed for an MoE
  /// checkpoint that was trained rather than imported (its manifest has no top-k).
  int64_t num_experts_per_tok = 0;
};

struct HfExportResult {
  HfModelConfig model;
  std::vector<std::string> files;  // Written into `out`, config.json first.
  int64_t tensors = 0;
};

/// Converts the model tensors of the Fulcrum checkpoint `checkpoint` (a save directory or
/// an iter_ directory; optimizer state is skipped) into a transformers model directory at
/// `out` (must not exist or be empty). A model that no HF architecture expresses is
/// InvalidArgument naming the reason; nothing is written then.
absl::StatusOr<HfExportResult> ExportHuggingFace(FileSystem* fs, const std::string& checkpoint,
                                                 const std::string& out,
                                                 const HfExportOptions& options = {});

/// Parses a size such as "5GB", "500MB", "10KiB" or "123" (bytes) for --max_shard_size.
absl::StatusOr<uint64_t> ParseByteSize(const std::string& text);

}  // namespace fulcrum::ckpt
