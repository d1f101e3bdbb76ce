#!/usr/bin/env bash
# Installs what is missing, builds everything, and runs the whole test suite through ctest.
# Extra arguments go to ctest (e.g. tools/test.sh -R Trainer, or -LE slow).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
fulcrum_install_packages
fulcrum_build
cd "$FULCRUM_BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" "$@"
