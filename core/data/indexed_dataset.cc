#include "core/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

// The format is little-endian and we read it with plain loads.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "indexed_dataset.cc assumes a little-endian host (the .idx/.bin format is LE)");

namespace fulcrum::data {
namespace {

constexpr char kMagic[] = "MMIDIDX\x00\x00";  // 9 bytes; the literal adds a 10th NUL.
constexpr int64_t kMagicSize = 9;
constexpr uint64_t kVersion = 1;
// magic + u64 version + u8 dtype + u64 sequence_count + u64 document_count.
constexpr int64_t kHeaderSize = kMagicSize + 8 + 1 + 8 + 8;
static_assert(kHeaderSize == 34, "Megatron's _IndexReader documents a 34-byte header");

// Writes flush to the .bin file in chunks of this size.
constexpr size_t kWriteBufferBytes = size_t{4} << 20;

std::string IdxPath(const std::string& prefix) { return prefix + ".idx"; }
std::string BinPath(const std::string& prefix) { return prefix + ".bin"; }
// Temporary names used until IndexedDatasetWriter::Finalize renames them into place.
std::string PartialPath(const std::string& path) { return path + ".partial"; }

bool IsKnownDTypeCode(uint8_t code) { return code >= 1 && code <= 8; }

bool IsIntegerDType(DType dtype) { return dtype != DType::kFloat32 && dtype != DType::kFloat64; }

// Loads a T from possibly unaligned memory.
template <typename T>
T LoadUnaligned(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

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

int64_t DTypeSize(DType dtype) {
  int64_t size = 0;
  VisitDType(dtype, [&](auto t) { size = sizeof(t); });
  return size;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kUInt16: return "uint16";
  }
  return "unknown";
}

DType BestTokenDType(int64_t vocab_size) {
  return vocab_size < 65500 ? DType::kUInt16 : DType::kInt32;
}

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

namespace {

// Checks the index arrays against each other; `where` names the file in messages. Shared by
// Open (file contents) and FromMemory (arrays from code).
absl::Status ValidateIndex(const std::string& where, DType dtype,
                           const std::vector<int32_t>& lengths,
                           const std::vector<int64_t>& pointers,
                           const std::vector<int64_t>& document_indices) {
  const int64_t itemsize = DTypeSize(dtype);
  const int64_t num_sequences = static_cast<int64_t>(lengths.size());
  int64_t expected_pointer = 0;
  for (int64_t i = 0; i < num_sequences; ++i) {
    if (lengths[i] < 0) {
      return absl::DataLossError(absl::StrCat(where, ": sequence_lengths[", i, "] is ", lengths[i],
                                              ", expected a length >= 0"));
    }
    if (!pointers.empty() && pointers[i] != expected_pointer) {
      return absl::DataLossError(absl::StrCat(
          where, ": sequence_pointers[", i, "] is ", pointers[i], ", expected ", expected_pointer,
          i == 0 ? " (the first sequence starts at byte 0)"
                 : absl::StrCat(" (= sequence_pointers[", i - 1, "] + sequence_lengths[", i - 1,
                                "] * ", itemsize, " bytes per ", DTypeName(dtype), ")")));
    }
    expected_pointer += int64_t{lengths[i]} * itemsize;
  }
  if (document_indices.empty()) {
    return absl::DataLossError(
        absl::StrCat(where, ": document_indices is empty, expected at least the leading 0"));
  }
  if (document_indices.front() != 0) {
    return absl::DataLossError(
        absl::StrCat(where, ": document_indices[0] is ", document_indices.front(), ", expected 0"));
  }
  for (size_t d = 1; d < document_indices.size(); ++d) {
    if (document_indices[d] < document_indices[d - 1] || document_indices[d] > num_sequences) {
      return absl::DataLossError(
          absl::StrCat(where, ": document_indices[", d, "] is ", document_indices[d],
                       ", expected a value in [", document_indices[d - 1], ", ", num_sequences,
                       "] (document indices are non-decreasing sequence counts)"));
    }
  }
  if (document_indices.back() != num_sequences) {
    return absl::DataLossError(absl::StrCat(
        where, ": the last document index is ", document_indices.back(), ", expected ",
        num_sequences, " (the sequence count), so every sequence belongs to a document"));
  }
  return absl::OkStatus();
}

}  // namespace

IndexedDataset::~IndexedDataset() = default;

absl::StatusOr<std::shared_ptr<IndexedDataset>> IndexedDataset::Open(
    const std::string& path_prefix) {
  const std::string idx_path = IdxPath(path_prefix);
  const std::string bin_path = BinPath(path_prefix);
  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> idx, MappedFile::Open(idx_path));

  // Header.
  const uint8_t* p = idx->data();
  const int64_t idx_size = idx->size();
  if (idx_size < kHeaderSize) {
    return absl::DataLossError(absl::StrCat(idx_path, ": truncated: ", idx_size,
                                            " bytes, shorter than the ", kHeaderSize,
                                            "-byte header of a Megatron indexed dataset"));
  }
  if (std::memcmp(p, kMagic, kMagicSize) != 0) {
    return absl::DataLossError(absl::StrCat(
        idx_path, ": bad magic: expected \"", absl::CHexEscape(std::string(kMagic, kMagicSize)),
        "\" (Megatron MMIDIDX index), found \"",
        absl::CHexEscape(std::string(reinterpret_cast<const char*>(p), kMagicSize)), "\""));
  }
  const uint64_t version = LoadUnaligned<uint64_t>(p + 9);
  if (version != kVersion) {
    return absl::DataLossError(
        absl::StrCat(idx_path, ": unsupported version ", version, ", expected ", kVersion));
  }
  const uint8_t dtype_code = p[17];
  if (!IsKnownDTypeCode(dtype_code)) {
    return absl::DataLossError(absl::StrCat(idx_path, ": unknown dtype code ", dtype_code,
                                            ", expected 1..8 (Megatron's DType enum)"));
  }
  const uint64_t sequence_count = LoadUnaligned<uint64_t>(p + 18);
  const uint64_t document_count = LoadUnaligned<uint64_t>(p + 26);

  // Array sizes. Bound the counts first so the byte arithmetic cannot overflow.
  const uint64_t room = static_cast<uint64_t>(idx_size - kHeaderSize);
  const uint64_t expected_bytes = sequence_count <= room / 12 && document_count <= room / 8
                                      ? sequence_count * 12 + document_count * 8
                                      : std::numeric_limits<uint64_t>::max();
  if (expected_bytes > room) {
    return absl::DataLossError(absl::StrCat(
        idx_path, ": truncated: header says ", sequence_count, " sequences and ", document_count,
        " document indices, which need ", kHeaderSize, " + 12 * ", sequence_count, " + 8 * ",
        document_count, " bytes; file has ", idx_size, " bytes (room for ",
        room >= document_count * 8 ? (room - document_count * 8) / 12 : 0, " sequences)"));
  }
  if (expected_bytes < room) {
    const uint64_t extra = room - expected_bytes;
    return absl::DataLossError(absl::StrCat(
        idx_path, ": ", extra, " unexpected bytes after the document indices (header says ",
        sequence_count, " sequences and ", document_count, " document indices)",
        extra == sequence_count ? "; this looks like a multimodal dataset (per-sequence modes), "
                                  "which is not supported"
                                : ""));
  }

  auto dataset = std::shared_ptr<IndexedDataset>(new IndexedDataset);
  dataset->path_prefix_ = path_prefix;
  dataset->dtype_ = static_cast<DType>(dtype_code);
  dataset->itemsize_ = DTypeSize(dataset->dtype_);
  const uint8_t* arrays = p + kHeaderSize;
  dataset->sequence_lengths_.resize(sequence_count);
  dataset->sequence_pointers_.resize(sequence_count);
  dataset->document_indices_.resize(document_count);
  std::memcpy(dataset->sequence_lengths_.data(), arrays, sequence_count * 4);
  std::memcpy(dataset->sequence_pointers_.data(), arrays + sequence_count * 4, sequence_count * 8);
  std::memcpy(dataset->document_indices_.data(), arrays + sequence_count * 12, document_count * 8);
  idx.reset();
  FULCRUM_RETURN_IF_ERROR(ValidateIndex(idx_path, dataset->dtype_, dataset->sequence_lengths_,
                                        dataset->sequence_pointers_, dataset->document_indices_));
  for (int32_t length : dataset->sequence_lengths_) dataset->num_tokens_ += length;

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
      ValidateIndex(dataset->path_prefix_, dataset->dtype_, dataset->sequence_lengths_,
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
  if (!IsKnownDTypeCode(static_cast<uint8_t>(dtype))) {
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
  const uint64_t sequence_count = sequence_lengths_.size();
  const uint64_t document_count = document_indices_.size();
  std::string idx;
  idx.reserve(kHeaderSize + sequence_count * 12 + document_count * 8);
  auto append = [&idx](const void* data, size_t size) {
    idx.append(static_cast<const char*>(data), size);
  };
  append(kMagic, kMagicSize);
  append(&kVersion, 8);
  const uint8_t code = static_cast<uint8_t>(dtype_);
  append(&code, 1);
  append(&sequence_count, 8);
  append(&document_count, 8);
  append(sequence_lengths_.data(), sequence_count * 4);
  const int64_t itemsize = DTypeSize(dtype_);
  int64_t pointer = 0;
  for (int32_t length : sequence_lengths_) {
    append(&pointer, 8);
    pointer += int64_t{length} * itemsize;
  }
  append(document_indices_.data(), document_count * 8);

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
