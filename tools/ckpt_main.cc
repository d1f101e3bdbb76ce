// fulcrum_ckpt: inspect and verify Fulcrum checkpoints from the command line.
//
//   fulcrum_ckpt list   /ckpt            iteration, manifest fields, tensor table, totals
//   fulcrum_ckpt verify /ckpt            every checksum; exit 1 on corruption (or on a
//                                        manifest without a checksum, unless
//                                        --allow_unchecksummed_manifest)
//   fulcrum_ckpt show   /ckpt --key=iteration
//   fulcrum_ckpt import-hf HF_DIR OUT    a transformers model directory → a Fulcrum
//                                        checkpoint of iteration 0 (core/checkpoint/hf_checkpoint.h)
//   fulcrum_ckpt export-hf CKPT OUT      a Fulcrum checkpoint's model → a transformers directory
//   fulcrum_ckpt consolidate CKPT OUT    a sharded checkpoint → a full one (every tensor whole)
//   fulcrum_ckpt shard CKPT OUT --pieces=N  any checkpoint → one whose tensors are cut in N
//                                        pieces, one file each
#include <gflags/gflags.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/logging.h"
#include "core/status.h"
#include "recipes/cli.h"

DEFINE_string(key, "",
              "For `show`: the manifest field to print, a top-level name (iteration, "
              "consumed_samples, config, ...) or a JSON pointer (/config/hidden_size). "
              "Empty: every field except the tensor table.");
DEFINE_bool(allow_unchecksummed_manifest, false,
            "For `verify`: accept a manifest of format_version 1, which predates the manifest's "
            "own checksum (its fields, such as the iteration and the data position, cannot be "
            "verified). Without it `verify` fails such a checkpoint; `list` and `show` always "
            "display it.");
DEFINE_string(max_shard_size, "5GB",
              "For `export-hf`: the largest model file to write (5GB, 500MB, 2GiB or bytes); a "
              "larger model is written as model-XXXXX-of-YYYYY.safetensors shards with "
              "model.safetensors.index.json. 0: always one model.safetensors.");
DEFINE_int64(pieces, 2,
             "For `shard`: how many pieces (and files) each tensor of at least that many "
             "elements is cut into, as ranges of its elements; smaller tensors stay whole.");
DEFINE_int64(num_experts_per_tok, 0,
             "For `export-hf` of an MoE (Mixtral) checkpoint that was trained rather than "
             "imported: the router's top-k (--moe_router_topk), which its manifest does not "
             "record. 0: from the checkpoint.");

namespace fulcrum {
namespace {

constexpr char kUsageText[] =
    R"(fulcrum_ckpt: inspects and verifies Fulcrum checkpoints.

Usage:
  fulcrum_ckpt list   PATH             iteration, manifest fields and the tensor table
                                       (name, dtype, shape, file, numel) with totals
  fulcrum_ckpt verify PATH             checks the manifest's and every tensor's xxh3
                                       checksum; prints OK or what is wrong and exits 1
                                       (a format 1 manifest has no checksum: it fails
                                       unless --allow_unchecksummed_manifest)
  fulcrum_ckpt show   PATH [--key=K]   prints manifest field K as JSON (a top-level name
                                       or a JSON pointer such as /config/hidden_size);
                                       without --key, all fields but the tensor table
  fulcrum_ckpt import-hf HF_DIR OUT    converts a Hugging Face transformers directory
                                       (config.json + model.safetensors, or sharded with
                                       model.safetensors.index.json) of a GPT2LMHeadModel,
                                       LlamaForCausalLM or MixtralForCausalLM into a Fulcrum
                                       checkpoint of iteration 0 in the new directory OUT;
                                       prints the fulcrum_train flags of the model. Train
                                       from it with --load=OUT --finetune.
  fulcrum_ckpt export-hf CKPT OUT      writes the model of Fulcrum checkpoint CKPT as a
                                       transformers directory OUT (config.json +
                                       model.safetensors), for from_pretrained
                                       [--max_shard_size=5GB] [--num_experts_per_tok=K]
  fulcrum_ckpt consolidate CKPT OUT    writes checkpoint CKPT with every tensor whole (a
                                       sharded checkpoint's pieces assembled, each checked)
                                       into the new save directory OUT, one file
  fulcrum_ckpt shard CKPT OUT          writes checkpoint CKPT into the new save directory
                                       OUT with each tensor cut into --pieces=N ranges of its
                                       elements, one file per piece (NOTE [sharded
                                       checkpoints]); fulcrum_train loads either under any
                                       layout

PATH is a save directory (its `latest` file names the checkpoint) or one checkpoint
directory such as /ckpt/iter_0000020.

Exit status: 0 success, 1 missing or damaged checkpoint (or unknown --key), 2 wrong usage.
import-hf, export-hf, consolidate and shard: 0 success, 2 input refused (unsupported
configuration, missing file or tensor, shape mismatch, OUT not empty; nothing is written),
1 failure writing OUT.)";

// Tensors whose global name starts with this hold optimizer state, not parameters.
constexpr char kOptimizerPrefix[] = "optimizer.";
// Longest manifest field value `list` prints before eliding the rest.
constexpr size_t kMaxFieldChars = 100;

enum ExitCode { kOk = 0, kFailed = 1, kUsageError = 2 };

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int UsageError(const std::string& message) {
  std::cerr << "fulcrum_ckpt: " << message << "\n\n" << gflags::ProgramUsage() << "\n";
  return kUsageError;
}

int Fail(const absl::Status& status) {
  std::cerr << "fulcrum_ckpt: " << status.message() << "\n";
  return kFailed;
}

int List(const ckpt::CheckpointReader& reader) {
  std::cout << "checkpoint: " << reader.dir() << "\n"
            << "iteration:  " << reader.iteration() << "\n"
            << "fields:\n";
  for (const auto& [key, value] : reader.manifest().items()) {
    if (key == "tensors" || key == "files" || key == "iteration" || key == ckpt::kPiecesKey) {
      continue;
    }
    std::string text = value.dump();
    if (text.size() > kMaxFieldChars) text = text.substr(0, kMaxFieldChars) + "...";
    std::cout << "  " << key << ": " << text << "\n";
  }

  struct Row {
    std::string name, dtype, shape, file, numel;
  };
  std::vector<Row> rows = {{"NAME", "DTYPE", "SHAPE", "FILE", "NUMEL"}};
  int64_t parameters = 0;
  int64_t optimizer_elements = 0;
  uint64_t bytes = 0;
  // Whole tensors: a sharded one (NOTE [sharded checkpoints]) shows its piece count where a
  // whole one shows its file.
  for (const std::string& name : reader.names()) {
    const auto [dtype, shape] = *reader.Describe(name);
    int64_t numel = 1;
    for (const int64_t d : shape) numel *= d;
    const auto sharded = reader.sharded().find(name);
    size_t pieces = 0;
    if (sharded != reader.sharded().end()) {
      for (const auto& box : sharded->second.boxes) pieces += box.pieces.size();
    }
    rows.push_back({name, *ckpt::SafetensorsDtypeName(dtype), ShapeString(shape),
                    pieces > 0 ? absl::StrCat(pieces, " pieces") : reader.entries().at(name).file,
                    absl::StrCat(numel)});
    (name.rfind(kOptimizerPrefix, 0) == 0 ? optimizer_elements : parameters) += numel;
    bytes += static_cast<uint64_t>(numel) * c10::elementSize(dtype);
  }
  size_t widths[4] = {0, 0, 0, 0};
  for (const Row& row : rows) {
    widths[0] = std::max(widths[0], row.name.size());
    widths[1] = std::max(widths[1], row.dtype.size());
    widths[2] = std::max(widths[2], row.shape.size());
    widths[3] = std::max(widths[3], row.file.size());
  }
  std::cout << "tensors:\n";
  for (const Row& row : rows) {
    std::cout << absl::StrFormat("  %-*s  %-*s  %-*s  %-*s  %12s\n", widths[0], row.name, widths[1],
                                 row.dtype, widths[2], row.shape, widths[3], row.file, row.numel);
  }
  std::cout << absl::StrFormat(
      "total: %d tensors, %d parameters, %d optimizer-state elements (names under '%s'), "
      "%d bytes, %d shard files (%d tensors stored as pieces)\n",
      reader.names().size(), parameters, optimizer_elements, kOptimizerPrefix, bytes,
      reader.manifest()["files"].size(), reader.sharded().size());
  return kOk;
}

int Verify(const ckpt::CheckpointReader& reader) {
  const absl::Status status = reader.VerifyAll();
  if (!status.ok()) {
    std::cout << "FAILED: " << status.message() << "\n";
    return kFailed;
  }
  std::cout << "OK: " << reader.names().size() << " tensors ("
            << reader.entries().size() << " stored, pieces counted one by one) in "
            << reader.manifest()["files"].size() << " files match their checksums (" << reader.dir()
            << ", iteration " << reader.iteration() << ")"
            << (reader.manifest_checksummed()
                    ? ""
                    : "; the manifest itself has no checksum (format_version 1, accepted by "
                      "--allow_unchecksummed_manifest)")
            << "\n";
  return kOk;
}

int Show(const ckpt::CheckpointReader& reader, const std::string& key) {
  const nlohmann::json& manifest = reader.manifest();
  if (key.empty()) {
    nlohmann::json fields = manifest;
    fields.erase("tensors");
    fields.erase(ckpt::kPiecesKey);
    std::cout << fields.dump(2) << "\n";
    return kOk;
  }
  const nlohmann::json* value = nullptr;
  if (key[0] == '/') {
    try {
      const nlohmann::json::json_pointer pointer(key);
      if (manifest.contains(pointer)) value = &manifest.at(pointer);
    } catch (const nlohmann::json::exception& e) {
      return UsageError(absl::StrCat("--key=", key, " is not a valid JSON pointer: ", e.what()));
    }
  } else if (manifest.contains(key)) {
    value = &manifest.at(key);
  }
  if (value == nullptr) {
    std::vector<std::string> keys;
    for (const auto& [name, field] : manifest.items()) keys.push_back(name);
    std::cerr << "fulcrum_ckpt: " << JoinPath(reader.dir(), ckpt::kManifestFileName)
              << " has no field '" << key << "'; top-level fields: " << absl::StrJoin(keys, ", ")
              << "\n";
    return kFailed;
  }
  std::cout << value->dump(2) << "\n";
  return kOk;
}

// A refused input is a usage-class error (2): the caller must change what it gave; a
// failure while writing the output is 1.
int ConversionFailed(const absl::Status& status) {
  std::cerr << "fulcrum_ckpt: " << status.message() << "\n";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return kUsageError;
    default:
      return kFailed;
  }
}

int ConvertHf(int argc, char** argv) {
  const std::string command = argv[1];
  if (argc != 4) {
    return UsageError(command == "import-hf" ? "expected: import-hf HF_DIR OUT"
                                             : "expected: export-hf CKPT OUT");
  }
  if (!FLAGS_key.empty() || FLAGS_allow_unchecksummed_manifest ||
      !gflags::GetCommandLineFlagInfoOrDie("pieces").is_default) {
    return UsageError(absl::StrCat("--key, --allow_unchecksummed_manifest and --pieces do not "
                                   "apply to `", command, "`"));
  }
  FileSystem* fs = DefaultFileSystem();
  if (command == "import-hf") {
    if (!gflags::GetCommandLineFlagInfoOrDie("max_shard_size").is_default ||
        FLAGS_num_experts_per_tok != 0) {
      return UsageError("--max_shard_size and --num_experts_per_tok only apply to `export-hf`");
    }
    absl::StatusOr<ckpt::HfImportResult> result = ckpt::ImportHuggingFace(fs, argv[2], argv[3]);
    if (!result.ok()) return ConversionFailed(result.status());
    std::cout << "imported " << ckpt::HfArchitectureName(result->model.architecture) << " from "
              << argv[2] << ": " << result->tensors << " tensors, " << result->parameters
              << " parameters, into " << result->checkpoint_dir << "\n"
              << "fine-tune it with: fulcrum_train --load=" << argv[3] << " --finetune "
              << absl::StrJoin(result->flags, " ") << "\n";
    return kOk;
  }
  ckpt::HfExportOptions options;
  absl::StatusOr<uint64_t> max_shard = ckpt::ParseByteSize(FLAGS_max_shard_size);
  if (!max_shard.ok()) return UsageError(std::string(max_shard.status().message()));
  options.max_shard_bytes = *max_shard;
  if (FLAGS_num_experts_per_tok < 0) return UsageError("--num_experts_per_tok must be ≥ 0");
  options.num_experts_per_tok = FLAGS_num_experts_per_tok;
  absl::StatusOr<ckpt::HfExportResult> result =
      ckpt::ExportHuggingFace(fs, argv[2], argv[3], options);
  if (!result.ok()) return ConversionFailed(result.status());
  std::cout << "exported " << ckpt::HfArchitectureName(result->model.architecture) << " to "
            << argv[3] << ": " << result->tensors << " tensors in "
            << absl::StrJoin(result->files, ", ") << "\n";
  return kOk;
}

// The caller's fields of `manifest` (what Commit must be given back to rewrite it).
nlohmann::json CallerFields(const nlohmann::json& manifest) {
  nlohmann::json fields = manifest;
  for (const char* key : {"format_version", "files", "tensors", ckpt::kPiecesKey,
                          ckpt::kManifestChecksumKey}) {
    fields.erase(key);
  }
  return fields;
}

// Rewrites checkpoint `in` into the new save directory `out` (nothing there yet): every
// tensor read whole, then written by `write` (given the writer and the tensors by name).
absl::Status Rewrite(
    FileSystem* fs, const std::string& in, const std::string& out,
    const std::function<absl::Status(ckpt::CheckpointWriter&,
                                     const std::vector<std::pair<std::string, at::Tensor>>&)>&
        write) {
  FULCRUM_ASSIGN_OR_RETURN(const ckpt::CheckpointReader reader, ckpt::CheckpointReader::Open(fs, in));
  if (fs->FileExists(out)) {
    const absl::StatusOr<std::vector<std::string>> listed = fs->ListDir(out);
    if (!fs->IsDirectory(out) || !listed.ok() || !listed->empty()) {
      return absl::AlreadyExistsError(absl::StrCat(out, " exists and is not an empty directory"));
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const std::string& name : reader.names()) {
    FULCRUM_ASSIGN_OR_RETURN(at::Tensor tensor, reader.Read(name));  // checked on the way
    tensors.emplace_back(name, std::move(tensor));
  }
  FULCRUM_ASSIGN_OR_RETURN(ckpt::CheckpointWriter writer,
                           ckpt::CheckpointWriter::Begin(fs, out, reader.iteration()));
  absl::Status status = write(writer, tensors);
  if (status.ok()) status = writer.Commit(CallerFields(reader.manifest()));
  if (!status.ok()) (void)writer.Abort();
  return status;
}

// `shard`: each tensor of at least `pieces` elements cut into `pieces` ranges of its
// row-major elements, piece i into file piece_0000i; the others whole, into piece_00000.
absl::Status WritePieces(ckpt::CheckpointWriter& writer,
                         const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                         int64_t pieces) {
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> whole(pieces);
  std::vector<std::vector<ckpt::TensorPiece>> parts(pieces);
  for (const auto& [name, tensor] : tensors) {
    const int64_t numel = tensor.numel();
    if (tensor.dim() == 0 || numel < pieces) {
      whole[0].emplace_back(name, tensor);
      continue;
    }
    const at::Tensor flat = tensor.contiguous().view({-1});
    for (int64_t i = 0; i < pieces; ++i) {
      ckpt::TensorPiece piece;
      piece.name = name;
      piece.shape = tensor.sizes().vec();
      piece.offsets.assign(piece.shape.size(), 0);
      piece.box = piece.shape;
      piece.flat = true;  // the whole tensor is the box
      piece.flat_begin = numel * i / pieces;
      piece.flat_end = numel * (i + 1) / pieces;
      piece.tensor = flat.narrow(0, piece.flat_begin, piece.flat_end - piece.flat_begin);
      parts[i].push_back(std::move(piece));
    }
  }
  for (int64_t i = 0; i < pieces; ++i) {
    FULCRUM_RETURN_IF_ERROR(
        writer.WriteShard(absl::StrFormat("piece_%05d", i), whole[i], parts[i]));
  }
  return absl::OkStatus();
}

int Reshard(int argc, char** argv) {
  const std::string command = argv[1];
  if (argc != 4) return UsageError(absl::StrCat("expected: ", command, " CKPT OUT"));
  if (!FLAGS_key.empty() || FLAGS_allow_unchecksummed_manifest ||
      !gflags::GetCommandLineFlagInfoOrDie("max_shard_size").is_default ||
      FLAGS_num_experts_per_tok != 0) {
    return UsageError(absl::StrCat("only --pieces applies to `", command, "`"));
  }
  if (command == "consolidate" && !gflags::GetCommandLineFlagInfoOrDie("pieces").is_default) {
    return UsageError("--pieces only applies to `shard`");
  }
  if (FLAGS_pieces < 1 || FLAGS_pieces > 4096) {
    return UsageError(absl::StrCat("--pieces=", FLAGS_pieces, " must be in 1..4096"));
  }
  const absl::Status status = Rewrite(
      DefaultFileSystem(), argv[2], argv[3],
      [&](ckpt::CheckpointWriter& writer,
          const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
        return command == "consolidate" ? writer.WriteShard("model", tensors)
                                        : WritePieces(writer, tensors, FLAGS_pieces);
      });
  if (!status.ok()) return ConversionFailed(status);
  std::cout << (command == "consolidate" ? "consolidated " : "sharded ") << argv[2] << " into "
            << argv[3]
            << (command == "consolidate" ? std::string(" (one file)")
                                         : absl::StrCat(" (", FLAGS_pieces, " pieces)"))
            << "\n";
  return kOk;
}

int Main(int argc, char** argv) {
  cli::HelpSpec help;
  help.program = "fulcrum_ckpt";
  help.takes_arguments = true;  // the subcommand and its paths
  help.usage = kUsageText;
  help.groups = {{"show", {"key"}},
                 {"verify", {"allow_unchecksummed_manifest"}},
                 {"export-hf", {"max_shard_size", "num_experts_per_tok"}},
                 {"shard", {"pieces"}}};
  // `fulcrum_ckpt help` reads like the commands; it asks for the same text as --help.
  if (argc >= 2 && std::string_view(argv[1]) == "help") {
    std::cout << cli::HelpText(help);
    return kOk;
  }
  if (std::optional<int> exit_code = cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }
  InitLogging(argv[0]);

  if (argc >= 2 && (std::string(argv[1]) == "import-hf" || std::string(argv[1]) == "export-hf")) {
    return ConvertHf(argc, argv);
  }
  if (argc >= 2 && (std::string(argv[1]) == "consolidate" || std::string(argv[1]) == "shard")) {
    return Reshard(argc, argv);
  }
  if (!gflags::GetCommandLineFlagInfoOrDie("max_shard_size").is_default ||
      FLAGS_num_experts_per_tok != 0) {
    return UsageError("--max_shard_size and --num_experts_per_tok only apply to `export-hf`");
  }
  if (!gflags::GetCommandLineFlagInfoOrDie("pieces").is_default) {
    return UsageError("--pieces only applies to `shard`");
  }
  if (argc != 3) return UsageError("expected a command and a PATH");
  const std::string command = argv[1];
  const std::string path = argv[2];
  if (command != "list" && command != "verify" && command != "show") {
    return UsageError(absl::StrCat("unknown command '", command, "'"));
  }
  if (!FLAGS_key.empty() && command != "show") {
    return UsageError("--key only applies to `show`");
  }
  if (FLAGS_allow_unchecksummed_manifest && command != "verify") {
    return UsageError("--allow_unchecksummed_manifest only applies to `verify`");
  }

  // `list` and `show` display any manifest, checksummed or not (the reader warns); `verify`
  // vouches for the checkpoint, so it fails one it cannot vouch for unless told otherwise.
  ckpt::CheckpointReadOptions options;
  options.allow_unchecksummed_manifest = command != "verify" || FLAGS_allow_unchecksummed_manifest;
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(path, options);
  if (!reader.ok()) {
    if (command == "verify") {
      std::cout << "FAILED: " << reader.status().message() << "\n";
      return kFailed;
    }
    return Fail(reader.status());
  }
  if (command == "list") return List(*reader);
  if (command == "verify") return Verify(*reader);
  return Show(*reader, FLAGS_key);
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) { return fulcrum::Main(argc, argv); }
