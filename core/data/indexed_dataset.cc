#include "core/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/data/internal/unaligned.h"
#include "core/status.h"

// The format is little-endian and we read it with plain loads.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "indexed_dataset.cc assumes a little-endian host (the .idx/.bin format is LE)");

namespace fulcrum::data {
namespace {

// Writes flush to the .bin file in chunks of this size.
constexpr size_t kWriteBufferBytes = size_t{4} << 20;

std::string IdxPath(const std::string& prefix) { return prefix + ".idx"; }
std::string BinPath(const std::string& prefix) { return prefix + ".bin"; }
// Temporary names used until IndexedDatasetWriter::Finalize renames them into place.
std::string PartialPath(const std::string& path) { return path + ".partial"; }

bool IsIntegerDType(DType dtype) { return dtype != DType::kFloat32 && dtype != DType::kFloat64; }

using internal::LoadUnaligned;

template <typename T>
void ConvertTokens(const uint8_t* src, int64_t count, int64_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    out[i] = static_cast<int64_t>(LoadUnaligned<T>(src + i * sizeof(T)));
  }
}

// Calls `f(T{})` with T the C++ type of `dtype`.
template <typename F>
void VisitDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kUInt8: return f(uint8_t{});
    case DType::kInt8: return f(int8_t{});
    case DType::kInt16: return f(int16_t{});
    case DType::kInt32: return f(int32_t{});
    case DType::kInt64: return f(int64_t{});
    case DType::kFloat64: return f(double{});
    case DType::kFloat32: return f(float{});
    case DType::kUInt16: return f(uint16_t{});
  }
  TORCH_INTERNAL_ASSERT(false, "unknown DType ", static_cast<int>(dtype));
}

// The inclusive range of token values `dtype` can store (integer dtypes only).
std::pair<int64_t, int64_t> TokenRange(DType dtype) {
  std::pair<int64_t, int64_t> range;
  VisitDType(dtype, [&](auto t) {
    using T = decltype(t);
    range = {static_cast<int64_t>(std::numeric_limits<T>::lowest()),
             static_cast<int64_t>(std::numeric_limits<T>::max())};
  });
  return range;
}

std::string ErrnoMessage(int error) { return std::strerror(error); }

}  // namespace

// ---------------------------------------------------------------------------------------
// MappedFile: a read-only mmap of a whole file.

class IndexedDataset::MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      const std::string message = absl::StrCat("cannot open ", path, ": ", ErrnoMessage(error));
      return error == ENOENT ? absl::NotFoundError(message) : absl::PermissionDeniedError(message);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int error = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", ErrnoMessage(error)));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
    }
    auto file = std::unique_ptr<MappedFile>(new MappedFile);
    file->size_ = static_cast<int64_t>(st.st_size);
    // mmap refuses empty mappings; an empty file simply has no bytes.
    if (file->size_ > 0) {
      void* data = ::mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
      if (data == MAP_FAILED) {
        const int error = errno;
        ::close(fd);
        return absl::InternalError(absl::StrCat("cannot mmap ", path, ": ", ErrnoMessage(error)));
      }
      file->data_ = static_cast<const uint8_t*>(data);
    }
    ::close(fd);  // The mapping stays valid without the descriptor.
    return file;
  }

  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }

  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

// ---------------------------------------------------------------------------------------
// IndexedDataset

IndexedDataset::~IndexedDataset() = default;

absl::StatusOr<std::shared_ptr<IndexedDataset>> IndexedDataset::Open(
    const std::string& path_prefix) {
  const std::string idx_path = IdxPath(path_prefix);
  const std::string bin_path = BinPath(path_prefix);
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> idx, MappedFile::Open(idx_path));

  FULCRUM_ASSIGN_OR_RETURN(
      MegatronIndex index,
      ParseMegatronIndex(idx_path, std::string_view(reinterpret_cast<const char*>(idx->data()),
                                                    static_cast<size_t>(idx->size()))));
  idx.reset();
  auto dataset = std::shared_ptr<IndexedDataset>(new IndexedDataset);
  dataset->path_prefix_ = path_prefix;
  dataset->dtype_ = index.dtype;
  dataset->itemsize_ = DTypeSize(index.dtype);
  dataset->num_tokens_ = index.num_tokens;
  dataset->sequence_lengths_ = std::move(index.sequence_lengths);
  dataset->sequence_pointers_ = std::move(index.sequence_pointers);
  dataset->document_indices_ = std::move(index.document_indices);
  const uint64_t sequence_count = dataset->sequence_lengths_.size();

  FULCRUM_ASSIGN_OR_RETURN(dataset->bin_, MappedFile::Open(bin_path));
  const int64_t expected_bin_bytes = dataset->num_tokens_ * dataset->itemsize_;
  if (dataset->bin_->size() != expected_bin_bytes) {
    return absl::DataLossError(absl::StrCat(
        bin_path, ": size ", dataset->bin_->size(), " bytes, index expects ", expected_bin_bytes,
        " (", dataset->num_tokens_, " tokens of ", DTypeName(dataset->dtype_), " in ",
        sequence_count, " sequences, from ", idx_path, ")"));
  }
  dataset->token_bytes_ = dataset->bin_->data();
  return dataset;
}

std::shared_ptr<IndexedDataset> IndexedDataset::FromMemory(std::string name,
                                                           std::vector<int64_t> tokens,
                                                           std::vector<int32_t> sequence_lengths,
                                                           std::vector<int64_t> document_indices) {
  auto dataset = std::shared_ptr<IndexedDataset>(new IndexedDataset);
  dataset->path_prefix_ = std::move(name);
  dataset->dtype_ = DType::kInt64;
  dataset->itemsize_ = 8;
  dataset->sequence_lengths_ = std::move(sequence_lengths);
  dataset->document_indices_ = std::move(document_indices);
  dataset->sequence_pointers_.reserve(dataset->sequence_lengths_.size());
  int64_t pointer = 0;
  for (int32_t length : dataset->sequence_lengths_) {
    dataset->sequence_pointers_.push_back(pointer);
    pointer += int64_t{length} * dataset->itemsize_;
  }
  const absl::Status status =
      ValidateMegatronIndex(dataset->path_prefix_, dataset->dtype_, dataset->sequence_lengths_,
                            dataset->sequence_pointers_, dataset->document_indices_);
  TORCH_CHECK(status.ok(), "IndexedDataset::FromMemory: ", status.message());
  dataset->num_tokens_ = pointer / dataset->itemsize_;
  TORCH_CHECK(dataset->num_tokens_ == static_cast<int64_t>(tokens.size()),
              "IndexedDataset::FromMemory(", dataset->path_prefix_,
              "): sequence lengths add up to ", dataset->num_tokens_, " tokens, but ",
              tokens.size(), " tokens were given");
  dataset->owned_tokens_ = std::move(tokens);
  dataset->token_bytes_ = reinterpret_cast<const uint8_t*>(dataset->owned_tokens_.data());
  return dataset;
}

int64_t IndexedDataset::sequence_length(int64_t sequence) const {
  TORCH_CHECK(sequence >= 0 && sequence < num_sequences(), "sequence ", sequence,
              " out of range [0, ", num_sequences(), ") in ", path_prefix_);
  return sequence_lengths_[sequence];
}

void IndexedDataset::Read(int64_t sequence, int64_t offset, int64_t count, int64_t* out) const {
  const int64_t length = sequence_length(sequence);
  TORCH_CHECK(offset >= 0 && count >= 0 && offset + count <= length, "Read(sequence=", sequence,
              ", offset=", offset, ", count=", count, ") outside the sequence's ", length,
              " tokens in ", path_prefix_);
  const uint8_t* src = token_bytes_ + sequence_pointers_[sequence] + offset * itemsize_;
  VisitDType(dtype_, [&](auto t) { ConvertTokens<decltype(t)>(src, count, out); });
}

int64_t IndexedDataset::MaxToken() const {
  int64_t max_token = -1;
  constexpr int64_t kChunk = 1 << 16;
  std::vector<int64_t> chunk(kChunk);
  for (int64_t begin = 0; begin < num_tokens_; begin += kChunk) {
    const int64_t count = std::min(kChunk, num_tokens_ - begin);
    const uint8_t* src = token_bytes_ + begin * itemsize_;
    VisitDType(dtype_, [&](auto t) { ConvertTokens<decltype(t)>(src, count, chunk.data()); });
    for (int64_t i = 0; i < count; ++i) max_token = std::max(max_token, chunk[i]);
  }
  return max_token;
}

// ---------------------------------------------------------------------------------------
// IndexedDatasetWriter

absl::StatusOr<std::unique_ptr<IndexedDatasetWriter>> IndexedDatasetWriter::Create(
    const std::string& path_prefix, DType dtype) {
  if (!IsDTypeCode(static_cast<uint8_t>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("IndexedDatasetWriter for ", path_prefix,
                                                   ": unknown dtype code ",
                                                   static_cast<int>(dtype)));
  }
  if (!IsIntegerDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("IndexedDatasetWriter for ", path_prefix, ": dtype ", DTypeName(dtype),
                     " cannot hold token ids; use an integer dtype (see BestTokenDType)"));
  }
  const std::string bin_path = PartialPath(BinPath(path_prefix));
  std::FILE* bin = std::fopen(bin_path.c_str(), "wb");
  if (bin == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", bin_path, ": ", ErrnoMessage(errno)));
  }
  return std::unique_ptr<IndexedDatasetWriter>(new IndexedDatasetWriter(path_prefix, dtype, bin));
}

IndexedDatasetWriter::IndexedDatasetWriter(std::string path_prefix, DType dtype, std::FILE* bin)
    : path_prefix_(std::move(path_prefix)), dtype_(dtype), bin_(bin) {
  buffer_.reserve(kWriteBufferBytes);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (!finalized_) RemoveTemporaryFiles();
}

void IndexedDatasetWriter::RemoveTemporaryFiles() {
  if (bin_ != nullptr) {
    std::fclose(bin_);
    bin_ = nullptr;
  }
  std::remove(PartialPath(BinPath(path_prefix_)).c_str());
  std::remove(PartialPath(IdxPath(path_prefix_)).c_str());
}

absl::Status IndexedDatasetWriter::FlushBuffer() {
  if (!write_error_.ok()) return write_error_;
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) != buffer_.size()) {
    write_error_ = absl::DataLossError(absl::StrCat("writing ", PartialPath(BinPath(path_prefix_)),
                                                    " failed: ", ErrnoMessage(errno)));
  }
  buffer_.clear();
  return write_error_;
}

absl::Status IndexedDatasetWriter::AddSequence(absl::Span<const int64_t> tokens) {
  if (finalized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("IndexedDatasetWriter for ", path_prefix_, ": AddSequence after Finalize"));
  }
  if (!write_error_.ok()) return write_error_;
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_prefix_, ": a sequence of ", tokens.size(),
                     " tokens does not fit the format's int32 sequence length"));
  }
  const auto [lowest, highest] = TokenRange(dtype_);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < lowest || tokens[i] > highest) {
      return absl::OutOfRangeError(absl::StrCat(
          path_prefix_, ": token ", tokens[i], " at position ", i, " of sequence ", num_sequences(),
          " does not fit dtype ", DTypeName(dtype_), " [", lowest, ", ", highest, "]"));
    }
  }
  const size_t itemsize = static_cast<size_t>(DTypeSize(dtype_));
  VisitDType(dtype_, [&](auto t) {
    using T = decltype(t);
    for (int64_t token : tokens) {
      if (buffer_.size() + itemsize > kWriteBufferBytes) FlushBuffer().IgnoreError();
      const T value = static_cast<T>(token);
      const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
      buffer_.insert(buffer_.end(), bytes, bytes + sizeof(T));
    }
  });
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
  return write_error_;
}

void IndexedDatasetWriter::EndDocument() { document_indices_.push_back(num_sequences()); }

absl::Status IndexedDatasetWriter::AddDocument(absl::Span<const int64_t> tokens) {
  FULCRUM_RETURN_IF_ERROR(AddSequence(tokens));
  EndDocument();
  return absl::OkStatus();
}

absl::Status IndexedDatasetWriter::Finalize() {
  if (finalized_) {
    return absl::FailedPreconditionError(
        absl::StrCat("IndexedDatasetWriter for ", path_prefix_, ": Finalize called twice"));
  }
  if (document_indices_.back() != num_sequences()) EndDocument();
  FULCRUM_RETURN_IF_ERROR(FlushBuffer());
  const std::string bin_partial = PartialPath(BinPath(path_prefix_));
  const std::string idx_partial = PartialPath(IdxPath(path_prefix_));
  const int close_result = std::fclose(bin_);
  bin_ = nullptr;
  if (close_result != 0) {
    return absl::DataLossError(
        absl::StrCat("closing ", bin_partial, " failed: ", ErrnoMessage(errno)));
  }

  // The index, laid out per NOTE [Megatron .idx layout].
  MegatronIndex index;
  index.dtype = dtype_;
  index.sequence_lengths = sequence_lengths_;
  index.document_indices = document_indices_;
  const std::string idx = EncodeMegatronIndex(index);

  std::FILE* idx_file = std::fopen(idx_partial.c_str(), "wb");
  if (idx_file == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", idx_partial, ": ", ErrnoMessage(errno)));
  }
  const bool written = std::fwrite(idx.data(), 1, idx.size(), idx_file) == idx.size();
  const int saved_errno = errno;
  if (std::fclose(idx_file) != 0 || !written) {
    return absl::DataLossError(
        absl::StrCat("writing ", idx_partial, " failed: ", ErrnoMessage(saved_errno)));
  }
  // .bin first: a reader looks for the .idx, so it appears only once both are complete.
  for (const auto& [from, to] : {std::pair{bin_partial, BinPath(path_prefix_)},
                                 std::pair{idx_partial, IdxPath(path_prefix_)}}) {
    if (std::rename(from.c_str(), to.c_str()) != 0) {
      return absl::DataLossError(
          absl::StrCat("renaming ", from, " to ", to, " failed: ", ErrnoMessage(errno)));
    }
  }
  finalized_ = true;
  return absl::OkStatus();
}

}  // namespace fulcrum::data
