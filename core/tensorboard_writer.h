// TensorBoard event files (fulcrum_train --tensorboard_dir, Megatron's flag): scalars per
// training iteration, readable by TensorBoard and by anything that reads TensorFlow's
// `events.out.tfevents.*` files.
//
// NOTE [event file format]
// An event file is a sequence of TFRecords, each holding one serialized tensorflow.Event
// protobuf. Both are written by hand from their public specifications: no library in our
// dependencies writes them, and the part we need is small.
//  - TFRecord framing (tensorflow/core/lib/io/record_writer.h, and the TFRecord section of
//    tensorflow.org/tutorials/load_data/tfrecord): uint64 length, uint32 masked CRC32C of
//    those 8 bytes, the data, uint32 masked CRC32C of the data; integers little-endian.
//    masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8.
//  - CRC32C is the Castagnoli CRC (RFC 3720, appendix B.4: reflected polynomial 0x82F63B78).
//  - Event (tensorflow/core/util/event.proto): wall_time = 1 (double), step = 2 (int64),
//    and one of file_version = 3 (string), summary = 5 (Summary), session_log = 7
//    (SessionLog). Summary (tensorflow/core/framework/summary.proto): repeated Value
//    value = 1; Value: tag = 1 (string), simple_value = 2 (float). SessionLog: status = 1
//    (enum; START = 1). Encoded per the protobuf wire format
//    (protobuf.dev/programming-guides/encoding): a key varint (field << 3 | wire type),
//    then a varint, 8 or 4 little-endian bytes, or a length-delimited payload.
// The first record of a file is an Event with file_version "brain.Event:2".
//
// NOTE [tensorboard resume]
// A resumed run writes a new file, never into an old one, and starts it with
// SessionLog START at the first step it will write: TensorBoard then drops the steps of
// earlier files from that step on (the iterations after the checkpoint, which the resumed
// run does again), as it does for TensorFlow's restarted jobs. TensorBoard reads a
// directory's event files in name order, so a new file's name must sort after every
// event file already there: its time field (10 digits, seconds) is made later than theirs
// when the clock says otherwise.
//
// Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/file_system.h"

namespace fulcrum {

/// (tag, value) pairs written at one step.
using Scalars = std::vector<std::pair<std::string, double>>;

namespace tensorboard {

/// CRC32C (Castagnoli) of `data`.
uint32_t Crc32c(std::string_view data);
/// TFRecord's masking of a CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t MaskCrc(uint32_t crc);
/// `data` framed as one TFRecord.
std::string FrameRecord(std::string_view data);

/// Serialized Events (NOTE [event file format]).
std::string FileVersionEvent(double wall_time);
std::string SessionStartEvent(double wall_time, int64_t step);
/// One Summary holding every scalar (as float32 simple_value) at `step`.
std::string ScalarsEvent(double wall_time, int64_t step, const Scalars& scalars);

/// "events.out.tfevents.<seconds, 10 digits>.<host>.<pid>.<n>", TensorBoard's naming.
std::string EventFileName(int64_t seconds, std::string_view host, int64_t pid, int64_t n);

}  // namespace tensorboard

/// FailedPrecondition naming --tensorboard_dir and `dir` unless `dir` exists as (or can be
/// made into) a directory this process can write a file into. Meant for every rank of a
/// job before any work (a probe file is written and removed).
absl::Status CheckTensorBoardDirWritable(FileSystem* fs, const std::string& dir);

/// Writes one event file in a directory.
class TensorBoardWriter {
 public:
  /// Creates `dir` if needed and a new event file in it whose name sorts after every
  /// event file already there (NOTE [tensorboard resume]); writes the file_version event.
  /// Errors name --tensorboard_dir and the path.
  static absl::StatusOr<std::unique_ptr<TensorBoardWriter>> Open(FileSystem* fs,
                                                                 const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  /// SessionLog START at `step`: the first step this file will write (NOTE [tensorboard
  /// resume]).
  absl::Status WriteStart(int64_t step);
  /// One event holding `scalars` at `step`, flushed to the kernel, so a reader following
  /// the file (or a crash) keeps every whole iteration.
  absl::Status WriteScalars(int64_t step, const Scalars& scalars);

  const std::string& path() const { return file_->path(); }

 private:
  explicit TensorBoardWriter(std::unique_ptr<WritableFile> file) : file_(std::move(file)) {}
  absl::Status WriteRecord(const std::string& event);
  std::unique_ptr<WritableFile> file_;
};

}  // namespace fulcrum
