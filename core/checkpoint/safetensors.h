// Reading and writing the safetensors format (Hugging Face), the tensor container of
// Fulcrum checkpoints: loadable from Python with `safetensors.torch.load_file` and no
// pickle.
//
// NOTE [safetensors layout] A file is
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8 + N)    a UTF-8 JSON object, padded with spaces to a multiple of 8:
//                         {"__metadata__": {"key": "value", ...},          (optional)
//                          "<name>": {"dtype": "F32", "shape": [2, 3],
//                                     "data_offsets": [begin, end]}, ...}
//   bytes [8 + N, EOF)  the data buffer; each tensor's bytes are [begin, end) relative to
//                       its start, C-contiguous, little-endian.
// The reference implementation (huggingface/safetensors, safetensors/src/tensor.rs) also
// requires the ranges to tile the buffer exactly: sorted by offset, each begins where the
// previous ended, the last ends at EOF. The writer here produces exactly that (tensors
// sorted by descending element size, then name, so every tensor is aligned to its element
// size) and the reader enforces it, so a truncated or padded file is an error.
//
// Thread-safety: WriteSafetensors is reentrant. A SafetensorsReader is immutable after
// Open; its const methods may be called from many threads at once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint/safetensors_header.h"
#include "core/file_system.h"

namespace fulcrum::ckpt {

/// The safetensors name of `dtype` ("F32", "BF16", "BOOL", ...). Supported: F64, F32, F16,
/// BF16, I64, I32, I16, I8, U8, BOOL; anything else is InvalidArgument.
absl::StatusOr<std::string> SafetensorsDtypeName(at::ScalarType dtype);

/// The inverse of SafetensorsDtypeName. Unknown names are InvalidArgument.
absl::StatusOr<at::ScalarType> ScalarTypeFromSafetensorsDtype(std::string_view name);

/// One tensor's header entry.
struct SafetensorsTensorInfo {
  std::string name;
  at::ScalarType dtype = at::ScalarType::Undefined;
  std::vector<int64_t> shape;  // Empty for a 0-d tensor (which holds one element).
  uint64_t begin = 0;          // "data_offsets", relative to the start of the data buffer.
  uint64_t end = 0;

  uint64_t byte_size() const { return end - begin; }
  int64_t numel() const;
};

/// Writes `tensors` and string `metadata` to `path` in safetensors format, replacing any
/// file there. Tensors on another device are copied to the CPU and non-contiguous ones
/// made contiguous one at a time, so peak extra memory is one tensor, never the file.
/// The file is fsync'ed and closed before this returns OK. It is not written atomically:
/// put it in a temporary directory and rename (CheckpointWriter does).
///
/// Names must be non-empty, unique and not "__metadata__". If `checksums` is not null it
/// receives, per name, Xxh3Checksum (core/checkpoint/checksum.h) of the bytes written,
/// computed while streaming so the caller needs no second pass.
absl::Status WriteSafetensors(FileSystem* fs, const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              std::map<std::string, uint64_t>* checksums = nullptr);

/// A memory-mapped safetensors file whose header was fully validated by Open.
class SafetensorsReader {
 public:
  /// Maps `path` and validates its header (ParseSafetensorsHeader, which lists the checks).
  /// Errors are InvalidArgument / DataLoss naming the file and, where it applies, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(FileSystem* fs,
                                                                 const std::string& path);
  /// Open() on DefaultFileSystem().
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  /// Tensor names in file order (by offset).
  const std::vector<std::string>& names() const { return names_; }
  /// The "__metadata__" table (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The header entry for `name`, or null if the file has no such tensor.
  const SafetensorsTensorInfo* info(std::string_view name) const;
  bool Has(std::string_view name) const { return info(name) != nullptr; }

  /// The stored bytes of `name`, pointing into the mapping (valid while this reader
  /// lives). NotFound if absent.
  absl::StatusOr<std::string_view> RawBytes(std::string_view name) const;
  /// A new CPU tensor holding a copy of `name` (owning its memory, so it outlives the
  /// reader). NotFound if absent.
  absl::StatusOr<at::Tensor> Read(std::string_view name) const;

 private:
  SafetensorsReader() = default;

  std::string path_;
  std::unique_ptr<ReadOnlyMemoryRegion> region_;
  uint64_t data_start_ = 0;                           // 8 + header length.
  std::vector<SafetensorsTensorInfo> infos_;          // Sorted by begin.
  std::vector<std::string> names_;                    // Same order as infos_.
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in infos_.
  std::map<std::string, std::string> metadata_;
};

}  // namespace fulcrum::ckpt
