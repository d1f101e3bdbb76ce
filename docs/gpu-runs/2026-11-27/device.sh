#!/usr/bin/env bash
# Runs on the device machine from the repository root (after
# docs/gpu-runs/2026-11-26c/stage.sh on the CPU machine). The binaries in .gpubuild were built
# on the CPU machine (FULCRUM_CUDA=ON, sm_75 + PTX) in /work/main/build; their ctest files
# name that path, so /work/main is made to point here. tools/gpu_check.sh --quick with the
# benchmark: the first GPU run of issue 28's memory features (recomputation, sequence
# parallelism, the distributed optimizer, the overlapped gradient reduction).
set -uo pipefail
source docs/gpu-runs/device_env.sh
ldd build/bin/fulcrum_train | grep -E "not found" && echo "MISSING LIBRARIES"
tools/gpu_check.sh --quick --no-build --build-dir /work/main/build --check-timeout 150 "$out/chk"
rc=$?
echo "gpu_check rc=$rc after $((SECONDS - t0)) s"
cat "$out/chk/report.md"
exit $rc
