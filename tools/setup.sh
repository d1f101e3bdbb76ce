#!/usr/bin/env bash
# Installs what Fulcrum needs to build and test if any of it is missing, then configures and
# builds into build/ (binaries in build/bin/). Sourced by demo.sh and test.sh; safe to run
# again (installs nothing twice, rebuilds incrementally).
#
# Two sources:
#  - Debian 12 packages (apt-get): the compiler, CMake, glog, gflags, abseil, GoogleTest,
#    SentencePiece, nlohmann-json, xxhash, Gloo's headers, python3-venv, python3-dev,
#    iproute2.
#  - LibTorch 2.11.0: the one inside PyPI's torch==2.11.0 wheel (a CUDA 13.0 build that also
#    runs without a GPU), pip-installed into a virtual environment, $FULCRUM_VENV
#    (default: .venv/ in the checkout, ignored by git; about 4.6 GB with the nvidia-* wheels).
#    CMake finds it through torch.utils.cmake_prefix_path.
#  - tensorboard (PyPI, pinned), into the same venv: the tests read fulcrum_train's
#    --tensorboard_dir back with it (tests/recipes/tensorboard_check.py).
#  - transformers (PyPI, pinned; CPU, with its safetensors, huggingface_hub and tokenizers),
#    into the same venv: the Hugging Face interoperability test (tests/hf) makes tiny models
#    with it and checks fulcrum_ckpt import-hf / export-hf against it. Offline once installed.
#
#   FULCRUM_BUILD_DIR   build directory (default: build)
#   FULCRUM_CMAKE_ARGS  extra CMake arguments (e.g. -DFULCRUM_CUDA=OFF)
#   FULCRUM_VENV        the virtual environment holding torch (default: .venv)
#   FULCRUM_TORCH_DIR   use this LibTorch instead of the venv's (a directory holding
#                       TorchConfig.cmake, or a LibTorch root); nothing is pip-installed
#   FULCRUM_FUZZ_SECONDS  how long fulcrum_fuzz runs each fuzz target (default 20; 0: none)
#   FULCRUM_FUZZ_BUILD_DIR  the fuzz targets' clang build (default: build-fuzz)
set -euo pipefail

FULCRUM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FULCRUM_BUILD_DIR="${FULCRUM_BUILD_DIR:-$FULCRUM_ROOT/build}"
FULCRUM_VENV="${FULCRUM_VENV:-$FULCRUM_ROOT/.venv}"
FULCRUM_TORCH_VERSION=2.11.0
FULCRUM_TENSORBOARD_VERSION=2.20.0
FULCRUM_TRANSFORMERS_VERSION=5.24.0
# Disk the torch install takes at its peak: the downloaded wheels plus the unpacked venv.
FULCRUM_TORCH_INSTALL_GB=8

FULCRUM_PACKAGES=(
  cmake ninja-build g++ pkg-config
  python3 python3-venv python3-pip   # the venv that holds LibTorch (torch's wheel)
  python3-dev   # Python.h: torch.compile's C++ in the benchmark's reference (tools_test)
  # c10d's ProcessGroupGloo.hpp includes Gloo's headers, which torch's wheel does not ship.
  # Only the declarations are used: every Gloo object is made and freed inside LibTorch.
  libgloo-dev
  libgoogle-glog-dev libgflags-dev libabsl-dev
  libgtest-dev libgmock-dev
  libsentencepiece-dev nlohmann-json3-dev libxxhash-dev zlib1g-dev
  # The store's bind-address tests give themselves an address in a network namespace
  # (unshare, from util-linux, and ip) when the machine has only loopback, as CI may.
  iproute2
  clang libclang-rt-dev   # libFuzzer and the sanitizers of the fuzz targets (tests/fuzz)
)

fulcrum_sudo() {
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "fulcrum: need root or sudo to run: $*" >&2; exit 1; }
    sudo "$@"
  else
    "$@"
  fi
}

fulcrum_install_debian_packages() {
  local missing=()
  for pkg in "${FULCRUM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  echo "fulcrum: installing ${missing[*]}"
  fulcrum_sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive fulcrum_sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# The interpreter that makes the venv: the machine's python3 when it can make one (with
# pip), else Debian's /usr/bin/python3 (python3-venv is in FULCRUM_PACKAGES).
fulcrum_venv_python() {
  local candidate
  for candidate in "$(command -v python3 || true)" /usr/bin/python3; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import ensurepip, venv' >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  echo "fulcrum: no python3 here can make a virtual environment (install python3-venv)" >&2
  return 1
}

# Refuses, naming the directory and the numbers, when $1's file system has less than $2 GB
# free for $3: pip would otherwise die midway with a bare "No space left on device".
fulcrum_check_free_disk() {
  local dir=$1 need_gb=$2 what=$3 free_kb
  mkdir -p "$dir"
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "fulcrum: $what needs about $need_gb GB free under $dir; only $((free_kb / 1024)) MB are" >&2
    echo "fulcrum: free some space (or set FULCRUM_VENV / FULCRUM_TORCH_DIR elsewhere) and run again" >&2
    return 1
  fi
}

fulcrum_torch_installed() {
  [ -x "$FULCRUM_VENV/bin/python" ] &&
    "$FULCRUM_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$FULCRUM_TORCH_VERSION')" \
      >/dev/null 2>&1
}

fulcrum_install_torch() {
  [ -n "${FULCRUM_TORCH_DIR:-}" ] && return 0
  fulcrum_torch_installed && return 0
  local start=$SECONDS python
  python="$(fulcrum_venv_python)"
  echo "fulcrum: installing torch==$FULCRUM_TORCH_VERSION (LibTorch, CUDA 13.0 build) into $FULCRUM_VENV"
  fulcrum_check_free_disk "$(dirname "$FULCRUM_VENV")" "$FULCRUM_TORCH_INSTALL_GB" "the torch install"
  [ -x "$FULCRUM_VENV/bin/python" ] || "$python" -m venv "$FULCRUM_VENV"
  # No pip cache: it would hold a second copy of the ~3 GB of wheels.
  "$FULCRUM_VENV/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check \
    "torch==$FULCRUM_TORCH_VERSION"
  echo "fulcrum: torch installed in $((SECONDS - start)) s"
}

# Whether the venv's python imports module $1 at version $2.
fulcrum_venv_has() {
  "$FULCRUM_VENV/bin/python" -c "import $1, sys; sys.exit($1.__version__ != '$2')" >/dev/null 2>&1
}

# Installs PyPI's $1==$2 into the venv (further requirements after it), unless it is there at
# that version or LibTorch comes from FULCRUM_TORCH_DIR (no venv of ours).
fulcrum_install_pinned() {
  local package=$1 version=$2
  shift 2
  [ -n "${FULCRUM_TORCH_DIR:-}" ] && return 0
  fulcrum_venv_has "$package" "$version" && return 0
  echo "fulcrum: installing $package==$version into $FULCRUM_VENV"
  "$FULCRUM_VENV/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check \
    "$package==$version" "$@"
}

fulcrum_install_packages() {
  fulcrum_install_debian_packages
  fulcrum_install_torch
  fulcrum_install_pinned tensorboard "$FULCRUM_TENSORBOARD_VERSION"
  # torch is already there at its pinned version; pip keeps it (transformers accepts 2.11).
  fulcrum_install_pinned transformers "$FULCRUM_TRANSFORMERS_VERSION" "torch==$FULCRUM_TORCH_VERSION"
}

# Where CMake finds LibTorch: $FULCRUM_TORCH_DIR, else the venv's torch.
fulcrum_torch_cmake_dir() {
  if [ -n "${FULCRUM_TORCH_DIR:-}" ]; then
    echo "$FULCRUM_TORCH_DIR"
  else
    "$FULCRUM_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null
  fi
}

fulcrum_build() {
  local start=$SECONDS torch_dir
  torch_dir="$(fulcrum_torch_cmake_dir)"
  mkdir -p "$FULCRUM_BUILD_DIR"
  local log="$FULCRUM_BUILD_DIR/configure.log"
  if ! cmake -S "$FULCRUM_ROOT" -B "$FULCRUM_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_dir" ${FULCRUM_CMAKE_ARGS:-} >"$log" 2>&1; then
    cat "$log" >&2
    echo "fulcrum: CMake configure failed (log: $log)" >&2
    return 1
  fi
  # What was found: the LibTorch, whether the CUDA build and the NCCL backend are on.
  grep -E '^-- Fulcrum:' "$log" || true
  cmake --build "$FULCRUM_BUILD_DIR" -j "$(nproc)" "$@"
  echo "fulcrum: build finished in $((SECONDS - start)) s"
}

# The fuzz targets (tests/fuzz/CMakeLists.txt): a clang build of the parsers of users'
# files with libFuzzer, ASan and UBSan, then each target fuzzed for FULCRUM_FUZZ_SECONDS
# as a ctest (label "fuzz"), side by side on every core. Fails on any crash; the input is
# in $FULCRUM_FUZZ_BUILD_DIR/artifacts/<target>/.
fulcrum_fuzz() {
  local seconds="${FULCRUM_FUZZ_SECONDS:-20}"
  local dir="${FULCRUM_FUZZ_BUILD_DIR:-$FULCRUM_ROOT/build-fuzz}"
  [ "$seconds" = 0 ] && return 0
  local start=$SECONDS
  mkdir -p "$dir"
  if ! cmake -S "$FULCRUM_ROOT/tests/fuzz" -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DFULCRUM_FUZZ_SECONDS="$seconds" >"$dir/configure.log" 2>&1; then
    cat "$dir/configure.log" >&2
    echo "fulcrum: CMake configure of the fuzz targets failed (log: $dir/configure.log)" >&2
    return 1
  fi
  cmake --build "$dir" -j "$(nproc)"
  ctest --test-dir "$dir" --output-on-failure -j "$(nproc)"
  echo "fulcrum: fuzz targets built and run in $((SECONDS - start)) s"
}
