#!/usr/bin/env bash
# Installs what Fulcrum needs to build and test (Debian 12 packages) if any is missing,
# then configures and builds into build/ (binaries in build/bin/). Sourced by demo.sh and
# test.sh; safe to run again (installs nothing twice, rebuilds incrementally).
#   FULCRUM_BUILD_DIR   build directory (default: build)
#   FULCRUM_CMAKE_ARGS  extra CMake arguments (e.g. -DFULCRUM_CUDA=ON)
set -euo pipefail

FULCRUM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FULCRUM_BUILD_DIR="${FULCRUM_BUILD_DIR:-$FULCRUM_ROOT/build}"

FULCRUM_PACKAGES=(
  cmake ninja-build g++ pkg-config
  libtorch-dev libopenblas0-pthread   # without OpenBLAS matrix products run ~30x slower
  libgloo-dev                         # c10d ProcessGroupGloo headers
  libgoogle-glog-dev libgflags-dev libabsl-dev
  libgtest-dev libgmock-dev
  libsentencepiece-dev nlohmann-json3-dev libxxhash-dev zlib1g-dev
)

fulcrum_install_packages() {
  local missing=()
  for pkg in "${FULCRUM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  echo "fulcrum: installing ${missing[*]}"
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "fulcrum: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

fulcrum_build() {
  local start=$SECONDS
  cmake -S "$FULCRUM_ROOT" -B "$FULCRUM_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    ${FULCRUM_CMAKE_ARGS:-} >/dev/null
  cmake --build "$FULCRUM_BUILD_DIR" -j "$(nproc)" "$@"
  echo "fulcrum: build finished in $((SECONDS - start)) s"
}
