#!/usr/bin/env bash
# Runs on the device machine from the repository root (after
# docs/gpu-runs/2026-11-26c/stage.sh on the CPU machine). The binaries in .gpubuild were built
# on the CPU machine (FULCRUM_CUDA=ON, sm_75 + PTX) in /work/main/build; their ctest files
# name that path, so /work/main is made to point here. tools/gpu_check.sh --quick with the
# benchmark: the first GPU run of issue 28's memory features (recomputation, sequence
# parallelism, the distributed optimizer, the overlapped gradient reduction).
set -uo pipefail
t0=$SECONDS
root=$PWD
out=${OUT:-/tmp/out}
mkdir -p /work "$out"
[[ -e /work/main ]] || ln -s "$root" /work/main
[[ -e build ]] || ln -s .gpubuild build
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())')"
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L
ldd build/bin/fulcrum_train | grep -E "not found" && echo "MISSING LIBRARIES"
tools/gpu_check.sh --quick --no-build --build-dir /work/main/build --check-timeout 150 "$out/chk"
rc=$?
echo "gpu_check rc=$rc after $((SECONDS - t0)) s"
cat "$out/chk/report.md"
exit $rc
