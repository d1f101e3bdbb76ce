#include "core/data/tokenizer.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/data/internal/sentencepiece_api.h"
#include "core/status.h"

namespace fulcrum::data {
namespace {

absl::Status ShimError(int code, const char* error, absl::string_view context) {
  return absl::Status(static_cast<absl::StatusCode>(code), absl::StrCat(context, ": ", error));
}

std::string ExecutableDir() {
  std::error_code error;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string() : exe.parent_path().string();
}

// Opens the shim once per process (see NOTE [sentencepiece isolation]); it stays loaded.
absl::StatusOr<const FulcrumSentencePieceApi*> LoadShim() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("FULCRUM_SENTENCEPIECE_SHIM"); path != nullptr && *path) {
    candidates.push_back(path);
  }
#ifdef FULCRUM_SENTENCEPIECE_SHIM_PATH
  candidates.push_back(FULCRUM_SENTENCEPIECE_SHIM_PATH);
#endif
  if (const std::string dir = ExecutableDir(); !dir.empty()) {
    candidates.push_back(dir + "/../lib/libfulcrum_sentencepiece.so");
  }
  std::vector<std::string> failures;
  for (const std::string& path : candidates) {
    // A new link-map namespace: sentencepiece and its protobuf never meet LibTorch's.
    void* handle = ::dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      failures.push_back(::dlerror());
      continue;
    }
    auto entry = reinterpret_cast<FulcrumSentencePieceApiFn>(
        ::dlsym(handle, FULCRUM_SENTENCEPIECE_API_SYMBOL));
    const FulcrumSentencePieceApi* api = entry != nullptr ? entry() : nullptr;
    if (api == nullptr || api->version != FULCRUM_SENTENCEPIECE_API_VERSION) {
      failures.push_back(absl::StrCat(path, ": not a version ", FULCRUM_SENTENCEPIECE_API_VERSION,
                                      " sentencepiece shim"));
      ::dlclose(handle);
      continue;
    }
    return api;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot load libfulcrum_sentencepiece.so, which runs the sentencepiece library (",
      absl::StrJoin(failures, "; "),
      "); build the fulcrum_sentencepiece target or point $FULCRUM_SENTENCEPIECE_SHIM at it"));
}

absl::StatusOr<const FulcrumSentencePieceApi*> Shim() {
  static const auto* const shim = new absl::StatusOr<const FulcrumSentencePieceApi*>(LoadShim());
  return *shim;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<int64_t> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::Decode(absl::Span<const int64_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id <= kEodId, "ByteTokenizer::Decode: id ", id,
                " outside the vocabulary [0, ", kEodId, "]");
    if (id != kEodId) text.push_back(static_cast<char>(id));
  }
  return text;
}

// ---------------------------------------------------------------------------------------
// SentencePieceTokenizer

SentencePieceTokenizer::SentencePieceTokenizer(std::string model_path,
                                               const FulcrumSentencePieceApi* api, void* model)
    : model_path_(std::move(model_path)),
      api_(api),
      model_(model),
      vocab_size_(api->piece_size(model)),
      eod_id_(api->eos_id(model)) {}

SentencePieceTokenizer::~SentencePieceTokenizer() { api_->free_model(model_); }

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    const std::string& model_path) {
  if (!std::ifstream(model_path).is_open()) {
    return absl::NotFoundError(absl::StrCat("cannot open sentencepiece model ", model_path));
  }
  FULCRUM_ASSIGN_OR_RETURN(const FulcrumSentencePieceApi* api, Shim());
  void* model = nullptr;
  const char* error = nullptr;
  if (const int code = api->load(model_path.c_str(), &model, &error); code != 0) {
    return ShimError(code, error, absl::StrCat(model_path, ": not a loadable sentencepiece model"));
  }
  // Owned from here on, also on the error path below.
  auto tokenizer =
      std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(model_path, api, model));
  if (tokenizer->eod_id_ < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_path,
                     ": the model has no eos piece; Fulcrum ends documents with it (train with "
                     "eos_id >= 0)"));
  }
  return tokenizer;
}

absl::Status SentencePieceTokenizer::Train(const std::vector<std::string>& text_files,
                                           int64_t vocab_size, const std::string& model_prefix) {
  if (text_files.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("training sentencepiece model ", model_prefix, ": no text files given"));
  }
  for (const std::string& file : text_files) {
    if (!std::ifstream(file).is_open()) {
      return absl::NotFoundError(absl::StrCat("training sentencepiece model ", model_prefix,
                                              ": cannot open text file ", file));
    }
  }
  if (vocab_size <= kReservedPieces || vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab_size=", vocab_size, " for a sentencepiece BPE model must be greater than ",
        kReservedPieces, " (3 control + 256 byte-fallback pieces)"));
  }
  const std::string vocab_size_text = std::to_string(vocab_size);
  const std::vector<std::pair<const char*, const char*>> args = {
      {"model_prefix", model_prefix.c_str()},
      {"model_type", "bpe"},
      {"vocab_size", vocab_size_text.c_str()},
      // Any byte sequence stays encodable: characters outside the vocabulary fall back to
      // byte pieces, never to <unk>.
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      // Keep the text exactly as written (no NFKC, whitespace kept, no dummy leading space)
      // so Decode(Encode(text)) == text.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      // Reproducible: one thread, and the first input_sentence_size lines rather than a
      // random sample of them.
      {"num_threads", "1"},
      {"shuffle_input_sentence", "false"},
      {"input_sentence_size", "10000000"},
      {"max_sentence_length", "16384"},
      // Ids: unk 0, bos 1, eos 2 (the end of document), no pad (sentencepiece's defaults).
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      // Warnings and errors only; sentencepiece logs every step at INFO.
      {"minloglevel", "1"},
  };
  std::vector<const char*> keys;
  std::vector<const char*> values;
  for (const auto& [key, value] : args) {
    keys.push_back(key);
    values.push_back(value);
  }
  std::vector<const char*> files;
  for (const std::string& file : text_files) files.push_back(file.c_str());

  FULCRUM_ASSIGN_OR_RETURN(const FulcrumSentencePieceApi* api, Shim());
  const char* error = nullptr;
  if (const int code =
          api->train(keys.data(), values.data(), keys.size(), files.data(), files.size(), &error);
      code != 0) {
    return ShimError(code, error,
                     absl::StrCat("training sentencepiece model ", model_prefix,
                                  ".model with --vocab_size=", vocab_size));
  }
  return absl::OkStatus();
}

std::vector<int64_t> SentencePieceTokenizer::Encode(std::string_view text) const {
  std::vector<int64_t> ids;
  const char* error = nullptr;
  const int code = api_->encode(
      model_, text.data(), text.size(), &ids,
      [](void* context, const int32_t* piece_ids, size_t count) {
        static_cast<std::vector<int64_t>*>(context)->assign(piece_ids, piece_ids + count);
      },
      &error);
  TORCH_CHECK(code == 0, "sentencepiece Encode with ", model_path_, ": ", error);
  return ids;
}

std::string SentencePieceTokenizer::Decode(absl::Span<const int64_t> ids) const {
  std::vector<int32_t> narrow(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab_size_, "SentencePieceTokenizer::Decode: id ", ids[i],
                " outside the vocabulary [0, ", vocab_size_, ") of ", model_path_);
    narrow[i] = static_cast<int32_t>(ids[i]);
  }
  std::string text;
  const char* error = nullptr;
  const int code = api_->decode(
      model_, narrow.data(), narrow.size(), &text,
      [](void* context, const char* piece_text, size_t size) {
        static_cast<std::string*>(context)->assign(piece_text, size);
      },
      &error);
  TORCH_CHECK(code == 0, "sentencepiece Decode with ", model_path_, ": ", error);
  return text;
}

std::string SentencePieceTokenizer::name() const {
  return absl::StrCat("sentencepiece(", model_path_, ")");
}

// ---------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const std::string& type,
                                                         const std::string& model_path) {
  if (type == "byte") {
    if (!model_path.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tokenizer_type=byte takes no model, but --tokenizer_model=", model_path,
                       " was given"));
    }
    return std::make_unique<ByteTokenizer>();
  }
  if (type == "sentencepiece") {
    if (model_path.empty()) {
      return absl::InvalidArgumentError(
          "--tokenizer_type=sentencepiece needs --tokenizer_model=PATH.model");
    }
    FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<SentencePieceTokenizer> tokenizer,
                             SentencePieceTokenizer::Load(model_path));
    return std::unique_ptr<Tokenizer>(std::move(tokenizer));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--tokenizer_type=", type, " is not a tokenizer; expected 'byte' or 'sentencepiece'"));
}

}  // namespace fulcrum::data
