#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs the whole test suite through ctest,
# then builds the fuzz targets with clang and fuzzes each for FULCRUM_FUZZ_SECONDS (20 s;
# tests/fuzz/CMakeLists.txt). Extra arguments go to the first ctest (e.g. tools/test.sh
# -R Trainer, or -LE slow); FULCRUM_FUZZ_SECONDS=0 skips the fuzzing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fulcrum_install_packages
fulcrum_build
# The tests' scratch files (checkpoints, corpora, logs) go under the build directory, fresh
# each run, never into /tmp: what a crashed or failed test leaves goes with the build.
# tests/temp_dir.h removes a passing test's directories as it exits.
FULCRUM_TEST_TMPDIR="$FULCRUM_BUILD_DIR/test-tmp"
rm -rf "$FULCRUM_TEST_TMPDIR"
mkdir -p "$FULCRUM_TEST_TMPDIR"
export TEST_TMPDIR="$FULCRUM_TEST_TMPDIR" TMPDIR="$FULCRUM_TEST_TMPDIR"
(cd "$FULCRUM_BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" "$@")
fulcrum_fuzz
