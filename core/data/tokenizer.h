// Tokenizers: text <-> token ids, plus the end-of-document id appended after every
// document of a corpus. Two implementations: ByteTokenizer (UTF-8 bytes; needs no model
// file, for tests and quick runs) and SentencePieceTokenizer (BPE models trained or loaded
// with the sentencepiece library).
//
// Thread-safety: a constructed Tokenizer is immutable; Encode/Decode may run concurrently.
// SentencePieceTokenizer::Train must not run concurrently with itself (sentencepiece keeps
// global state).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

struct FulcrumSentencePieceApi;  // core/data/internal/sentencepiece_api.h

namespace fulcrum::data {

/// Maps text to token ids and back.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// Token ids of `text`, without the end-of-document id.
  virtual std::vector<int64_t> Encode(std::string_view text) const = 0;
  /// Text of `ids`; eod_id() and other control ids decode to nothing. Every id must be in
  /// [0, vocab_size()) (throws c10::Error otherwise).
  virtual std::string Decode(absl::Span<const int64_t> ids) const = 0;
  /// Number of distinct ids: every id is in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  /// The id that ends a document in a corpus.
  virtual int64_t eod_id() const = 0;
  /// Short description for logs, e.g. "byte" or "sentencepiece(/data/spm.model)".
  virtual std::string name() const = 0;
};

/// UTF-8 bytes are the tokens: ids 0..255 are the byte values, 256 ends a document.
/// Exact round trip for any byte string.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int64_t kEodId = 256;

  std::vector<int64_t> Encode(std::string_view text) const override;
  std::string Decode(absl::Span<const int64_t> ids) const override;
  int64_t vocab_size() const override { return kEodId + 1; }
  int64_t eod_id() const override { return kEodId; }
  std::string name() const override { return "byte"; }
};

/// A sentencepiece model. Fulcrum-trained models (Train) are BPE with byte fallback and
/// identity normalisation, so Decode(Encode(text)) == text for any UTF-8 text; models from
/// elsewhere behave as their normaliser says. The model's eos piece ends documents.
///
/// The sentencepiece library runs inside libfulcrum_sentencepiece.so, loaded on first use
/// (see NOTE [sentencepiece isolation] in core/data/internal/sentencepiece_api.h). It is
/// looked for at $FULCRUM_SENTENCEPIECE_SHIM, then where the build put it, then in
/// ../lib next to the running executable.
class SentencePieceTokenizer final : public Tokenizer {
 public:
  /// Pieces every trained model reserves before text pieces: 3 control (unk, bos, eos) and
  /// 256 byte-fallback pieces. Train() needs a larger vocab_size.
  static constexpr int64_t kReservedPieces = 3 + 256;

  /// Loads a `.model` file. Fails when the file is unreadable or not a sentencepiece
  /// model, or when the model has no eos piece.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(
      const std::string& model_path);

  /// Trains a BPE model with `vocab_size` pieces on the lines of `text_files` and writes
  /// `model_prefix.model` and `model_prefix.vocab`. Reproducible: the same files and
  /// arguments give the same model (single thread, no sentence sampling: when the input
  /// has more than 10M non-empty lines, the first 10M are used). `vocab_size` must exceed
  /// kReservedPieces and leave room for the text's characters.
  static absl::Status Train(const std::vector<std::string>& text_files, int64_t vocab_size,
                            const std::string& model_prefix);

  ~SentencePieceTokenizer() override;
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<int64_t> Encode(std::string_view text) const override;
  std::string Decode(absl::Span<const int64_t> ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod_id() const override { return eod_id_; }
  std::string name() const override;

 private:
  SentencePieceTokenizer(std::string model_path, const FulcrumSentencePieceApi* api, void* model);

  std::string model_path_;
  const FulcrumSentencePieceApi* api_;
  void* model_;  // Owned: a sentencepiece::SentencePieceProcessor inside the shim.
  int64_t vocab_size_ = 0;
  int64_t eod_id_ = -1;
};

/// Makes the tokenizer named by `type`: "byte" (`model_path` must be empty) or
/// "sentencepiece" (`model_path` is the `.model` file). Errors name `--tokenizer_type` /
/// `--tokenizer_model`.
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const std::string& type,
                                                         const std::string& model_path);

}  // namespace fulcrum::data
