#include "core/data/gpt_dataset.h"

#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status.h"

namespace fulcrum::data {
namespace {

// splitmix64 (Steele, Lea & Flood, "Fast Splittable Pseudorandom Number Generators",
// OOPSLA 2014; constants from Vigna's reference code). Written out so that a seed means
// the same samples everywhere: <random>'s distributions are implementation-defined.
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() { return Mix64(state_ += kGolden); }

  // Uniform in [0, n), n > 0, without modulo bias: draws below 2^64 mod n are rejected so
  // the accepted range is a multiple of n.
  uint64_t Below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = Next();
      if (r >= threshold) return r % n;
    }
  }

 private:
  uint64_t state_;
};

// Independent generator streams per (seed, split, epoch, purpose).
enum class Stream : uint64_t { kDocuments = 1, kSamples = 2 };

uint64_t StreamSeed(uint64_t seed, Split split, int64_t epoch, Stream stream) {
  uint64_t h = Mix64(seed + kGolden);
  h = Mix64(h ^ (static_cast<uint64_t>(split) + 1) * kGolden);
  h = Mix64(h ^ static_cast<uint64_t>(epoch));
  return Mix64(h ^ static_cast<uint64_t>(stream));
}

// Fisher-Yates shuffle of [0, n) (Knuth, TAOCP vol. 2, Algorithm 3.4.2P).
std::vector<int64_t> Permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  SplitMix64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

// Python's round() for the split bookends: to nearest, ties to even. Spelled out rather than
// std::nearbyint so it does not depend on the floating-point rounding mode.
int64_t RoundHalfEven(double x) {
  const double floor = std::floor(x);
  const double diff = x - floor;
  int64_t result = static_cast<int64_t>(floor);
  if (diff > 0.5 || (diff == 0.5 && result % 2 != 0)) ++result;
  return result;
}

}  // namespace

const char* SplitName(Split split) {
  switch (split) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "unknown";
}

absl::StatusOr<std::array<DocumentRange, 3>> SplitDocumentRanges(const std::string& split,
                                                                 int64_t num_documents) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--split=\"", split, "\": ", why,
        "; expected 1 to 3 non-negative numbers separated by ',' or '/' (train,valid,test), "
        "e.g. 969,30,1"));
  };
  std::vector<double> weights;
  for (absl::string_view field : absl::StrSplit(split, absl::ByAnyChar(",/"))) {
    field = absl::StripAsciiWhitespace(field);
    double weight = 0;
    if (!absl::SimpleAtod(field, &weight) || !std::isfinite(weight)) {
      return bad(absl::StrCat("'", field, "' is not a number"));
    }
    if (weight < 0) return bad(absl::StrCat(field, " is negative"));
    weights.push_back(weight);
  }
  if (weights.size() > 3) return bad(absl::StrCat(weights.size(), " numbers"));
  weights.resize(3, 0.0);
  // Same arithmetic as Megatron's parse_and_normalize_split and
  // convert_split_vector_to_split_matrix: normalise, then accumulate the bookends.
  const double sum = (weights[0] + weights[1]) + weights[2];
  if (!(sum > 0)) return bad("the weights add up to 0");
  std::array<DocumentRange, 3> ranges;
  double bookend = 0;
  for (int i = 0; i < 3; ++i) {
    const double next = bookend + weights[i] / sum;
    ranges[i].begin = RoundHalfEven(bookend * static_cast<double>(num_documents));
    ranges[i].end = RoundHalfEven(next * static_cast<double>(num_documents));
    bookend = next;
  }
  // The normalised weights may add up to 1 - epsilon; the last document still belongs to
  // the last split (round() would give the same for any realistic document count).
  ranges[2].end = num_documents;
  return ranges;
}

// The order of one epoch: which document comes where in the token stream, and which window
// of the stream is visited at each step. See NOTE [Stateless data position].
struct GptDataset::EpochPlan {
  int64_t epoch = -1;
  std::vector<int64_t> documents;  // Sequence ids of the IndexedDataset, in stream order.
  std::vector<int64_t> starts;     // starts[i]: stream offset of documents[i]; back() = total.
  std::vector<int64_t> windows;    // windows[j]: the window visited at step j of the epoch.
};

absl::StatusOr<std::unique_ptr<GptDataset>> GptDataset::Create(
    std::shared_ptr<const IndexedDataset> dataset, Split split, const GptDatasetOptions& options) {
  if (dataset == nullptr) return absl::InvalidArgumentError("GptDataset: no dataset given");
  if (options.seq_length <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seq_length must be positive, got ", options.seq_length));
  }
  FULCRUM_ASSIGN_OR_RETURN(const auto ranges,
                           SplitDocumentRanges(options.split, dataset->num_sequences()));
  const DocumentRange documents = ranges[static_cast<int>(split)];
  if (documents.end <= documents.begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split '", SplitName(split), "' of ", dataset->path_prefix(), " is empty: --split=",
        options.split, " gives it none of the ", dataset->num_sequences(), " documents"));
  }
  std::vector<int64_t> index_starts;
  index_starts.reserve(documents.end - documents.begin + 1);
  int64_t num_tokens = 0;
  for (int64_t d = documents.begin; d < documents.end; ++d) {
    index_starts.push_back(num_tokens);
    num_tokens += dataset->sequence_length(d);
  }
  index_starts.push_back(num_tokens);
  if (num_tokens < options.seq_length + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split '", SplitName(split), "' of ", dataset->path_prefix(), " has ", num_tokens,
        " tokens, fewer than seq_length+1 = ", options.seq_length + 1,
        " (lower --seq_length or give the split more documents with --split=", options.split, ")"));
  }
  return std::unique_ptr<GptDataset>(
      new GptDataset(std::move(dataset), split, options, documents, std::move(index_starts)));
}

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> dataset, Split split,
                       GptDatasetOptions options, DocumentRange documents,
                       std::vector<int64_t> index_starts)
    : dataset_(std::move(dataset)),
      split_(split),
      options_(std::move(options)),
      documents_(documents),
      num_tokens_(index_starts.back()),
      // The last window needs one token past its seq_length inputs for the last label.
      samples_per_epoch_((num_tokens_ - 1) / options_.seq_length),
      index_starts_(std::move(index_starts)) {}

GptDataset::~GptDataset() = default;

std::shared_ptr<const GptDataset::EpochPlan> GptDataset::BuildPlan(int64_t epoch) const {
  auto plan = std::make_shared<EpochPlan>();
  plan->epoch = epoch;
  const int64_t num_documents = documents_.end - documents_.begin;
  plan->documents =
      Permutation(num_documents, StreamSeed(options_.seed, split_, epoch, Stream::kDocuments));
  plan->starts.resize(num_documents + 1);
  int64_t offset = 0;
  for (int64_t i = 0; i < num_documents; ++i) {
    plan->documents[i] += documents_.begin;
    plan->starts[i] = offset;
    offset += dataset_->sequence_length(plan->documents[i]);
  }
  plan->starts[num_documents] = offset;
  plan->windows =
      Permutation(samples_per_epoch_, StreamSeed(options_.seed, split_, epoch, Stream::kSamples));
  return plan;
}

std::shared_ptr<const GptDataset::EpochPlan> GptDataset::PlanFor(int64_t epoch) const {
  // Built under the lock: threads asking for the same new epoch wait for one build.
  std::lock_guard<std::mutex> lock(plan_mutex_);
  if (plan_ == nullptr || plan_->epoch != epoch) plan_ = BuildPlan(epoch);
  return plan_;
}

void GptDataset::GetSample(int64_t k, int64_t* out, int64_t* positions) const {
  TORCH_CHECK(k >= 0, "GptDataset::GetSample: sample index ", k, " is negative");
  TORCH_CHECK(out != nullptr || positions != nullptr, "GptDataset::GetSample: nothing to write");
  const std::shared_ptr<const EpochPlan> plan = PlanFor(k / samples_per_epoch_);
  const int64_t begin = plan->windows[k % samples_per_epoch_] * options_.seq_length;

  // The document holding `begin`: the last one starting at or before it (empty documents
  // share their start with the next one and are passed over by upper_bound).
  auto it = std::upper_bound(plan->starts.begin(), plan->starts.end(), begin);
  int64_t i = static_cast<int64_t>(it - plan->starts.begin()) - 1;
  int64_t offset = begin - plan->starts[i];
  int64_t remaining = options_.seq_length + 1;
  while (remaining > 0) {
    TORCH_INTERNAL_ASSERT(i < static_cast<int64_t>(plan->documents.size()),
                          "sample window runs past the end of the epoch's token stream");
    const int64_t length = plan->starts[i + 1] - plan->starts[i];
    const int64_t take = std::min(length - offset, remaining);
    if (out != nullptr) {
      dataset_->Read(plan->documents[i], offset, take, out);
      out += take;
    }
    if (positions != nullptr) {
      const int64_t first = index_starts_[plan->documents[i] - documents_.begin] + offset;
      for (int64_t j = 0; j < take; ++j) *positions++ = first + j;
    }
    remaining -= take;
    offset = 0;
    ++i;
  }
}

}  // namespace fulcrum::data
