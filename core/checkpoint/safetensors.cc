#include "core/checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "core/checkpoint/checksum.h"
#include "core/status.h"

namespace fulcrum::ckpt {
namespace {

// Tensor bytes are copied to and from memory as they are, and the format is
// little-endian. A big-endian port would byte-swap here.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors I/O assumes a little-endian host");

constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeName {
  at::ScalarType dtype;
  std::string_view name;
};
constexpr DtypeName kDtypeNames[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},    {at::kBool, "BOOL"},
};

std::string EncodeLittleEndian64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

// The CPU, contiguous version of `tensor` whose bytes go into the file.
absl::StatusOr<at::Tensor> PrepareForWrite(const std::string& path, const std::string& name,
                                           const at::Tensor& tensor) {
  if (!tensor.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": tensor '", name, "' is undefined"));
  }
  if (tensor.layout() != at::kStrided) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": tensor '", name, "' is not dense (layout ",
                     c10::str(tensor.layout()), "); safetensors stores dense tensors only"));
  }
  at::Tensor cpu = tensor.detach();
  if (!cpu.device().is_cpu()) cpu = cpu.to(at::kCPU);
  return cpu.contiguous();
}

}  // namespace

absl::StatusOr<std::string> SafetensorsDtypeName(at::ScalarType dtype) {
  for (const DtypeName& entry : kDtypeNames) {
    if (entry.dtype == dtype) return std::string(entry.name);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype ", c10::toString(dtype),
      " has no safetensors name here; supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
}

absl::StatusOr<at::ScalarType> ScalarTypeFromSafetensorsDtype(std::string_view name) {
  for (const DtypeName& entry : kDtypeNames) {
    if (entry.name == name) return entry.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", std::string(name),
                   "'; expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL"));
}

int64_t SafetensorsTensorInfo::numel() const {
  int64_t numel = 1;
  for (const int64_t extent : shape) numel *= extent;
  return numel;
}

absl::Status WriteSafetensors(FileSystem* fs, const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              std::map<std::string, uint64_t>* checksums) {
  // Validate everything before creating the file, so a caller error leaves nothing behind.
  std::map<std::string_view, size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].first;
    if (name.empty() || name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", path, ": tensor name '", name, "' is reserved or empty"));
    }
    if (!seen.emplace(name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", path, ": tensor name '", name, "' appears twice"));
    }
    if (!tensors[i].second.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", path, ": tensor '", name, "' is undefined"));
    }
    absl::StatusOr<std::string> dtype = SafetensorsDtypeName(tensors[i].second.scalar_type());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", path, ": tensor '", name, "': ", dtype.status().message()));
    }
  }

  // Descending element size, then name (as the reference writer does): with the data
  // buffer starting at a multiple of 8, every tensor then starts at a multiple of its own
  // element size, so readers can map tensors in place.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t size_a = tensors[a].second.element_size();
    const size_t size_b = tensors[b].second.element_size();
    if (size_a != size_b) return size_a > size_b;
    return tensors[a].first < tensors[b].first;
  });

  // ordered_json keeps "__metadata__" first and entries in data order, like the reference.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const size_t i : order) {
    const at::Tensor& tensor = tensors[i].second;
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    nlohmann::ordered_json entry;
    entry["dtype"] = *SafetensorsDtypeName(tensor.scalar_type());
    entry["shape"] = tensor.sizes().vec();
    entry["data_offsets"] = {offset, offset + bytes};
    header[tensors[i].first] = std::move(entry);
    offset += bytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // Names that are not valid UTF-8.
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": header is not valid UTF-8 JSON: ", e.what()));
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  FULCRUM_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs->NewWritableFile(path));
  FULCRUM_RETURN_IF_ERROR(file->Append(EncodeLittleEndian64(header_text.size())));
  FULCRUM_RETURN_IF_ERROR(file->Append(header_text));
  for (const size_t i : order) {
    const std::string& name = tensors[i].first;
    FULCRUM_ASSIGN_OR_RETURN(const at::Tensor cpu, PrepareForWrite(path, name, tensors[i].second));
    const std::string_view bytes(static_cast<const char*>(cpu.data_ptr()),
                                 static_cast<size_t>(cpu.numel()) * cpu.element_size());
    if (checksums != nullptr) (*checksums)[name] = Xxh3Checksum(bytes);
    FULCRUM_RETURN_IF_ERROR(file->Append(bytes));
  }
  FULCRUM_RETURN_IF_ERROR(file->Sync());
  return file->Close();
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    const std::string& path) {
  return Open(DefaultFileSystem(), path);
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(
    FileSystem* fs, const std::string& path) {
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader());
  reader->path_ = path;
  FULCRUM_ASSIGN_OR_RETURN(reader->region_, fs->NewReadOnlyMemoryRegion(path));
  FULCRUM_ASSIGN_OR_RETURN(SafetensorsHeader header,
                           ParseSafetensorsHeader(path, reader->region_->bytes()));
  reader->data_start_ = header.data_start;
  reader->metadata_ = std::move(header.metadata);
  for (SafetensorsHeaderEntry& entry : header.entries) {
    SafetensorsTensorInfo info;
    info.name = std::move(entry.name);
    // The header parser accepted the name, and the two dtype tables agree (a test checks).
    info.dtype = *ScalarTypeFromSafetensorsDtype(entry.dtype);
    info.shape = std::move(entry.shape);
    info.begin = entry.begin;
    info.end = entry.end;
    reader->names_.push_back(info.name);
    reader->index_.emplace(info.name, reader->infos_.size());
    reader->infos_.push_back(std::move(info));
  }
  return reader;
}

const SafetensorsTensorInfo* SafetensorsReader::info(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &infos_[it->second];
}

absl::StatusOr<std::string_view> SafetensorsReader::RawBytes(std::string_view name) const {
  const SafetensorsTensorInfo* entry = info(name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, " has no tensor '", std::string(name), "'"));
  }
  return region_->bytes().substr(data_start_ + entry->begin, entry->byte_size());
}

absl::StatusOr<at::Tensor> SafetensorsReader::Read(std::string_view name) const {
  FULCRUM_ASSIGN_OR_RETURN(const std::string_view bytes, RawBytes(name));
  const SafetensorsTensorInfo& entry = *info(name);
  // A fresh tensor rather than a view of the mapping: loaded state must outlive the reader
  // and be writable, and the copy is needed anyway to move it into parameters.
  at::Tensor tensor = at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype));
  if (!bytes.empty()) std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

}  // namespace fulcrum::ckpt
