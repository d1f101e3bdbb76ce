# Sourced (from the repository root) by the device scripts under docs/gpu-runs/ on a lent GPU
# machine, after ../gpu-runs/2026-11-26c/stage.sh on the CPU machine: /work/main points at the
# carried tree (the staged ctest files name /work/main/build), build at .gpubuild, the
# machine's torch libraries and the unpacked .gpubundle (tools/gpu_bundle.sh) on
# LD_LIBRARY_PATH. Sets `out` ($OUT, where the run's files come back) and `t0`.
t0=$SECONDS
out=${OUT:-/tmp/out}
mkdir -p /work "$out"
[[ -e /work/main ]] || ln -s "$PWD" /work/main
[[ -e build ]] || ln -s .gpubuild build
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L
