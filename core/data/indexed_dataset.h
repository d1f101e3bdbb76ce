// Megatron-LM's indexed dataset: tokenized documents in a `.bin`/`.idx` file pair, byte for
// byte the format of megatron/core/datasets/indexed_dataset.py, so corpora preprocessed by
// Megatron's tools/preprocess_data.py train here unchanged and ours train there.
//
// NOTE [Megatron .idx layout] (all integers little-endian):
//
//   offset  size        field
//   0       9           magic "MMIDIDX\x00\x00"
//   9       8  u64      version, always 1
//   17      1  u8       dtype code of the tokens in .bin (see DType)
//   18      8  u64      sequence_count S
//   26      8  u64      document_count D = length of the document_indices array
//   34      4*S i32     sequence_lengths, in tokens
//   ..      8*S i64     sequence_pointers, byte offset of each sequence in .bin:
//                       pointer[0] = 0, pointer[i+1] = pointer[i] + length[i] * itemsize
//   ..      8*D i64     document_indices: 0, then the sequence count after each document,
//                       so document d is sequences [doc[d], doc[d+1]) and D = documents + 1
//
// `.bin` is the tokens of all sequences concatenated, in the dtype of the header. A Megatron
// "sequence" is what its preprocessor emits per sentence (or per document without sentence
// splitting); Megatron's GPT dataset splits and shuffles by sequence, and so does GptDataset.
//
// Thread-safety: an opened IndexedDataset is immutable; every const method may be called
// from any number of threads. IndexedDatasetWriter is single-threaded.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/data/megatron_index.h"

namespace fulcrum::data {

/// A read-only view of a Megatron indexed dataset: the index held in memory, the tokens
/// memory-mapped (or owned, for datasets built in memory).
class IndexedDataset {
 public:
  /// Opens `path_prefix.idx` and `path_prefix.bin`. Everything is validated before this
  /// returns (magic, version, dtype, array sizes, lengths, pointers, document indices and
  /// the `.bin` size), so later reads cannot run off the files. Errors name the file and
  /// the field, with what was expected and what was found.
  static absl::StatusOr<std::shared_ptr<IndexedDataset>> Open(const std::string& path_prefix);

  /// Builds a dataset from tokens already in memory (no files; the default corpus uses it).
  /// `tokens` is every sequence concatenated; `sequence_lengths` and `document_indices`
  /// follow NOTE [Megatron .idx layout]. `name` stands in for the path in messages. The
  /// arrays must be consistent (it is a programming error otherwise: throws c10::Error).
  /// dtype() is kInt64.
  static std::shared_ptr<IndexedDataset> FromMemory(std::string name, std::vector<int64_t> tokens,
                                                    std::vector<int32_t> sequence_lengths,
                                                    std::vector<int64_t> document_indices);

  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  /// The path prefix it was opened from, or the name given to FromMemory.
  const std::string& path_prefix() const { return path_prefix_; }
  DType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  /// Number of documents (document_indices().size() - 1).
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  /// Total number of tokens in all sequences.
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sequence_length(int64_t sequence) const;
  absl::Span<const int32_t> sequence_lengths() const { return sequence_lengths_; }
  /// Megatron's document_indices: starts with 0, one more entry per document, ends with
  /// num_sequences().
  absl::Span<const int64_t> document_indices() const { return document_indices_; }

  /// Copies tokens [offset, offset + count) of `sequence` into `out`, converted to int64
  /// (float dtypes are truncated toward zero). The range must lie inside the sequence.
  void Read(int64_t sequence, int64_t offset, int64_t count, int64_t* out) const;

  /// The largest token id in the whole dataset, or -1 when it has no tokens. Scans every
  /// token: meant for inferring a vocabulary size once, not for hot paths.
  int64_t MaxToken() const;

 private:
  class MappedFile;
  IndexedDataset() = default;

  std::string path_prefix_;
  DType dtype_ = DType::kInt64;
  int64_t itemsize_ = 8;
  int64_t num_tokens_ = 0;
  // The index arrays are copied out of the .idx file: in the file they start at byte 34,
  // which is not aligned for int32/int64 loads.
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> sequence_pointers_;
  std::vector<int64_t> document_indices_;
  // Token bytes: either the mapped .bin file or owned_tokens_.
  std::unique_ptr<MappedFile> bin_;
  std::vector<int64_t> owned_tokens_;
  const uint8_t* token_bytes_ = nullptr;
};

/// Writes a Megatron indexed dataset. Tokens stream to `prefix.bin` through a buffer (a
/// corpus never has to fit in memory; the index, 12 bytes per sequence and 8 per
/// document, does). Both files are written under temporary names and renamed into place
/// by Finalize(), so an interrupted run never leaves a pair that looks complete; a writer
/// destroyed before Finalize() removes its temporary files.
class IndexedDatasetWriter {
 public:
  /// Creates the temporary output files. `dtype` must be an integer type.
  static absl::StatusOr<std::unique_ptr<IndexedDatasetWriter>> Create(
      const std::string& path_prefix, DType dtype);

  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  /// Appends one sequence to the current document. Fails (and writes nothing) when a
  /// token does not fit the dtype, naming the token and its position.
  absl::Status AddSequence(absl::Span<const int64_t> tokens);

  /// Closes the current document (Megatron's IndexedDatasetBuilder.end_document).
  void EndDocument();

  /// Convenience: AddSequence(tokens) then EndDocument().
  absl::Status AddDocument(absl::Span<const int64_t> tokens);

  /// Flushes `.bin`, writes `.idx` and renames both into place. Sequences added since the
  /// last EndDocument() form a last document. The writer accepts nothing afterwards.
  absl::Status Finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  IndexedDatasetWriter(std::string path_prefix, DType dtype, std::FILE* bin);
  absl::Status FlushBuffer();
  void RemoveTemporaryFiles();

  std::string path_prefix_;
  DType dtype_;
  std::FILE* bin_ = nullptr;  // Owned; null once closed.
  std::vector<uint8_t> buffer_;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  int64_t num_tokens_ = 0;
  bool finalized_ = false;
  absl::Status write_error_;  // Sticky: the first I/O error fails every later call.
};

}  // namespace fulcrum::data
