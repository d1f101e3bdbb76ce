#!/usr/bin/env bash
# Call 3 (after stage.sh): the fix of call 2's failure (the fused AdamW did not bump the
# weights' version counters, so the bf16 compute copies stayed the first weights): the GPU
# tests, the bf16 training check, and the benchmark again.
set -uo pipefail
t0=$SECONDS
root=$PWD
out=${OUT:-/tmp/out}
mkdir -p /work "$out"
[[ -e /work/main ]] || ln -s "$root" /work/main
[[ -e build ]] || ln -s .gpubuild build
site=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nv=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:)
export LD_LIBRARY_PATH="$site/torch/lib:$nv:/usr/local/cuda/lib64:/tmp/fulcrum-prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p /tmp/fulcrum-prefix && for f in .gpubundle/*.deb; do dpkg -x "$f" /tmp/fulcrum-prefix; done
nvidia-smi -L
echo "== GPU tests (at $((SECONDS - t0)) s)"
(cd build && timeout 120 ctest -R 'Gpu|Cuda' --output-on-failure --timeout 100) > "$out/gpu_tests.log" 2>&1
echo "rc=$?"; grep -E "tests passed|Failed|worst relative" "$out/gpu_tests.log"
build/bin/core_test --gtest_filter='MixedPrecisionTest.GpuBf16*' 2>&1 | grep -E "worst|OK|FAILED"
echo "== bf16 training, 3 iterations (at $((SECONDS - t0)) s)"
build/bin/fulcrum_train --recipe=tiny --device=cuda --train_iters=3 --log_interval=1 --bf16 \
  --metrics_file="$out/train_bf16.jsonl" > "$out/train_bf16.log" 2>&1
echo "rc=$?"; grep -o '"loss":[0-9.]*' "$out/train_bf16.jsonl"
echo "== bench_train (at $((SECONDS - t0)) s)"
timeout 200 build/bin/fulcrum_bench_train --device=cuda --bf16 --compare_reference \
  --reference_python=python3 --quick > "$out/bench_train.txt" 2>&1
echo "rc=$?"; tail -10 "$out/bench_train.txt"
echo "done after $((SECONDS - t0)) s"
