// The contract between fulcrum_train and fulcrum_launch for re-packing through a checkpoint
// (--repack_via_checkpoint; DESIGN.md "Re-packing"). Header-only and dependency-free, so
// the launcher (which links no LibTorch) shares it.
//
// NOTE [relaunch protocol]
// fulcrum_launch puts kRelaunchFileEnv=PATH into every rank's environment (a file in a
// directory of its own, absent at the start). A job that re-packs saves a checkpoint, and
// then global rank 0 writes PATH atomically (temporary file, rename) as JSON:
//   {"world_size": 2, "args": ["--pipeline_model_parallel_size=2", "--load=DIR"],
//    "reason": "repack: ..."}
// and every rank exits with kRelaunchExitCode. A rank exiting with that code is not a
// failure: the launcher waits for the others (up to its --stop_timeout_s), and when every
// rank exited 0 or kRelaunchExitCode and PATH exists, it starts `world_size` ranks again
// with the same command followed by `args` (gflags: a later flag overrides an earlier
// one). Any other exit code is a failure as always. Without the variable (another
// launcher), the rank logs the flags to relaunch with by hand and exits with the same code.
//
// A live shrink releases ranks in place: each released rank creates the empty file
// DIR/released.RANK, DIR being the directory of kRelaunchFileEnv's file, and exits 0. The
// launcher reports it as a release, and the ranks that go on keep running; a rank failing
// later still ends the job with its error.
#pragma once

#include <string>

namespace fulcrum {

/// EX_TEMPFAIL of sysexits.h: "try again" — here, again with fewer ranks.
inline constexpr int kRelaunchExitCode = 75;

/// The environment variable naming the relaunch request file.
inline constexpr char kRelaunchFileEnv[] = "FULCRUM_RELAUNCH_FILE";

/// The name, in the request file's directory, of global rank `rank`'s release marker.
inline std::string ReleaseMarkerName(int rank) { return "released." + std::to_string(rank); }

}  // namespace fulcrum
