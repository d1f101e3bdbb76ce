// GPT training samples from an IndexedDataset: train/valid/test splits, per-epoch document
// shuffling, and fixed-length windows of seq_length + 1 tokens (inputs and next-token labels).
//
// NOTE [Stateless data position]
// A sample is named by one integer, its global index k (0, 1, 2, ... over the whole run):
//
//   epoch  = k / samples_per_epoch        j = k % samples_per_epoch
//   window = sample_permutation(epoch)[j]
//   tokens = stream(epoch)[window * seq_length, window * seq_length + seq_length + 1)
//
// where stream(epoch) is the split's documents concatenated in document_permutation(epoch)
// order, and both permutations are Fisher-Yates shuffles driven by a seeded splitmix64
// generator keyed on (seed, split, epoch). Nothing else is state: a trainer that has
// consumed `consumed_samples` samples continues at k = consumed_samples, so the checkpoint
// records that one number and a resumed run (under any parallel layout) sees exactly the
// samples an uninterrupted run would have seen. The generator and shuffle are implemented
// here, not taken from <random>, whose distributions differ between standard libraries:
// the same seed gives the same samples on every machine.
//
// Windows overlap by one token (the label of the last input of window w is the first input
// of window w + 1) and cross document boundaries, as in Megatron's GPTDataset; every token
// of an epoch's stream except a tail shorter than seq_length is used once per epoch.
//
// A token's identity across epochs is its position in the split's documents taken in
// index order, unshuffled: position(d, o) = (tokens of the split's documents before d) + o
// for offset o of document d, in [0, num_tokens()). Window boundaries move between epochs,
// but this number names the same token of the corpus in every epoch (DynaMoE's cached
// expert assignments are keyed by it, moe/assignment_cache.h). GetSample writes it on request.
//
// Splits follow Megatron: the split string "a,b,c" is normalised to fractions, and the
// documents (Megatron's GPT dataset counts sequences, see NOTE [Megatron .idx layout]) are
// cut into contiguous ranges [round(f0 * n), round(f1 * n)) with f the cumulative fractions
// and round() half-to-even, as in BlendedMegatronDatasetBuilder.
//
// Thread-safety: GetSample() may be called concurrently from several threads. It keeps the
// plan of the most recently used epoch (document order, token offsets, sample order:
// O(documents + samples_per_epoch) memory); calls with k increasing are cheap and a call in
// another epoch rebuilds the plan (O(documents + samples_per_epoch) time).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/data/indexed_dataset.h"

namespace fulcrum::data {

/// Which part of the corpus a GptDataset draws from.
enum class Split { kTrain = 0, kValid = 1, kTest = 2 };

/// "train", "valid" or "test".
const char* SplitName(Split split);

/// How GPT samples are cut from a corpus.
struct GptDatasetOptions {
  /// Tokens of model input per sample; a sample holds seq_length + 1 tokens. Must be > 0.
  int64_t seq_length = 0;
  /// Seeds the document and sample shuffles. Default: 1234 (Megatron's --seed default).
  uint64_t seed = 1234;
  /// Relative sizes of train, valid, test, separated by ',' or '/': "969,30,1". Missing
  /// trailing entries are 0. Default: "969,30,1" (Megatron's default).
  std::string split = "969,30,1";
};

/// A contiguous range [begin, end) of document (sequence) indices.
struct DocumentRange {
  int64_t begin = 0;
  int64_t end = 0;
};

/// Cuts `num_documents` documents into the train, valid and test ranges described by
/// `split` (see NOTE [Stateless data position]). The three ranges partition [0, n).
/// Errors name `--split`.
absl::StatusOr<std::array<DocumentRange, 3>> SplitDocumentRanges(const std::string& split,
                                                                 int64_t num_documents);

/// The samples of one split of a corpus, addressed by global sample index.
class GptDataset {
 public:
  /// Validates the options and the split (non-empty, at least seq_length + 1 tokens).
  /// Errors name the flag (`--seq_length`, `--split`) or the dataset path.
  static absl::StatusOr<std::unique_ptr<GptDataset>> Create(
      std::shared_ptr<const IndexedDataset> dataset, Split split, const GptDatasetOptions& options);

  ~GptDataset();

  /// Writes the seq_length + 1 tokens of global sample `k` (k >= 0; any k, epochs repeat
  /// the data in a new order) to `out`. Deterministic: see NOTE [Stateless data position].
  /// When `positions` is not null, also writes each token's position in the split (the
  /// identity that survives reshuffling, see above) to positions[0 .. seq_length]; `out`
  /// may then be null to read positions only.
  void GetSample(int64_t k, int64_t* out, int64_t* positions = nullptr) const;

  /// The epoch global sample `k` belongs to.
  int64_t EpochOf(int64_t k) const { return k / samples_per_epoch_; }

  /// Windows per epoch: (num_tokens() - 1) / seq_length.
  int64_t samples_per_epoch() const { return samples_per_epoch_; }
  /// Tokens in this split's documents.
  int64_t num_tokens() const { return num_tokens_; }
  int64_t seq_length() const { return options_.seq_length; }
  Split split() const { return split_; }
  /// The documents (sequence indices of the IndexedDataset) this split draws from.
  DocumentRange documents() const { return documents_; }
  const IndexedDataset& dataset() const { return *dataset_; }

 private:
  struct EpochPlan;
  GptDataset(std::shared_ptr<const IndexedDataset> dataset, Split split, GptDatasetOptions options,
             DocumentRange documents, std::vector<int64_t> index_starts);
  std::shared_ptr<const EpochPlan> PlanFor(int64_t epoch) const;
  std::shared_ptr<const EpochPlan> BuildPlan(int64_t epoch) const;

  std::shared_ptr<const IndexedDataset> dataset_;
  Split split_;
  GptDatasetOptions options_;
  DocumentRange documents_;
  int64_t num_tokens_ = 0;
  int64_t samples_per_epoch_ = 0;
  // index_starts_[d - documents_.begin]: position of document d's first token in the
  // split's documents in index order; back() = num_tokens_.
  std::vector<int64_t> index_starts_;

  mutable std::mutex plan_mutex_;
  mutable std::shared_ptr<const EpochPlan> plan_;  // Guarded by plan_mutex_.
};

}  // namespace fulcrum::data
