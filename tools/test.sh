#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs the whole test suite through ctest,
# then builds the fuzz targets with clang and fuzzes each for FULCRUM_FUZZ_SECONDS (20 s;
# tests/fuzz/CMakeLists.txt). Extra arguments go to the first ctest (e.g. tools/test.sh
# -R Trainer, or -LE slow); FULCRUM_FUZZ_SECONDS=0 skips the fuzzing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fulcrum_install_packages
fulcrum_build
(cd "$FULCRUM_BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" "$@")
fulcrum_fuzz
