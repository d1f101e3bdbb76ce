// fulcrum_preprocess: tokenizes a text corpus into Megatron indexed datasets (.bin/.idx),
// the counterpart of Megatron-LM's tools/preprocess_data.py and readable by it.
//
//   fulcrum_preprocess --input=wiki.jsonl --output_prefix=data/wiki
//       -> data/wiki_tokenizer.model (trained, since no --tokenizer_model was given)
//          data/wiki_text_document.{bin,idx}
//
// Inputs, per file:
//   JSONL (name ends in .json/.jsonl, or --input_format=jsonl): one JSON object per line;
//     each key of --json_keys is a document of its own dataset
//     {output_prefix}_{key}_document. A value is a string, or a list of strings that become
//     separate sequences of one document (Megatron's pre-split sentences).
//   Plain text: the whole file is one document, or with --text_document_separator=blank_line
//     every blank-line-separated paragraph is; they go to {output_prefix}_text_document.
// Like Megatron, a document gets the end-of-document token after its last sequence
// (--append_eod) and an empty document keeps its place in the index with no sequence, so the
// datasets of several keys stay aligned line by line.
//
// Exit status: 0 success; 2 bad flags or bad input (message on stderr; flags and input files
// are checked before any work, a malformed JSON line as soon as it is read, and no partial
// output is left behind); 1 any other failure (e.g. a write error).
#include <gflags/gflags.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/data/indexed_dataset.h"
#include "core/data/tokenizer.h"
#include "core/logging.h"
#include "recipes/cli.h"
#include "core/status.h"

DEFINE_string(input, "", "Input file(s), comma-separated. Required.");
DEFINE_string(input_format, "auto",
              "auto: JSONL for names ending in .json or .jsonl, plain text otherwise; "
              "jsonl; or text.");
DEFINE_string(json_keys, "text",
              "Comma-separated JSON keys to extract; each writes "
              "{output_prefix}_{key}_document.bin/.idx.");
DEFINE_string(text_document_separator, "file",
              "Plain-text inputs: 'file' (each file is one document) or 'blank_line' (each "
              "paragraph separated by blank lines is one document).");
DEFINE_string(output_prefix, "", "Prefix of the output files. Required.");
DEFINE_string(tokenizer_type, "sentencepiece", "'sentencepiece' or 'byte'.");
DEFINE_string(tokenizer_model, "",
              "SentencePiece .model file to use. Without it, --tokenizer_type=sentencepiece "
              "trains a BPE model on the input and saves it as {output_prefix}_tokenizer.model.");
DEFINE_int64(vocab_size, 8000, "Vocabulary size of a tokenizer trained here.");
DEFINE_bool(append_eod, true, "Append the end-of-document token to every document.");
DEFINE_int64(log_interval, 10000, "Log progress every this many documents.");

namespace {

using fulcrum::data::BestTokenDType;
using fulcrum::data::DTypeName;
using fulcrum::data::IndexedDatasetWriter;
using fulcrum::data::Tokenizer;

constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;
// Plain-text documents go to the dataset of this key.
constexpr char kTextKey[] = "text";

enum class InputFormat { kJsonl, kText };

struct InputFile {
  std::string path;
  InputFormat format;
};

struct Options {
  std::vector<InputFile> inputs;
  std::vector<std::string> json_keys;
  bool split_on_blank_lines = false;
  std::string output_prefix;
  std::string tokenizer_type;
  std::string tokenizer_model;
  int64_t vocab_size = 0;
  bool append_eod = true;
  int64_t log_interval = 0;
};

// One document: for each key of Options::json_keys, its sequences of text.
using Document = std::vector<std::vector<std::string>>;
using DocumentVisitor = std::function<absl::Status(const Document& document, size_t bytes)>;

bool IsBadInput(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return true;
    default: return false;
  }
}

std::string DatasetPrefix(const Options& options, const std::string& key) {
  return absl::StrCat(options.output_prefix, "_", key, "_document");
}

absl::StatusOr<Options> OptionsFromFlags() {
  Options options;
  if (FLAGS_input.empty()) return absl::InvalidArgumentError("--input is required");
  if (FLAGS_output_prefix.empty()) {
    return absl::InvalidArgumentError("--output_prefix is required");
  }
  if (FLAGS_input_format != "auto" && FLAGS_input_format != "jsonl" &&
      FLAGS_input_format != "text") {
    return absl::InvalidArgumentError(
        absl::StrCat("--input_format=", FLAGS_input_format, ": expected auto, jsonl or text"));
  }
  if (FLAGS_text_document_separator != "file" && FLAGS_text_document_separator != "blank_line") {
    return absl::InvalidArgumentError(
        absl::StrCat("--text_document_separator=", FLAGS_text_document_separator,
                     ": expected file or blank_line"));
  }
  if (FLAGS_tokenizer_type != "sentencepiece" && FLAGS_tokenizer_type != "byte") {
    return absl::InvalidArgumentError(absl::StrCat("--tokenizer_type=", FLAGS_tokenizer_type,
                                                   ": expected sentencepiece or byte"));
  }
  if (FLAGS_log_interval <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_interval=", FLAGS_log_interval, ": expected a positive count"));
  }
  if (FLAGS_tokenizer_type == "sentencepiece" && FLAGS_tokenizer_model.empty() &&
      FLAGS_vocab_size <= fulcrum::data::SentencePieceTokenizer::kReservedPieces) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab_size=", FLAGS_vocab_size, ": a sentencepiece model needs more than ",
                     fulcrum::data::SentencePieceTokenizer::kReservedPieces,
                     " pieces (3 control + 256 byte-fallback)"));
  }
  options.split_on_blank_lines = FLAGS_text_document_separator == "blank_line";
  options.output_prefix = FLAGS_output_prefix;
  options.tokenizer_type = FLAGS_tokenizer_type;
  options.tokenizer_model = FLAGS_tokenizer_model;
  options.vocab_size = FLAGS_vocab_size;
  options.append_eod = FLAGS_append_eod;
  options.log_interval = FLAGS_log_interval;

  std::set<std::string> seen_keys;
  for (absl::string_view key : absl::StrSplit(FLAGS_json_keys, ',', absl::SkipWhitespace())) {
    const std::string name(key);
    if (name.find('/') != std::string::npos || !seen_keys.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("--json_keys=", FLAGS_json_keys, ": key '",
                                                     name, "' is repeated or contains '/'"));
    }
    options.json_keys.push_back(name);
  }
  if (options.json_keys.empty()) {
    return absl::InvalidArgumentError("--json_keys is empty; expected e.g. --json_keys=text");
  }

  for (absl::string_view path : absl::StrSplit(FLAGS_input, ',', absl::SkipWhitespace())) {
    InputFile input{std::string(path), InputFormat::kText};
    if (FLAGS_input_format == "jsonl" ||
        (FLAGS_input_format == "auto" &&
         (absl::EndsWith(path, ".jsonl") || absl::EndsWith(path, ".json")))) {
      input.format = InputFormat::kJsonl;
    }
    if (!std::ifstream(input.path).is_open()) {
      return absl::NotFoundError(absl::StrCat("--input: cannot open ", input.path));
    }
    if (input.format == InputFormat::kText &&
        options.json_keys != std::vector<std::string>{kTextKey}) {
      return absl::InvalidArgumentError(
          absl::StrCat("--json_keys=", FLAGS_json_keys, " but ", input.path,
                       " is plain text, whose documents go to the '", kTextKey,
                       "' dataset; use --json_keys=text (the default) or JSONL input"));
    }
    options.inputs.push_back(std::move(input));
  }
  if (options.inputs.empty()) return absl::InvalidArgumentError("--input names no file");

  // Fail now, not after tokenizing everything, when the output folder is unusable.
  std::filesystem::path folder = std::filesystem::path(options.output_prefix).parent_path();
  if (folder.empty()) folder = ".";
  if (!std::filesystem::is_directory(folder) || ::access(folder.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--output_prefix=", options.output_prefix,
                                                   ": folder ", folder.string(),
                                                   " does not exist or is not writable"));
  }
  return options;
}

// Appends the sequences of a JSON value (a string, or a list of strings) to `sequences`.
absl::Status TextsOf(const nlohmann::json& value, const std::string& where, const std::string& key,
                     std::vector<std::string>* sequences) {
  if (value.is_string()) {
    sequences->push_back(value.get<std::string>());
    return absl::OkStatus();
  }
  if (value.is_array()) {
    for (const nlohmann::json& item : value) {
      if (!item.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": key \"", key,
                                                       "\" holds a list with a ", item.type_name(),
                                                       "; expected a string or a list of strings"));
      }
      sequences->push_back(item.get<std::string>());
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(where, ": key \"", key, "\" is a ",
                                                 value.type_name(),
                                                 "; expected a string or a list of strings"));
}

absl::Status ForEachJsonlDocument(const InputFile& input, const Options& options,
                                  const DocumentVisitor& visit) {
  std::ifstream in(input.path, std::ios::binary);
  if (!in.is_open()) return absl::NotFoundError(absl::StrCat("cannot open ", input.path));
  std::string line;
  for (int64_t line_number = 1; std::getline(in, line); ++line_number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // Blank line.
    const std::string where = absl::StrCat(input.path, ":", line_number);
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& error) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": malformed JSON: ", error.what()));
    }
    if (!object.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected a JSON object, found a ", object.type_name()));
    }
    Document document(options.json_keys.size());
    for (size_t k = 0; k < options.json_keys.size(); ++k) {
      const std::string& key = options.json_keys[k];
      const auto it = object.find(key);
      if (it == object.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": no key \"", key,
                         "\" (--json_keys=", absl::StrJoin(options.json_keys, ","), ")"));
      }
      FULCRUM_RETURN_IF_ERROR(TextsOf(*it, where, key, &document[k]));
    }
    FULCRUM_RETURN_IF_ERROR(visit(document, line.size() + 1));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", input.path));
  return absl::OkStatus();
}

absl::Status ForEachTextDocument(const InputFile& input, const Options& options,
                                 const DocumentVisitor& visit) {
  std::ifstream in(input.path, std::ios::binary);
  if (!in.is_open()) return absl::NotFoundError(absl::StrCat("cannot open ", input.path));
  if (!options.split_on_blank_lines) {
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", input.path));
    return visit(Document{{text}}, text.size());
  }
  // Paragraphs: runs of lines that are not blank, joined with their newlines.
  std::string line;
  std::string paragraph;
  size_t bytes = 0;
  auto flush = [&]() -> absl::Status {
    if (paragraph.empty()) return absl::OkStatus();
    paragraph.pop_back();  // The newline after the paragraph's last line.
    const absl::Status status = visit(Document{{paragraph}}, bytes);
    paragraph.clear();
    bytes = 0;
    return status;
  };
  while (std::getline(in, line)) {
    bytes += line.size() + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      FULCRUM_RETURN_IF_ERROR(flush());
    } else {
      absl::StrAppend(&paragraph, line, "\n");
    }
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", input.path));
  return flush();
}

absl::Status ForEachDocument(const Options& options, const DocumentVisitor& visit) {
  for (const InputFile& input : options.inputs) {
    FULCRUM_RETURN_IF_ERROR(input.format == InputFormat::kJsonl
                                ? ForEachJsonlDocument(input, options, visit)
                                : ForEachTextDocument(input, options, visit));
  }
  return absl::OkStatus();
}

// Trains a sentencepiece model on the input: plain-text files as they are, the values of
// JSONL files extracted into a temporary text file first. Reading the JSONL files here also
// checks every line before any dataset is written.
absl::StatusOr<std::string> TrainTokenizer(const Options& options) {
  const std::string model_prefix = absl::StrCat(options.output_prefix, "_tokenizer");
  const std::string extracted = absl::StrCat(model_prefix, "_train.txt.partial");
  std::vector<std::string> training_files;
  bool has_jsonl = false;
  for (const InputFile& input : options.inputs) {
    if (input.format == InputFormat::kText) training_files.push_back(input.path);
    has_jsonl |= input.format == InputFormat::kJsonl;
  }
  // Removes the extracted text however this function returns.
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      if (!path.empty()) std::remove(path.c_str());
    }
  } cleanup{has_jsonl ? extracted : ""};
  if (has_jsonl) {
    std::ofstream out(extracted, std::ios::binary);
    if (!out.is_open()) {
      return absl::PermissionDeniedError(absl::StrCat("cannot create ", extracted));
    }
    Options jsonl_only = options;
    jsonl_only.inputs.erase(
        std::remove_if(jsonl_only.inputs.begin(), jsonl_only.inputs.end(),
                       [](const InputFile& input) { return input.format != InputFormat::kJsonl; }),
        jsonl_only.inputs.end());
    FULCRUM_RETURN_IF_ERROR(ForEachDocument(jsonl_only, [&](const Document& document, size_t) {
      for (const auto& sequences : document) {
        for (const std::string& text : sequences) out << text << '\n';
      }
      return absl::OkStatus();
    }));
    out.close();
    if (out.fail()) return absl::DataLossError(absl::StrCat("error writing ", extracted));
    training_files.push_back(extracted);
  }
  FULCRUM_LOG(INFO) << "training a sentencepiece BPE tokenizer with " << options.vocab_size
                    << " pieces on " << absl::StrJoin(training_files, ", ");
  const auto start = std::chrono::steady_clock::now();
  FULCRUM_RETURN_IF_ERROR(fulcrum::data::SentencePieceTokenizer::Train(
      training_files, options.vocab_size, model_prefix));
  FULCRUM_LOG(INFO) << absl::StrFormat(
      "saved %s.model (%.1f s)", model_prefix,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return absl::StrCat(model_prefix, ".model");
}

// Tokenizes the texts of one key of a document into one document of `writer`. As Megatron's
// preprocess_data.py: each non-empty text is a sequence, the eod joins the last sequence,
// and a document without tokens is still recorded (with no sequence) so that the datasets of
// several keys stay aligned.
absl::Status WriteDocument(const std::vector<std::string>& texts, const Tokenizer& tokenizer,
                           bool append_eod, IndexedDatasetWriter& writer, int64_t* empty_texts) {
  std::vector<std::vector<int64_t>> sequences;
  for (const std::string& text : texts) {
    std::vector<int64_t> ids = tokenizer.Encode(text);
    if (!ids.empty()) sequences.push_back(std::move(ids));
  }
  if (sequences.empty()) {
    ++*empty_texts;
  } else if (append_eod) {
    sequences.back().push_back(tokenizer.eod_id());
  }
  for (const std::vector<int64_t>& ids : sequences) {
    FULCRUM_RETURN_IF_ERROR(writer.AddSequence(ids));
  }
  writer.EndDocument();
  return absl::OkStatus();
}

absl::Status Run(const Options& options) {
  std::string model_path = options.tokenizer_model;
  if (options.tokenizer_type == "sentencepiece" && model_path.empty()) {
    FULCRUM_ASSIGN_OR_RETURN(model_path, TrainTokenizer(options));
  }
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                           fulcrum::data::MakeTokenizer(options.tokenizer_type, model_path));
  const auto dtype = BestTokenDType(tokenizer->vocab_size());
  FULCRUM_LOG(INFO) << "tokenizer " << tokenizer->name() << ": " << tokenizer->vocab_size()
                    << " ids, eod " << tokenizer->eod_id() << "; tokens stored as "
                    << DTypeName(dtype);

  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  for (const std::string& key : options.json_keys) {
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<IndexedDatasetWriter> writer,
                             IndexedDatasetWriter::Create(DatasetPrefix(options, key), dtype));
    writers.push_back(std::move(writer));
  }

  int64_t documents = 0;
  int64_t empty_texts = 0;  // Key values with no tokens, kept as empty documents.
  size_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  FULCRUM_RETURN_IF_ERROR(ForEachDocument(
      options, [&](const Document& document, size_t document_bytes) -> absl::Status {
        for (size_t k = 0; k < document.size(); ++k) {
          FULCRUM_RETURN_IF_ERROR(WriteDocument(document[k], *tokenizer, options.append_eod,
                                                *writers[k], &empty_texts));
        }
        ++documents;
        bytes += document_bytes;
        if (documents % options.log_interval == 0) {
          FULCRUM_LOG(INFO) << absl::StrFormat("processed %d documents, %.1f MB (%.2f MB/s)",
                                               documents, bytes / 1e6,
                                               bytes / 1e6 / std::max(seconds(), 1e-9));
        }
        return absl::OkStatus();
      }));

  for (size_t k = 0; k < writers.size(); ++k) {
    FULCRUM_RETURN_IF_ERROR(writers[k]->Finalize());
    FULCRUM_LOG(INFO) << "wrote " << DatasetPrefix(options, options.json_keys[k])
                      << ".{bin,idx}: " << writers[k]->num_documents() << " documents, "
                      << writers[k]->num_sequences() << " sequences, " << writers[k]->num_tokens()
                      << " tokens";
  }
  FULCRUM_LOG(INFO) << absl::StrFormat(
      "done: %d documents, %.1f MB in %.1f s; %d empty texts kept as empty documents", documents,
      bytes / 1e6, seconds(), empty_texts);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  fulcrum::InitLogging(argv[0]);
  fulcrum::cli::HelpSpec help;
  help.program = "fulcrum_preprocess";
  help.usage =
      "fulcrum_preprocess: tokenizes text into Megatron indexed datasets (.bin/.idx).\n\n"
      "  fulcrum_preprocess --input=corpus.jsonl --output_prefix=data/corpus\n"
      "      trains data/corpus_tokenizer.model (sentencepiece BPE, --vocab_size) and writes\n"
      "      data/corpus_text_document.{bin,idx}\n"
      "  fulcrum_preprocess --input=a.txt,b.txt --tokenizer_type=byte --output_prefix=out/ab\n\n"
      "JSONL (.json/.jsonl): one object per line; every --json_keys key becomes\n"
      "{output_prefix}_{key}_document. Plain text: one document per file, or per paragraph\n"
      "with --text_document_separator=blank_line.\n"
      "Exit status: 0 ok, 2 bad flags or input, 1 other failure.\n";
  help.groups = {
      {"Input", {"input", "input_format", "json_keys", "text_document_separator"}},
      {"Tokenizer", {"tokenizer_type", "tokenizer_model", "vocab_size", "append_eod"}},
      {"Output", {"output_prefix", "log_interval"}},
  };
  if (std::optional<int> exit_code = fulcrum::cli::ParseCommandLine(&argc, &argv, help)) {
    return *exit_code;
  }

  absl::StatusOr<Options> options = OptionsFromFlags();
  absl::Status status = options.status();
  if (status.ok()) status = Run(*options);
  if (!status.ok()) {
    std::cerr << "fulcrum_preprocess: " << status.message() << "\n";
    return IsBadInput(status) ? kExitBadInput : kExitFailure;
  }
  return 0;
}
