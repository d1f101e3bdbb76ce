// fulcrum_train's outputs, checked for writing before any work: an output that cannot be
// written would otherwise be found only when it is first written — the checkpoint at the
// first save, the timeline at the end of training.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "core/config.h"

namespace fulcrum {

/// Checks that every file or directory `train` and `timeline` (--timeline; empty: none)
/// name can be written the way the run will write it:
///   --save          a directory: created if missing, a probe file written, synced, deleted
///                   (ckpt::CheckSaveDirWritable);
///   --metrics_file,
///   --load_trace    files appended to: opened for appending (created and removed again if
///                   they did not exist);
///   --timeline      a file replaced atomically: its directory created if missing and a probe
///                   file written there, and the path itself is no directory.
/// Every rank may check at once (probe names carry the process id). Nothing is left behind
/// that was not there, also when a write fails. FailedPrecondition naming the flag, the path
/// and the cause.
absl::Status CheckOutputsWritable(const TrainOptions& train, const std::string& timeline);

}  // namespace fulcrum
