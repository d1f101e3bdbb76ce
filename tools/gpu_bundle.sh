#!/usr/bin/env bash
# tools/gpu_bundle.sh [--dry-run] [--with-cmake] OUTDIR
#
# Gathers, on a machine with a network and Debian's apt, the .deb packages Fulcrum's build
# needs beyond what a GPU machine already has (the CUDA toolkit with NCCL, a python3 with a
# CUDA torch, a C++ compiler, CMake and ninja): glog, gflags, abseil, GoogleTest, sentencepiece,
# nlohmann-json, xxhash, Gloo's headers, zlib's and libunwind's development files, and their
# runtime libraries. tools/gpu_check.sh --bundle OUTDIR unpacks them (dpkg -x) into a prefix
# on the GPU machine, which needs no network.
#
# Writes OUTDIR/*.deb and OUTDIR/MANIFEST (package, version, size in bytes, file), prints the
# bundle's size. --dry-run downloads nothing: it resolves every package against apt's cache
# and writes the MANIFEST of what would be fetched (what the ctest runs; CI has no need to
# download 5 MB each time). --with-cmake adds Debian's cmake and ninja for a machine
# without them (+11 MB).
#
# The list is explicit rather than apt's dependency closure: the closure drags in libc,
# libstdc++ and compilers the GPU machine has, and would pass the ~60 MB budget.
set -euo pipefail

dry_run=0
with_cmake=0
out=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --with-cmake) with_cmake=1 ;;
    -h|--help) sed -n 2,18p "$0"; exit 0 ;;
    -*) echo "gpu_bundle.sh: unknown option '$arg' (expected --dry-run, --with-cmake)" >&2; exit 2 ;;
    *) [[ -z "$out" ]] || { echo "gpu_bundle.sh: one OUTDIR only (got '$out' and '$arg')" >&2; exit 2; }
       out="$arg" ;;
  esac
done
[[ -n "$out" ]] || { echo "usage: tools/gpu_bundle.sh [--dry-run] [--with-cmake] OUTDIR" >&2; exit 2; }
command -v apt-cache >/dev/null || { echo "gpu_bundle.sh: needs Debian's apt (apt-cache not found)" >&2; exit 1; }

# Development packages (headers, CMake configs, static or link libraries) and the runtime
# libraries they link against. Debian 12 names; Ubuntu 24.04 runs Debian 12's libraries
# (its glibc is newer).
packages=(
  libgoogle-glog-dev libgoogle-glog0v6
  libgflags-dev libgflags2.2
  libabsl-dev libabsl20220623
  libgtest-dev libgmock-dev
  libsentencepiece-dev libsentencepiece0
  nlohmann-json3-dev
  libxxhash-dev libxxhash0
  libgloo-dev
  libunwind-dev libunwind8 liblzma-dev
  zlib1g-dev
)
(( with_cmake )) && packages+=(cmake cmake-data ninja-build libjsoncpp25 librhash0)

# The size limit the device machine's carry allows for the whole tree (64 MiB): the bundle
# keeps well under it.
readonly kMaxBytes=$((60 * 1024 * 1024))

mkdir -p "$out"
manifest="$out/MANIFEST"
: >"$manifest.tmp"
missing=()
total=0
for pkg in "${packages[@]}"; do
  info=$(apt-cache show --no-all-versions "$pkg" 2>/dev/null || true)
  version=$(sed -n 's/^Version: //p' <<<"$info" | head -1 || true)
  size=$(sed -n 's/^Size: //p' <<<"$info" | head -1 || true)
  if [[ -z "$version" ]]; then
    missing+=("$pkg")
    continue
  fi
  file=""
  if (( ! dry_run )); then
    # A file of this version already there (an earlier, interrupted run) is kept.
    file=$(cd "$out" && ls -1 "${pkg}_${version//:/%3a}_"*.deb 2>/dev/null | head -1 || true)
    if [[ -z "$file" ]]; then
      (cd "$out" && apt-get download -qq "$pkg" 2>&1 | grep -v "Download is performed unsandboxed" >&2
       exit "${PIPESTATUS[0]}") || { echo "gpu_bundle.sh: apt-get download $pkg failed" >&2; exit 1; }
      file=$(cd "$out" && ls -1 "${pkg}_${version//:/%3a}_"*.deb 2>/dev/null | head -1 || true)
    fi
    [[ -n "$file" ]] && size=$(stat -c %s "$out/$file")
  fi
  total=$((total + size))
  printf '%s\t%s\t%s\t%s\n' "$pkg" "$version" "$size" "${file:-(dry run)}" >>"$manifest.tmp"
done
if (( ${#missing[@]} )); then
  echo "gpu_bundle.sh: apt knows none of: ${missing[*]} (run apt-get update, or this is not Debian 12)" >&2
  exit 1
fi
{
  printf '# Fulcrum GPU bundle (tools/gpu_bundle.sh%s), %s\n' "$( (( dry_run )) && echo ' --dry-run')" "$(date -u +%FT%TZ)"
  printf '# package\tversion\tbytes\tfile\n'
  cat "$manifest.tmp"
} >"$manifest"
rm -f "$manifest.tmp"
if (( total > kMaxBytes )); then
  echo "gpu_bundle.sh: the bundle would be $((total / 1024 / 1024)) MiB, over the 60 MiB budget" >&2
  exit 1
fi
echo "gpu_bundle.sh: ${#packages[@]} packages, $total bytes ($(awk -v b="$total" 'BEGIN{printf "%.1f", b/1048576}') MiB)$( (( dry_run )) && echo ', dry run: nothing downloaded') in $out"
